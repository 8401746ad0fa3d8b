"""The two images `make images` builds with buildah (no daemon): the operator image holds no torch
and none of the worker, local-stack or benchmark code and its console script runs; the worker image
runs as uid 1000 and imports torch, safetensors and NIXL.

Building them takes minutes and several GB (the worker's torch), so these tests run only with
WEIGHTLIFT_IMAGES=1 (`make test-images`); the fixture builds through hack/build-images.sh, whose
layer cache makes a rebuild of an unchanged checkout take seconds. Needs root (buildah's storage,
`buildah mount`) and buildah + debootstrap, which hack/build-image-base.sh installs on Debian.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.images.buildah import BUILD_TIMEOUT_S, REPO, build
from tests.images.buildah import attempt as _try
from tests.images.buildah import buildah as _buildah
from tests.images.buildah import config as _config
from tests.images.buildah import dev_only_code as _dev_only_code
from tests.images.buildah import files as _files
from tests.images.buildah import run as _run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S)]


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """target -> image name, built (or found up to date) by hack/build-images.sh."""
    return build("operator", "worker")


def test_operator_image_has_no_torch_and_no_dev_or_worker_code(images: dict[str, str]) -> None:
    paths = _files(images["operator"])
    assert any(p.endswith("weightlift/operator/run.py") for p in paths), "operator code missing"
    assert not [p for p in paths if p.endswith(("/torch", "/torch/__init__.py"))]
    assert not _dev_only_code(paths)
    assert not [p for p in paths if "/weightlift/worker" in f"/{p}"]
    probe = (
        "import importlib.util as u; "
        "print([m for m in ('torch', 'safetensors', 'weightlift.local', 'weightlift.bench',"
        " 'weightlift.worker') if u.find_spec(m)])"
    )
    assert _run(images["operator"], "python3", "-c", probe).strip() == "[]"


def test_operator_image_runs_weightlift(images: dict[str, str]) -> None:
    config = _config(images["operator"])
    assert config.get("Entrypoint") == ["weightlift", "operator"]
    assert config.get("User") == "1000"
    out = _run(images["operator"], "weightlift", "--help")
    assert "Usage: weightlift" in out and "operator" in out
    out = _run(images["operator"], "weightlift", "operator", "--help")
    assert "Usage: weightlift operator" in out
    # The dev-only commands stay listed (entry points) but say clearly that they are absent.
    demo = _try(images["operator"], "weightlift", "demo")
    assert demo.returncode != 0
    assert "needs the module 'weightlift.local'" in demo.stderr, demo.stderr


def test_worker_image_runs_as_uid_1000(images: dict[str, str]) -> None:
    config = _config(images["worker"])
    assert config.get("User") == "1000"
    assert config.get("Cmd") == ["weightlift", "worker"]
    assert _run(images["worker"], "id", "-u", user=str(config["User"])).strip() == "1000"


WORKER_PROBE = """
import os, tempfile
import torch, safetensors.torch as st
from weightlift.worker.p2p.nixl_compat import nixl
t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
st.save_file({"w": t}, path)
assert torch.equal(st.load_file(path)["w"], t)
mod = nixl()
config = mod.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
agent = mod.nixl_agent("image-test", config)
reg = agent.register_memory([(t.data_ptr(), t.nbytes, 0, "")], "DRAM")
agent.deregister_memory(reg)
print(os.getuid(), torch.__version__, mod.__name__, "ok")
"""


def test_worker_image_imports_torch_safetensors_and_nixl(images: dict[str, str]) -> None:
    out = _run(images["worker"], "python3", "-c", WORKER_PROBE).split()
    assert out[0] == "1000" and out[-1] == "ok", out
    assert "nixl" in out[2]
    assert "Usage: weightlift worker" in _run(images["worker"], "weightlift", "worker", "--help")


def test_worker_image_ships_no_dev_only_code(images: dict[str, str]) -> None:
    paths = _files(images["worker"])
    assert any(p.endswith("weightlift/worker/main.py") for p in paths), "worker code missing"
    assert not _dev_only_code(paths)


# -- stretch: the chart's operator pod runs from the operator image's root filesystem
MD_NAME = "tiny"


@pytest.fixture(scope="module")
def image_stack(images: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.e2e.conftest import _require_binaries
    from weightlift.local.images import image_rootfs, release_rootfs
    from weightlift.local.stack import LocalStack

    _require_binaries()
    root = tmp_path_factory.mktemp("image-stack")
    (root / "models").mkdir()
    operator = images["operator"]
    rootfs = image_rootfs(operator)
    stack = LocalStack(
        root / "stack",
        node_name="image-node",
        install="helm",
        model_path_prefixes=(str(root / "models"),),
        worker_env={"CUDA_VISIBLE_DEVICES": ""},
        image_roots={operator: rootfs},
        operator_image=operator,
    )
    try:
        with stack:
            yield stack, rootfs, root / "models"
    finally:
        release_rootfs(operator)


def test_operator_pod_runs_from_the_image_and_a_deployment_gets_ready(image_stack: Any) -> None:
    from tests.support.e2e import READY_TIMEOUT
    from weightlift.local.observe import Observer
    from weightlift.local.podidentity import SERVICE_ACCOUNT_DIR, inside
    from weightlift.local.stack import make_demo_model

    stack, rootfs, models = image_stack
    pod = stack.release.operator_pod()
    runner = stack.process_node.pods()[f"{stack.release.namespace}/{pod['metadata']['name']}"]
    (pid,) = runner.pids()
    # The process's root is the image's filesystem: the image's Python, no torch, the token.
    assert os.readlink(f"/proc/{pid}/root") == str(rootfs)
    assert os.readlink(f"/proc/{pid}/exe").startswith(str(rootfs) + "/usr/bin/python3")
    seen = Path(f"/proc/{pid}/root")
    assert not list(seen.glob("usr/local/lib/python3*/dist-packages/torch"))
    token = inside(seen, SERVICE_ACCOUNT_DIR) / "token"  # /var/run -> /run, in its root
    assert token.read_text().count(".") == 2

    manifest = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    assert manifest["metadata"]["name"] == MD_NAME
    make_demo_model(models / MD_NAME, 4.0, hook=False)
    manifest["spec"]["model"]["uri"] = f"hostpath://{models / MD_NAME}"
    stack.apply(manifest)
    replicas = int(manifest["spec"].get("replicas", 1))

    def ready(o: Observer) -> bool:
        return o.phase() == "Ready" and int(o.status().get("readyReplicas", 0)) == replicas

    Observer(stack, MD_NAME).wait(ready, READY_TIMEOUT, f"{MD_NAME}: {replicas} replicas Ready")


# -- pushing, as the README says: to a real registry (CNCF Distribution) on loopback and back
@pytest.fixture(scope="module")
def registry(images: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """host:port of a registry built by hack/build-registry.sh (`make registry`)."""
    from weightlift.local.net import free_port

    script = (REPO / "hack" / "build-registry.sh").read_text()
    version = script.split('REGISTRY_VERSION="', 1)[1].split('"', 1)[0]
    cache = Path(os.environ.get("WL_CACHE", Path.home() / ".cache" / "weightlift"))
    binary = cache / f"registry-{version}" / "bin" / "registry"
    assert binary.is_file(), f"{binary} missing: run `make registry`"
    root = tmp_path_factory.mktemp("registry")
    address = f"127.0.0.1:{free_port()}"
    config = {
        "version": 0.1,
        "storage": {"filesystem": {"rootdirectory": str(root / "data")}},
        "http": {"addr": address},
        "log": {"level": "warn"},
    }
    (root / "config.yml").write_text(yaml.safe_dump(config))
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen(
        [str(binary), "serve", str(root / "config.yml")], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{address}/v2/", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        assert proc.poll() is None, (root / "registry.log").read_text()
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_operator_image_pushes_to_a_registry_and_pulls_back_the_same(
    images: dict[str, str], registry: str
) -> None:
    image = images["operator"]
    remote = f"{registry}/weightlift/weightlift:pushed"
    _buildah("push", "--tls-verify=false", image, f"docker://{remote}", timeout=600)
    tags = httpx.get(f"http://{registry}/v2/weightlift/weightlift/tags/list", timeout=10).json()
    assert tags["tags"] == ["pushed"]
    _buildah("pull", "--tls-verify=false", remote, timeout=600)
    try:
        pulled = json.loads(_buildah("inspect", "--type", "image", remote))
        built = json.loads(_buildah("inspect", "--type", "image", image))
        assert pulled["FromImageID"] == built["FromImageID"]
        assert pulled["OCIv1"]["config"]["Entrypoint"] == ["weightlift", "operator"]
    finally:
        _buildah("rmi", remote)
