"""A team's own vLLM image (spec.template.worker Injected, operator/inject.py): the rendered pod
and the status that names why such an image cannot run weightlift."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from pydantic import ValidationError

from weightlift.api.model import INJECTED_WORKER_MESSAGE, EnvVar, ModelDeploymentSpec, Role
from weightlift.api.worker import WorkerReport
from weightlift.operator.identity import model_identity
from weightlift.operator.inject import (
    BUNDLE_MOUNT,
    DEFAULT_BUNDLE_IMAGE,
    ENGINE_ENV,
    INIT_CONTAINER,
    LAUNCHER,
    injection_failure,
    not_needed,
)
from weightlift.operator.planning import DesiredPod, pod_name
from weightlift.operator.pods import render_pod
from weightlift.operator.reconcile import _termination
from weightlift.operator.settings import WORKER_BUNDLE_IMAGE_ENV, Settings

STOCK = "vllm/vllm-openai:v0.32.0"


def spec_of(worker: str = "Injected", engine: str = "vLLM") -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate(
        {
            "model": {"uri": "hostpath:///models/llama", "format": "safetensors"},
            "template": {"image": STOCK, "worker": worker},
            "runtime": {"engine": engine},
        }
    )


def render(spec: ModelDeploymentSpec, settings: Settings | None = None) -> dict[str, Any]:
    identity = model_identity(spec)
    want = DesiredPod(pod_name("llama", identity, 0), 0, Role.SOURCE, identity, [])
    return render_pod("llama", "ml", "uid-1", spec, want, settings=settings)


def test_the_worker_keeps_the_teams_image_and_runs_the_launcher_from_the_init_containers_copy() -> (
    None
):
    pod = render(spec_of())
    (worker,) = pod["spec"]["containers"]
    (init,) = pod["spec"]["initContainers"]
    assert worker["image"] == STOCK
    assert worker["command"] == ["/bin/sh", LAUNCHER] and LAUNCHER.startswith(BUNDLE_MOUNT)
    assert init["name"] == INIT_CONTAINER and init["image"] == DEFAULT_BUNDLE_IMAGE
    # An hostpath:// model with the Auto strategy: NIXL (P2P) is copied, boto3 (s3://) is not.
    assert init["command"] == ["/opt/weightlift-bundle/copy.sh", BUNDLE_MOUNT, "boto3"]
    (init_mount,) = init["volumeMounts"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == init_mount["name"])
    assert volume == {
        "name": init_mount["name"],
        "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"},
    }
    worker_mount = next(m for m in worker["volumeMounts"] if m["name"] == volume["name"])
    assert worker_mount == {**init_mount, "readOnly": True}
    assert init_mount["mountPath"] == BUNDLE_MOUNT
    # Read-only root in both: the copy goes to the emptyDir, the caches to /tmp.
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["HOME"] == "/tmp" and env["XDG_CACHE_HOME"] == "/tmp/.cache"
    assert any(m["mountPath"] == "/tmp" for m in worker["volumeMounts"])
    assert pod["spec"]["restartPolicy"] == "Never"
    # What create_namespaced_pod sends: the client's own V1Pod model takes it.
    client.ApiClient().sanitize_for_serialization(client.V1Pod.model_validate(pod))


def test_the_bundle_image_is_the_operators_setting() -> None:
    settings = Settings.from_environment({WORKER_BUNDLE_IMAGE_ENV: "reg.local/wl/bundle:7"})
    (init,) = render(spec_of(), settings)["spec"]["initContainers"]
    assert init["image"] == "reg.local/wl/bundle:7"


def test_a_users_home_wins_over_the_cache_default() -> None:
    spec = spec_of()
    spec.template.env = [EnvVar(name="HOME", value="/scratch")]
    env = [e for e in render(spec)["spec"]["containers"][0]["env"] if e["name"] == "HOME"]
    assert env == [{"name": "HOME", "value": "/scratch"}]


@pytest.mark.parametrize(
    ("uri", "strategy", "s3_store", "skipped"),
    [
        ("hostpath:///models/llama", "Auto", False, ["boto3"]),
        ("s3://bucket/llama", "Auto", False, []),
        ("hostpath:///models/llama", "Auto", True, []),
        ("hostpath:///models/llama", "Preload", False, ["boto3", "nixl_cu12"]),
        ("s3://bucket/llama", "Direct", False, ["nixl_cu12"]),
    ],
)
def test_the_copy_leaves_out_what_the_deployment_never_imports(
    uri: str, strategy: str, s3_store: bool, skipped: list[str]
) -> None:
    spec = spec_of()
    spec.model.uri = uri
    spec.loading.strategy = strategy  # type: ignore[assignment]
    assert not_needed(spec, s3_store) == skipped


def test_in_image_pods_are_unchanged() -> None:
    pod = render(spec_of("InImage"))
    assert "initContainers" not in pod["spec"]
    assert pod["spec"]["containers"][0]["command"] == ["weightlift", "worker"]


@pytest.mark.parametrize(
    "runtime", [{"engine": "Builtin"}, {"type": "External", "command": ["serve"]}]
)
def test_injected_needs_vllm_or_triton(runtime: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=r"template\.worker Injected"):
        ModelDeploymentSpec.model_validate(
            {
                "model": {
                    "uri": "hostpath:///m",
                    "format": "pt2" if runtime.get("engine") == "Builtin" else "safetensors",
                },
                "template": {"worker": "Injected"},
                "runtime": runtime,
            }
        )
    assert "spec.template.worker" in INJECTED_WORKER_MESSAGE


@pytest.mark.parametrize("engine", ["vLLM", "Triton"])
def test_the_launcher_is_told_the_engine_to_check_the_image_for(engine: str) -> None:
    """A team's Triton image (NGC's tritonserver with its Python backend and vLLM) is injected
    as a vLLM image is; the launcher then also looks for tritonserver and its Python backend."""
    pod = render(spec_of(engine=engine))
    (worker,) = pod["spec"]["containers"]
    assert worker["image"] == STOCK and worker["command"] == ["/bin/sh", LAUNCHER]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env[ENGINE_ENV] == engine


def _pod(init: dict[str, Any] | None = None, worker: dict[str, Any] | None = None) -> Any:
    status: dict[str, Any] = {"phase": "Failed"}
    if init is not None:
        status["initContainerStatuses"] = [
            {"name": INIT_CONTAINER, "image": "wl/bundle:1", "state": init}
        ]
    if worker is not None:
        status["containerStatuses"] = [{"name": "worker", "image": STOCK, "state": worker}]
    return {"status": status}


def test_the_copys_own_report_names_no_space() -> None:
    message = json.dumps(
        {
            "phase": "Failed",
            "permanentFailure": True,
            "message": "NoSpaceForWorker: copying weightlift (310 MB) into /w (2 MB free) failed",
        }
    )
    found = injection_failure(_pod(init={"terminated": {"exitCode": 1, "message": message}}))
    assert found is not None
    text, report = found
    assert text.startswith("NoSpaceForWorker:") and report.permanent_failure


def test_an_init_container_that_dies_without_a_report_is_named() -> None:
    state = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    found = injection_failure(_pod(init=state))
    assert found is not None
    text, report = found
    assert text == (
        "CopyFailed: the init container that copies weightlift (wl/bundle:1) exited with code "
        "137: OOMKilled"
    )
    assert report.permanent_failure and report.phase == "Failed"


def test_an_image_without_sh_is_a_start_error_named_as_such() -> None:
    containerd = 'exec: "/bin/sh": stat /bin/sh: no such file or directory'
    state = {"terminated": {"exitCode": 128, "reason": "StartError", "message": containerd}}
    found = injection_failure(_pod(worker=state))
    assert found is not None
    text, report = found
    assert text.startswith(f"NoShell: image {STOCK} cannot start") and containerd in text
    assert report.permanent_failure


def test_a_running_or_finished_copy_is_no_failure() -> None:
    assert injection_failure(_pod(init={"terminated": {"exitCode": 0}})) is None
    assert injection_failure(_pod(init={"running": {}})) is None
    assert injection_failure({"status": {}}) is None


def test_the_launchers_refusal_is_read_as_a_permanent_report() -> None:
    """The launcher writes the same JSON to the worker's termination log (bundle/launch.sh)."""
    message = (
        '{"phase":"Failed","permanentFailure":true,"message":"UnsupportedVLLM: vLLM 0.9.2 at '
        "/opt/venv/lib/python3.12/site-packages/vllm; weightlift's load-format plugin supports "
        'vLLM 0.32.x"}'
    )
    _, report = _termination(_pod(worker={"terminated": {"exitCode": 3, "message": message}}))
    assert isinstance(report, WorkerReport) and report.permanent_failure
    assert report.message.startswith("UnsupportedVLLM: vLLM 0.9.2")
