"""Bring your own engine image: weightlift joins a team's stock vLLM or Triton image without a
rebuild.

With `spec.template.worker: Injected`, `spec.template.image` is the team's own vLLM image (its
vLLM version, CUDA, Python, patches), or with `runtime.engine: Triton` its Triton image (its
tritonserver, Python backend and the vLLM the backend runs), and holds no weightlift. The pod
then gets:

- an init container of weightlift's worker-bundle image (the operator's setting, the chart's
  `workerBundle.image`) that copies a self-contained worker into an emptyDir: weightlift's
  pure-Python package, the pure dependencies a vLLM image may lack, and the compiled ones per
  Python ABI (xxhash, NIXL), built into that image at build time (hack/build-bundle.sh);
- the worker container keeps the user's image; its command is the bundle's POSIX sh launcher
  (bundle/launch.sh), which finds the image's Python, checks its version, its vLLM's version
  and plugin API, puts only the bundled dependencies the image lacks on PYTHONPATH, after
  weightlift (the image's own torch, pydantic, numpy, ... win), and execs the worker; for
  Triton (ENGINE_ENV) it also finds tritonserver and its Python backend (the worker then runs
  the image's own, WEIGHTLIFT_TRITON_HOME).

Why explicit rather than guessed from the image: the operator cannot look inside an image
before the pod runs, and a wrong guess would either shadow a team's worker image or crash a
stock one. Why an init container and an emptyDir rather than an image volume: image volumes
need a recent containerd (and feature gates) that many clusters lack; an emptyDir works on
every node. Why a separate small image rather than the 6 GB worker image: the init container's
pull is on the replica's path to Ready (issue 46 wants no slower than preload).

Failures are never a silent crash loop: worker pods have restartPolicy Never; the launcher and
the copy write a permanent WorkerReport to the termination log (NoPython, WrongPython, NoVLLM,
UnsupportedVLLM, MissingDependency, NoWritableVolume, NoSpaceForWorker, NoTritonServer,
NoPythonBackend, ...), which
`injection_failure` reads (with the init container's status and a worker container that could
not even start, e.g. an image without /bin/sh) into the replica's status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from weightlift.api.model import DEFAULT_WORKER_IMAGE, ModelDeploymentSpec, pulls_from_peers
from weightlift.api.uri import ModelUri
from weightlift.api.worker import WorkerPhase, WorkerReport

INJECTED = "Injected"
# The chart's worker-bundle image, beside the CRD's default worker image.
DEFAULT_BUNDLE_IMAGE = DEFAULT_WORKER_IMAGE.replace("/worker:", "/worker-bundle:")
BUNDLE_SOURCE = "/opt/weightlift-bundle"
# Where the bundle lands in both containers (an emptyDir).
BUNDLE_MOUNT = "/var/run/weightlift/worker"
BUNDLE_VOLUME = "weightlift-worker"
INIT_CONTAINER = "weightlift-worker"
LAUNCHER = f"{BUNDLE_MOUNT}/launch.sh"
# The bundle's tmpfs: all of it for every ABI is ~0.3 GB; beyond this the copy fails with
# NoSpaceForWorker (the kubelet sizes a memory emptyDir's tmpfs to its limit).
BUNDLE_SIZE_LIMIT = "1Gi"
# A stock image's HOME (/root) is neither the pod user's nor writable under a read-only root:
# vLLM, torch and Hugging Face keep their caches in the pod's /tmp emptyDir instead.
CACHE_ENV = {"HOME": "/tmp", "XDG_CACHE_HOME": "/tmp/.cache", "XDG_CONFIG_HOME": "/tmp/.config"}
# The engine the launcher checks the image for (vLLM; Triton: also tritonserver and its Python
# backend).
ENGINE_ENV = "WEIGHTLIFT_INJECTED_ENGINE"


def injected(spec: ModelDeploymentSpec) -> bool:
    return spec.template.worker == INJECTED


def not_needed(spec: ModelDeploymentSpec, s3_compile_store: bool) -> list[str]:
    """Bundled dependencies this deployment's pods need no copy of (the copy is on the path to
    Ready): boto3 reads s3:// models and the s3:// compile store only; NIXL serves and pulls P2P
    only (a strategy of Preload or Direct never does)."""
    skip = []
    if ModelUri.parse(spec.model.uri).scheme != "s3" and not s3_compile_store:
        skip.append("boto3")
    if not pulls_from_peers(spec.loading, spec.runtime):
        skip.append("nixl_cu12")
    return skip


def inject_worker(
    pod: dict[str, Any],
    spec: ModelDeploymentSpec,
    bundle_image: str | None,
    s3_compile_store: bool = False,
) -> None:
    """Turn a rendered worker pod (pods.render_pod) into one that runs weightlift from the
    worker-bundle image's init container in the template's own image (in place)."""
    pod_spec = pod["spec"]
    (worker,) = [c for c in pod_spec["containers"] if c["name"] == "worker"]
    mount = {"name": BUNDLE_VOLUME, "mountPath": BUNDLE_MOUNT}
    # In memory: the copy is on the path to Ready, and tmpfs took a third of the disk's time
    # here (bench vllm's own-image row); it counts toward the pod's memory (~0.3 GB).
    volume = {"medium": "Memory", "sizeLimit": BUNDLE_SIZE_LIMIT}
    pod_spec["volumes"].append({"name": BUNDLE_VOLUME, "emptyDir": volume})
    pod_spec["initContainers"] = [
        {
            "name": INIT_CONTAINER,
            "image": bundle_image or DEFAULT_BUNDLE_IMAGE,
            "imagePullPolicy": worker["imagePullPolicy"],
            "command": [
                f"{BUNDLE_SOURCE}/copy.sh",
                BUNDLE_MOUNT,
                *not_needed(spec, s3_compile_store),
            ],
            "volumeMounts": [mount],
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
    ]
    # The launcher execs `python -m weightlift worker`: the image's own ENTRYPOINT is replaced.
    worker["command"] = ["/bin/sh", LAUNCHER]
    worker["volumeMounts"].append({**mount, "readOnly": True})
    names = {e["name"] for e in worker["env"]}
    worker["env"] += [{"name": k, "value": v} for k, v in CACHE_ENV.items() if k not in names]
    worker["env"].append({"name": ENGINE_ENV, "value": str(spec.runtime.engine)})


def _report(message: str, reason: str) -> tuple[str, WorkerReport]:
    text = f"{reason}: {message}"
    return text, WorkerReport(phase=WorkerPhase.FAILED, message=text, permanent_failure=True)


def _parsed(terminated: Mapping[str, Any]) -> WorkerReport | None:
    try:
        return WorkerReport.model_validate_json(terminated.get("message") or "")
    except ValidationError:
        return None


def injection_failure(pod: Mapping[str, Any]) -> tuple[str, WorkerReport] | None:
    """Why an injected worker cannot run, as a permanent report: the init container's copy
    failed, or the worker container could not start (no /bin/sh in the image). The launcher's
    own refusals are the worker container's termination message (reconcile reads those)."""
    status = pod.get("status") or {}
    for cs in status.get("initContainerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if cs.get("name") != INIT_CONTAINER or not terminated or not terminated.get("exitCode"):
            continue
        report = _parsed(terminated)
        if report is not None:
            return report.message, report
        detail = terminated.get("message") or terminated.get("reason") or ""
        return _report(
            f"the init container that copies weightlift ({cs.get('image')}) exited with code "
            f"{terminated.get('exitCode')}: {detail}".strip(),
            "CopyFailed",
        )
    for cs in status.get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if cs.get("name") == "worker" and terminated.get("reason") == "StartError":
            return _report(
                f"image {cs.get('image')} cannot start weightlift's launcher (/bin/sh "
                f"{LAUNCHER}): {terminated.get('message') or 'no message'}",
                "NoShell",
            )
    return None
