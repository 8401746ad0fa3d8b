"""Merge spec.template's pod-template parts (metadata, spec, rdmaResources) into a rendered
worker pod: a pure function, applied once at the end of pods.render_pod.

What the operator rendered wins: its labels and annotations over the user's, its volumes,
mounts, env, command, ports, probes and GPU count. Admission already refused a template that
names them (api/podspec.py); a clash left here (a mount path only known at render time: the
model's hostpath:// directory, the node cache) raises TemplateConflict naming the field.
"""

from __future__ import annotations

import copy
from typing import Any

from weightlift.api.kubeschema import quantities_as_strings
from weightlift.api.model import PodTemplate
from weightlift.api.podspec import WORKER_CONTAINER

# PodSpec fields copied as they are (the template's spec uses the PodSpec's names).
_COPIED = ("affinity", "priorityClassName", "schedulerName", "runtimeClassName")
_APPENDED = ("topologySpreadConstraints", "imagePullSecrets", "initContainers")


class TemplateConflict(ValueError):
    """The template and the operator's pod disagree on a field only the render can see."""


def merge_template(pod: dict[str, Any], template: PodTemplate) -> dict[str, Any]:
    """The worker pod with the template's metadata, PodSpec fields, sidecars and worker
    container overrides merged in; `pod` is left as it was."""
    out = copy.deepcopy(pod)
    spec = out["spec"]
    worker = next(c for c in spec["containers"] if c["name"] == WORKER_CONTAINER)
    _add_rdma(worker, template.rdma_resources)
    if template.metadata is not None:
        meta = out["metadata"]
        for kind in ("labels", "annotations"):
            theirs = getattr(template.metadata, kind)
            if theirs:
                meta[kind] = {**theirs, **(meta.get(kind) or {})}
    if template.spec is None:
        return out
    user = _string_quantities(template.spec.wire())
    for name in _COPIED:
        if name in user:
            spec[name] = user[name]
    for name in _APPENDED:
        if user.get(name):
            spec[name] = [*(spec.get(name) or []), *user[name]]
    if "securityContext" in user:
        # Admission let through only what tightens the operator's settings.
        spec["securityContext"] = {**user["securityContext"], **spec.get("securityContext", {})}
        spec["securityContext"].update(_tighter(user["securityContext"]))
    ours = {v["name"] for v in spec.get("volumes", [])}
    for volume in user.get("volumes", []):
        if volume["name"] in ours:
            raise TemplateConflict(
                f"spec.template.spec.volumes: {volume['name']!r} is a worker volume"
            )
    spec["volumes"] = [*spec.get("volumes", []), *user.get("volumes", [])]
    for container in user.get("containers", []):
        if container["name"] == WORKER_CONTAINER:
            _override_worker(worker, container)
        else:
            spec["containers"].append(container)
    return out


# The template's lists of core/v1 objects, by the type their items are.
_ITEM_KINDS = {"volumes": "Volume", "initContainers": "Container", "containers": "Container"}


def _string_quantities(user: dict[str, Any]) -> dict[str, Any]:
    """Quantities as strings (`cpu: 1` -> "1"): the API server stores what it was sent, but the
    kubernetes client's typed Pod model refuses a number there."""
    for name, kind in _ITEM_KINDS.items():
        if name in user:
            user[name] = [quantities_as_strings(item, kind) for item in user[name]]
    return user


def _tighter(user: dict[str, Any]) -> dict[str, Any]:
    """The user's securityContext values that replace the operator's: a user id or group of
    their own (admission refused root), and a Localhost seccomp or AppArmor profile."""
    keep = ("runAsUser", "runAsGroup", "fsGroup", "seLinuxOptions", "appArmorProfile")
    out = {k: user[k] for k in keep if k in user}
    if (user.get("seccompProfile") or {}).get("type") == "Localhost":
        out["seccompProfile"] = user["seccompProfile"]
    return out


def _add_rdma(worker: dict[str, Any], names: list[str]) -> None:
    if not names:
        return
    resources = worker["resources"]
    for name in names:
        resources["limits"][name] = resources["requests"][name] = "1"
    caps = worker["securityContext"]["capabilities"]
    caps["add"] = sorted({*caps.get("add", []), "IPC_LOCK"})  # RDMA registers (pins) memory


def _override_worker(worker: dict[str, Any], user: dict[str, Any]) -> None:
    """env and mounts appended after the operator's (its names and paths kept), envFrom set,
    resources merged under the operator's, securityContext tightened."""
    env_names = {e["name"] for e in worker.get("env", [])}
    for var in user.get("env", []):
        if var["name"] in env_names:
            raise TemplateConflict(
                f"spec.template.spec.containers[name=worker].env: {var['name']} is set by the "
                "operator"
            )
    worker["env"] = [*worker.get("env", []), *user.get("env", [])]
    if user.get("envFrom"):
        worker["envFrom"] = [*worker.get("envFrom", []), *user["envFrom"]]
    paths = {m["mountPath"] for m in worker.get("volumeMounts", [])}
    for mount in user.get("volumeMounts", []):
        if mount["mountPath"] in paths:
            raise TemplateConflict(
                "spec.template.spec.containers[name=worker].volumeMounts: "
                f"{mount['mountPath']} is the worker's own mount"
            )
    worker["volumeMounts"] = [*worker.get("volumeMounts", []), *user.get("volumeMounts", [])]
    for part in ("limits", "requests"):
        theirs = (user.get("resources") or {}).get(part)
        if theirs:
            worker["resources"][part] = {**theirs, **worker["resources"][part]}
    sc = user.get("securityContext")
    if sc:
        merged = {**sc, **worker["securityContext"]}
        for key in ("runAsUser", "runAsGroup", "seLinuxOptions", "appArmorProfile"):
            if key in sc:
                merged[key] = sc[key]
        if (sc.get("seccompProfile") or {}).get("type") == "Localhost":
            merged["seccompProfile"] = sc["seccompProfile"]
        worker["securityContext"] = merged
