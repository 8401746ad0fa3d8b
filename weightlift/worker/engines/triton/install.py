"""Where tritonserver, its Python backend and the stub for the engine's Python live.

`hack/install-triton.sh` unpacks them from `nvidia-pytriton` into $WL_CACHE/triton-<version>
(or set WEIGHTLIFT_TRITON_HOME to another tree of that layout, or to a directory whose
bin/tritonserver and backends-py<X.Y>/python/ hold them). The stub embeds the engine Python's
libpython, so the engine's Python version picks the backend directory; `engine_python_info`
asks that interpreter what the stub needs (version, shared libpython, site-packages).

A team's own Triton image (spec.template.worker Injected; bundle/launch.sh sets
WEIGHTLIFT_TRITON_HOME, e.g. /opt/tritonserver) has one Python backend, backends/python, whose
stub was built for that image's Python and numpy: it is used as it is, with no numpy of ours.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from weightlift.worker.weights.progress import LoadError

HOME_ENV = "WEIGHTLIFT_TRITON_HOME"
TRITON_VERSION = "2.51"
INSTALL_HINT = "hack/install-triton.sh builds it"
STUB = "triton_python_backend_stub"
# A Triton image's own backends directory (its Python backend built for the image's Python).
OWN_BACKENDS = "backends"


class TritonMissing(LoadError):
    """tritonserver, its Python backend or the stub for the engine's Python is not installed;
    permanent: restarting the pod cannot install it."""

    permanent = True


def triton_home() -> Path:
    explicit = os.environ.get(HOME_ENV)
    if explicit:
        return Path(explicit)
    cache = os.environ.get("WL_CACHE") or str(Path.home() / ".cache" / "weightlift")
    return Path(cache) / f"triton-{TRITON_VERSION}"


def server_root(home: Path | None = None) -> Path:
    """The directory with bin/tritonserver (the wheel's pytriton/tritonserver, or `home`)."""
    home = home or triton_home()
    for root in (home / "pytriton" / "tritonserver", home):
        if (root / "bin" / "tritonserver").is_file():
            return root
    raise TritonMissing(
        f"tritonserver not found: neither {home}/pytriton/tritonserver/bin/tritonserver nor "
        f"{home}/bin/tritonserver exists (set {HOME_ENV}; {INSTALL_HINT})"
    )


def _has_python_backend(backends: Path) -> bool:
    return (backends / "python" / STUB).is_file() and (
        backends / "python" / "libtriton_python.so"
    ).is_file()


def backend_dir(root: Path, python_version: str) -> Path:
    """--backend-directory for `python_version` ("3.11"): its python/ holds the stub. The stub
    per Python version (backends-py<X.Y>) first, else the image's own (backends, OWN_BACKENDS)."""
    found = root / f"backends-py{python_version}"
    for backends in (found, root / OWN_BACKENDS):
        if _has_python_backend(backends):
            return backends
    have = sorted(
        p.name.removeprefix("backends-py")
        for p in root.glob("backends-py*")
        if (p / "python" / STUB).is_file()
    )
    raise TritonMissing(
        f"no Triton Python backend stub for Python {python_version}: {found}/python/{STUB} "
        f"does not exist (stubs in {root}: {', '.join(have) or 'none'}; {INSTALL_HINT})"
    )


def stub_site(
    python_version: str, home: Path | None = None, backends: Path | None = None
) -> Path | None:
    """numpy 1.x for the stub of `python_version`: Triton 2.51's stub (pybind11) misreads numpy
    2's arrays, garbling every BYTES tensor. It goes ahead of the engine's site-packages.
    None for an image's own backend (`backends` named OWN_BACKENDS) without one: that stub was
    built against the image's numpy."""
    home = home or triton_home()
    site = home / "stub-site" / f"py{python_version}"
    if backends is not None and backends.name == OWN_BACKENDS and not (site / "numpy").is_dir():
        return None
    if not (site / "numpy").is_dir():
        raise TritonMissing(
            f"no numpy 1.x for Triton's Python {python_version} stub: {site}/numpy does not "
            f"exist ({INSTALL_HINT} with ENGINE_PYTHON set to the engine's Python)"
        )
    return site


@dataclass(frozen=True)
class PythonInfo:
    """What the stub needs of the engine's Python."""

    executable: str
    version: str  # "3.11"
    libdir: str  # where its libpython3.X.so lives
    shared: bool  # built with a shared libpython (the stub links against one)
    site_dirs: list[str]


_PROBE = """
import json, site, sys, sysconfig
print(json.dumps({
    "executable": sys.executable,
    "version": "%d.%d" % sys.version_info[:2],
    "libdir": sysconfig.get_config_var("LIBDIR") or "",
    "shared": bool(sysconfig.get_config_var("Py_ENABLE_SHARED")),
    "site_dirs": site.getsitepackages(),
}))
"""


def engine_python_info(python: str) -> PythonInfo:
    try:
        out = subprocess.run(
            [python, "-c", _PROBE], check=True, capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise TritonMissing(f"the engine's Python {python} does not run: {exc}") from None
    info = PythonInfo(**json.loads(out))
    if not info.shared:
        raise TritonMissing(
            f"the engine's Python {python} has no shared libpython{info.version}.so (the Triton "
            "Python backend stub links against one; build Python with --enable-shared)"
        )
    # The venv's python, not the interpreter it links to: vLLM spawns children with it.
    return PythonInfo(
        executable=python,
        version=info.version,
        libdir=info.libdir,
        shared=True,
        site_dirs=info.site_dirs,
    )
