"""Ready means probed, all the way to the Service (issue 45), on the real node: the pinned
kubelet computes the worker pod's Ready from its containers and the operator's inference-probe
readiness gate (KEP-580), and the real EndpointSlice controller lists the replica as ready only
while its probe passes (tests/support/endpoints.py holds the moment with a probe that cannot
pass). The operator runs as a local process of this checkout; one replica of the worker image.
On the same node, the one real-node fault of `bench chaos --node kubelet` that `make test` runs
(bench/chaos_node.py): the kubelet restarted while a Target's pull is held open mid-transfer.
Needs root, `make node` and `make images`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_kubelet_lifecycle import _require_images
from tests.e2e.test_kubelet_node import _require_node
from tests.support.e2e import READY_TIMEOUT
from tests.support.endpoints import check_ready_only_after_probe
from weightlift.bench import chaos_node
from weightlift.bench.chaos import run_scenario, scenario
from weightlift.bench.chaos_models import Models
from weightlift.local.kubeletnode import KubeletNode
from weightlift.local.kubeletnode.network import POD_BASE
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack, make_demo_model, model_deployment
from weightlift.operator.settings import PROBE_NETWORKS_ENV

JSON = dict[str, Any]
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
