"""Ready means probed, all the way to the Service (issue 45), checked the same way on either
node: an EndpointSlice lists a worker pod as ready only once its inference probe passed.

The hold is the probe itself: the ModelDeployment's probe expects an output its model never
gives, so the replica loads, its container turns ready and the probe keeps failing for as long
as the test wants. The test then watches (never polls) the Service's EndpointSlices: the pod is
listed, not ready; the probe is fixed (a spec patch: the same pods, a new probe) and the
endpoint turns ready; broken again, it turns not ready again.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from weightlift.api.labels import INFERENCE_PROBE_GATE, SERVING_LABEL
from weightlift.local.kube import Kube, call
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
SLICE_SERVICE_LABEL = "kubernetes.io/service-name"  # set by the EndpointSlice controller


def endpoint_of(
    kube: Kube, namespace: str, service: str, pod: str, ready: bool, timeout: float
) -> JSON:
    """Watch the Service's EndpointSlices until one lists `pod` with conditions.ready == `ready`
    (the watch starts with the slices there are); return that endpoint."""
    discovery = client.DiscoveryV1Api(kube.api)
    deadline = time.monotonic() + timeout
    seen: JSON | None = None
    while (left := deadline - time.monotonic()) > 0:
        w = watch.Watch()
        for event in w.stream(
            discovery.list_namespaced_endpoint_slice,
            namespace,
            label_selector=f"{SLICE_SERVICE_LABEL}={service}",
            timeout_seconds=max(1, int(min(left, 30))),
        ):
            for endpoint in (event.get("raw_object") or {}).get("endpoints") or []:
                if (endpoint.get("targetRef") or {}).get("name") != pod:
                    continue
                seen = endpoint
                if bool((endpoint.get("conditions") or {}).get("ready")) is ready:
                    w.stop()
                    return dict(endpoint)
    raise AssertionError(f"no endpoint of {pod} with ready={ready} in {timeout:.0f}s; last {seen}")


def pod_ready(kube: Kube, namespace: str, pod: str, ready: bool, timeout: float) -> JSON:
    """Watch the pod until its Ready condition is `ready`; return the pod."""
    deadline = time.monotonic() + timeout
    shown: Any = None
    while (left := deadline - time.monotonic()) > 0:
        w = watch.Watch()
        for event in w.stream(
            kube.core.list_namespaced_pod,
            namespace,
            field_selector=f"metadata.name={pod}",
            timeout_seconds=max(1, int(min(left, 30))),
        ):
            body = event.get("raw_object") or {}
            found = {c["type"]: c["status"] for c in body["status"].get("conditions") or []}
            shown = found
            if (found.get("Ready") == "True") is ready:
                w.stop()
                return dict(body)
    raise AssertionError(f"{pod} not Ready={ready} in {timeout:.0f}s; conditions {shown}")


def conditions(stack: LocalStack, pod: str) -> dict[str, str]:
    body = call(stack.kube.core.read_namespaced_pod, pod, stack.namespace)
    return {c["type"]: c["status"] for c in body["status"].get("conditions") or []}


def probe_fields(probe: JSON) -> JSON:
    """What of a model's probe.json goes into spec.probe (as stack.model_deployment)."""
    keep = ("request", "expectedOutputs", "tolerance", "completion")
    return {k: v for k, v in probe.items() if k in keep}


def wrong(probe: JSON) -> JSON:
    """The same probe expecting other numbers (a completion probe: other text): the model
    answers, the probe fails."""
    bad = copy.deepcopy(probe_fields(probe))
    for output in bad.get("expectedOutputs") or []:
        output["data"] = [float(v) + 1000.0 for v in output["data"]]
    if "completion" in bad:  # greedy decoding gives one text: any other never matches
        bad["completion"]["expectedText"] = "not " + bad["completion"]["expectedText"]
    return bad


Deploy = Callable[..., Observer]  # deploy(name, model_dir, probe, **kw): applied, observed


def check_ready_only_after_probe(
    stack: LocalStack,
    deploy: Deploy,
    name: str,
    model_dir: Path,
    probe: JSON,
    timeout: float,
    slices: bool = True,
) -> str:
    """One replica through failing -> passing -> failing probes, its endpoint following; returns
    its pod's name. `slices` False: the pod's Ready instead of the EndpointSlice (the process
    node's pods have loopback IPs, which no EndpointSlice may hold)."""

    def follows(ready: bool) -> JSON | None:
        if slices:
            return endpoint_of(stack.kube, stack.namespace, name, pod, ready, timeout)
        pod_ready(stack.kube, stack.namespace, pod, ready, timeout)
        return None

    failing = {**wrong(probe), "failureThreshold": 1}
    obs = deploy(name, model_dir, failing, replicas=1)

    def probed_and_failing(o: Observer) -> bool:
        rows = o.replica_statuses()
        return bool(rows) and (rows[0].get("probe") or {}).get("passed") is False

    obs.wait(probed_and_failing, timeout, f"{name}'s replica loaded and failing its probe")
    (row,) = obs.replica_statuses()
    pod = row["name"]
    service = obs.status()["service"]
    assert service == {"name": name, "type": "ClusterIP", "ports": "http:80/TCP"}, service

    # Held: loaded, its container ready, the probe failing. Listed, but not ready.
    assert not row["ready"] and int(obs.status().get("readyReplicas", 0)) == 0, obs.status()
    listed = follows(False)
    shown = conditions(stack, pod)
    assert shown["ContainersReady"] == "True", shown  # without the gate it would be ready
    assert shown.get(INFERENCE_PROBE_GATE, "False") == "False" and shown["Ready"] == "False"
    assert listed is None or listed["addresses"] == [row["podIP"]]
    labels = call(stack.kube.core.read_namespaced_pod, pod, stack.namespace)["metadata"]["labels"]
    assert labels[SERVING_LABEL] == "true"

    # Released: the probe passes, the gate turns True, the endpoint turns ready.
    stack.patch_md(name, {"spec": {"probe": {**probe_fields(probe), "failureThreshold": 1}}})
    follows(True)
    obs.wait_ready(timeout)
    assert obs.replica_statuses()[0]["name"] == pod  # the same pod: a probe is no new revision
    assert conditions(stack, pod)[INFERENCE_PROBE_GATE] == "True"

    # Broken again: the gate turns False and the endpoint follows.
    stack.patch_md(name, {"spec": {"probe": failing}})
    follows(False)
    assert conditions(stack, pod)[INFERENCE_PROBE_GATE] == "False"
    svc = call(stack.kube.core.read_namespaced_service, name, stack.namespace)
    assert [o["kind"] for o in svc["metadata"]["ownerReferences"]] == ["ModelDeployment"]
    return str(pod)
