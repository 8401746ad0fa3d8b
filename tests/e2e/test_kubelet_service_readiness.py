"""The pod is the user's and Ready means probed, all the way to the Service (issue 45), on the
real node: the pinned kubelet computes the worker pod's Ready from its containers and the
operator's inference-probe readiness gate (KEP-580), and the real EndpointSlice controller lists
the replica as ready only while its probe passes (tests/support/endpoints.py holds the moment
with a probe that cannot pass). Then a worker pod given what a platform team gives one (node
affinity, a priority class, a pull secret for a registry that requires it, a ConfigMap volume, a
Multus annotation, a MIG slice our device plugin advertises) is pulled, run and probed by the
kubelet and containerd. On the same node, the one real-node fault of `bench chaos --node kubelet`
that `make test` runs (bench/chaos_node.py): the kubelet restarted while a Target's pull is held
open mid-transfer. The operator runs as a local process of this checkout. Needs root, `make
node` and `make images`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from tests.e2e.test_kubelet_lifecycle import _require_images
from tests.e2e.test_kubelet_node import _require_node
from tests.support.e2e import READY_TIMEOUT
from tests.support.endpoints import check_ready_only_after_probe, endpoint_of, pod_ready
from weightlift.api.labels import INFERENCE_PROBE_GATE
from weightlift.bench import chaos_node
from weightlift.bench.chaos import run_scenario, scenario
from weightlift.bench.chaos_models import Models
from weightlift.local.kube import call
from weightlift.local.kubeletnode import KubeletNode, NodeError
from weightlift.local.kubeletnode.network import POD_BASE
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack, make_demo_model, model_deployment
from weightlift.operator.settings import PROBE_NETWORKS_ENV

JSON = dict[str, Any]
MIG = "nvidia.com/mig-1g.10gb"
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def kstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    _require_node()
    models = tmp_path_factory.mktemp("kready-models")
    stack = LocalStack(
        tmp_path_factory.mktemp("kready") / "stack",
        node_kind="kubelet",
        node_name="kubelet-ready",
        gpus=2,  # the chaos scenario's source and target
        extra_resources={MIG: 1},  # the device plugin's MIG slice, beside the whole GPUs
        model_path_prefixes=(str(models),),
        # The tests' safety belt (tests/conftest.py) lets the operator contact loopback only;
        # this node's pods live on its bridge, on this machine too.
        operator_env={PROBE_NETWORKS_ENV: f"127.0.0.0/8,{POD_BASE}"},
    )
    _require_images(stack.node_images())
    with stack:
        yield stack, models
    node = stack.node
    assert isinstance(node, KubeletNode)
    assert not node.leftovers()


def test_the_endpoint_is_ready_only_while_the_probe_passes(
    kstack: tuple[LocalStack, Path],
) -> None:
    stack, models = kstack
    model_dir = models / "model"
    probe = make_demo_model(model_dir, 8.0)

    def deploy(name: str, model_dir: Path, probe: JSON, **kw: Any) -> Observer:
        stack.apply(model_deployment(name, model_dir, probe=probe, **kw))
        return Observer(stack, name)

    # containerd pulls and unpacks the worker image (6.3 GB) first: minutes on a fresh node.
    check_ready_only_after_probe(stack, deploy, "kgated", model_dir, probe, 2 * READY_TIMEOUT)
    stack.delete_md("kgated")


def _template(stack: LocalStack, node: KubeletNode) -> JSON:
    """What a platform team's pod needs, each piece something the node really acts on."""
    extra = {"name": "extra", "mountPath": "/etc/weightlift-extra", "readOnly": True}
    return {
        "image": node.private_registry.ref(stack.node_images()[0]),
        "imagePullPolicy": "Always",  # the kubelet asks the registry, with the secret, each time
        "gpuResource": MIG,
        "metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "sriov-rail0"}},
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "kubernetes.io/hostname",
                                        "operator": "In",
                                        "values": [node.name],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "priorityClassName": "inference-high",
            "imagePullSecrets": [{"name": "private-registry"}],
            "volumes": [{"name": "extra", "configMap": {"name": "extra"}}],
            "containers": [{"name": "worker", "volumeMounts": [extra]}],
        },
    }


def test_a_worker_pod_with_the_teams_template_is_pulled_run_and_probed(
    kstack: tuple[LocalStack, Path],
) -> None:
    stack, models = kstack
    node = stack.node
    assert isinstance(node, KubeletNode)
    private = node.private_registry
    ref = private.ref(stack.node_images()[0])
    # The registry requires auth: anonymous, the API and containerd itself are refused.
    repository, _, tag = ref.removeprefix(private.address + "/").rpartition(":")
    refused = httpx.get(f"http://{private.address}/v2/{repository}/manifests/{tag}", timeout=10)
    assert refused.status_code == 401, refused.text
    assert refused.headers["www-authenticate"].startswith("Basic"), refused.headers
    with pytest.raises(NodeError, match="401 Unauthorized"):
        node.crictl("pull", ref)

    ns = stack.namespace
    call(
        client.SchedulingV1Api(stack.kube.api).create_priority_class,
        {"metadata": {"name": "inference-high"}, "value": 1000},
    )
    call(stack.kube.core.create_namespaced_secret, ns, private.pull_secret("private-registry", ns))
    call(
        stack.kube.core.create_namespaced_config_map,
        ns,
        {"metadata": {"name": "extra"}, "data": {"greeting": "from the team's ConfigMap"}},
    )
    model_dir = models / "templated"
    probe = make_demo_model(model_dir, 8.0)
    manifest = model_deployment("kteam", model_dir, replicas=1, probe=probe)
    manifest["spec"]["template"] = {**manifest["spec"]["template"], **_template(stack, node)}
    stack.apply(manifest)
    obs = Observer(stack, "kteam")
    obs.wait_ready(2 * READY_TIMEOUT)

    [pod] = stack.pods("kteam")
    name, meta, spec = pod["metadata"]["name"], pod["metadata"], pod["spec"]
    assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "sriov-rail0"
    assert spec["affinity"] == manifest["spec"]["template"]["spec"]["affinity"]
    assert spec["nodeName"] == node.name
    assert (spec["priorityClassName"], spec["priority"]) == ("inference-high", 1000)
    assert spec["imagePullSecrets"] == [{"name": "private-registry"}]
    assert {"name": "extra", "configMap": {"name": "extra", "defaultMode": 420}} in spec["volumes"]
    worker = next(c for c in spec["containers"] if c["name"] == "worker")
    assert worker["image"] == ref
    assert {"name": "extra", "mountPath": "/etc/weightlift-extra", "readOnly": True} in (
        worker["volumeMounts"]
    )
    limits = worker["resources"]["limits"]
    assert limits[MIG] == "1" and "nvidia.com/gpu" not in limits, limits
    # The kubelet turns the pod Ready after it sees the gate True (a moment after the status
    # says Ready): watched, not read at once.
    ready = pod_ready(stack.kube, ns, name, True, READY_TIMEOUT)
    conds = {c["type"]: c["status"] for c in ready["status"]["conditions"]}
    assert conds[INFERENCE_PROBE_GATE] == "True", conds
    endpoint_of(stack.kube, ns, "kteam", name, True, READY_TIMEOUT)

    # The kubelet pulled the image from the private registry, with the pod's secret.
    pulled = [e["message"] for e in stack.events(name) if e["reason"] == "Pulled"]
    assert any(f'Successfully pulled image "{ref}"' in m for m in pulled), pulled
    # Inside the container: the ConfigMap mounted, and a MIG slice the device plugin allocated.
    [container] = [
        c
        for c in node.containers()
        if (c.get("labels") or {}).get("io.kubernetes.pod.name") == name
        and c["metadata"]["name"] == "worker"
    ]
    # Its processes as the host sees them (the runtime's exec stream listens inside the node's
    # namespace): their env and their mount namespace's root.
    pid = node.container_pids(container["id"])[0]
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        if "=" in item
    )
    assert environ["WEIGHTLIFT_FAKE_GPUS"] == "fake-mig-1g-10gb-0", environ
    greeting = Path(f"/proc/{pid}/root/etc/weightlift-extra/greeting").read_text()
    assert greeting == "from the team's ConfigMap"
    stack.delete_md("kteam")


def test_the_kubelet_restarted_mid_pull_keeps_the_containers_and_the_pull(
    kstack: tuple[LocalStack, Path],
) -> None:
    """bench chaos' kubelet-restart-mid-pull: the Target holds its pull from the Source at the
    fault gate, the kubelet stops and starts again; the containers run on, the pull finishes
    from the same peer, two replicas Ready, no orphan, no wrong weights (its verify checks it)."""
    stack, models = kstack
    chaos_node.prepare(stack)  # the worker image, if this test runs alone: minutes, else seconds
    index, sc = scenario("kubelet-restart-mid-pull")
    result = run_scenario(stack, Models(models / "chaos"), sc, index)
    print(result)
    assert result.converged and not result.skipped, result
    assert result.orphans == 0 and result.wrong_weights == 0, result
    assert "kubelet" in result.detail and "READ" in result.detail, result
