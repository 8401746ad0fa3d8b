"""Repack a nixl-cu1x wheel with only what weightlift's P2P needs, so that it fits the 64 MiB a
GPU host's `device` call carries beside the project.

Kept: the Python package, libnixl and its helpers, the UCX and POSIX backend plugins, UCX's own
transport modules except perftest, and every bundled library those need (their ELF NEEDED
entries, followed transitively). Dropped: nixl_ep (expert-parallel kernels, one ~31 MB library per
torch version), the example scripts and headers, the other backend plugins (GDS, object stores,
GPUNETIO, libfabric, ...) and telemetry exporters, and any bundled library nothing kept needs.
RECORD is rewritten to list what is kept.

    python hack/slim_nixl_wheel.py IN.whl OUT_DIR
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

KEEP_PLUGINS = {"libplugin_UCX.so", "libplugin_POSIX.so"}
DROP_PARTS = re.compile(r"^(nixl_ep_cu\d+/|nixl_cu\d+\.scripts/|nixl_cu\d+-[^/]+\.data/)")
ELF_MAGIC = b"\x7fELF"


def needed(data: bytes) -> set[str]:
    """NEEDED sonames of an ELF image (readelf: binutils is on any machine that builds wheels)."""
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        out = subprocess.run(
            ["readelf", "-d", f.name], capture_output=True, text=True, check=True
        ).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))


def dropped_up_front(name: str) -> bool:
    path = PurePosixPath(name)
    if DROP_PARTS.match(name):
        return True
    if path.parent.name in ("plugins", "nixl") and path.name.endswith(".so"):
        return path.name not in KEEP_PLUGINS
    return path.parent.name == "ucx" and "perftest" in path.name


def slim(src: Path, out_dir: Path) -> Path:
    with zipfile.ZipFile(src) as zin:
        names = [n for n in zin.namelist() if not dropped_up_front(n)]
        # Bundled libraries (auditwheel's *.libs/ and meson's .*.mesonpy.libs/) are kept only
        # when something kept needs them; everything else that is kept is a root.
        bundled = {
            PurePosixPath(n).name: n
            for n in names
            if ".libs/" in n and "/" not in n.split(".libs/", 1)[1] and ".so" in n
        }
        roots = [n for n in names if n not in bundled.values()]
        keep = set(roots)
        todo = [n for n in roots if zin.read(n)[:4] == ELF_MAGIC]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for soname in needed(zin.read(name)):
                lib = bundled.get(soname)
                if lib is not None and lib not in keep:
                    keep.add(lib)
                    todo.append(lib)
        out = out_dir / src.name
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for name in names:
                if name not in keep or name == record:
                    continue
                zout.writestr(zin.getinfo(name), zin.read(name))
            lines = zin.read(record).decode().splitlines()
            kept = [ln for ln in lines if ln.split(",", 1)[0] in keep or ln.startswith(record)]
            zout.writestr(zin.getinfo(record), "\n".join(kept) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src = Path(sys.argv[1])
    result = slim(src, Path(sys.argv[2]))
    print(f"{result}: {src.stat().st_size / 1e6:.1f} MB -> {result.stat().st_size / 1e6:.1f} MB")
