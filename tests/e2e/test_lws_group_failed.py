"""A group that keeps failing turns Failed (issue 47): through the real LeaderWorkerSet controller
on the process node, a 1 x 2-pod replica whose rank 1 finds no weights (its presharded file is
gone: a load error, not permanent) is recreated by the operator, counted, and after
spec.parallelism.maxGroupRestarts recreations left Failed, naming the pod and why. Its pods then
restart in place (restartPolicy Always) and nobody recreates the group any more, until the spec
changes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.local.history import History, Version
from weightlift.local.lws import LwsController
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack, make_demo_model

JSON = dict[str, Any]
NAME = "grpfail"
TIMEOUT = 300.0

pytestmark = pytest.mark.timeout(600)


def _restarts(version: Version) -> int:
    statuses = version.status.get("containerStatuses") or []
    return sum(int(cs.get("restartCount") or 0) for cs in statuses)


def test_a_group_failing_again_and_again_turns_failed_and_is_not_recreated(
    stack: LocalStack,
    lws: LwsController,
    deployments: Callable[..., Observer],
    e2e_dir: Path,
) -> None:
    model_dir = e2e_dir / "tp2-no-rank1"
    probe = make_demo_model(model_dir, 1.0, tp=2, hook=True, seed=5)
    (model_dir / "rank-1-of-2.safetensors").unlink()
    parallelism = {"tensor": 2, "podsPerReplica": 2, "maxGroupRestarts": 1}
    with (
        History.deployment(stack.kubeconfig, stack.namespace, NAME) as md_history,
        History.pods(stack.kubeconfig, stack.namespace, NAME) as pod_history,
    ):
        deployments(
            NAME,
            model_dir,
            probe,
            replicas=1,
            parallelism=parallelism,
        )
        failed = md_history.wait(
            lambda v: v.status.get("phase") == "Failed",
            TIMEOUT,
            "the phase Failed",
            tick=stack.check_operator,
        )
        # The group (its LeaderWorkerSet, named as the replica) and its pods (LWS's names).
        group = f"{NAME}-{failed.status['modelIdentity'][:6]}-0"
        leader, worker = f"{group}-0", f"{group}-0-1"
        message = str(failed.status.get("message"))
        assert message.startswith(f"{group} failed 2 times in a row"), message
        assert "maxGroupRestarts 1" in message, message
        # The pod and the reason: rank 1's pod found no presharded file of its own.
        assert f"{worker}: " in message, message
        assert "no presharded files rank-1-of-2" in message, message
        assert failed.status.get("groupRestarts") == {group: 1}, failed.status

        # From Failed on, rank 1 (its report read, it lingers 30 s and exits 1) restarts in
        # place: the moment LWS's RecreateGroupOnPodRestart would have recreated the group, and
        # one the operator sees. No pod is made meanwhile: the pods' uids then are those of the
        # group recreated once (two leaders, two rank-1 pods), nothing more.
        current = [v for v in pod_history.versions() if v.name == worker][-1].uid
        at_failed = max(_restarts(v) for v in pod_history.versions() if v.uid == current)
        later = pod_history.wait(
            lambda v: v.uid == current and _restarts(v) > at_failed,
            TIMEOUT,
            "rank 1 restarting in place",
            tick=stack.check_operator,
        )
        versions = pod_history.upto(later)
        leaders = {v.uid for v in versions if v.name == leader}
        workers = {v.uid for v in versions if v.name == worker}
        assert len(leaders) == len(workers) == 2, (leaders, workers)
        # Every status written meanwhile still says Failed.
        after = [v for v in md_history.versions() if v.seen > failed.seen]
        statuses = {v.status.get("phase") for v in after}
        assert statuses <= {"Failed"}, [
            (v.status.get("phase"), v.status.get("message"), v.status.get("groupRestarts"))
            for v in after
        ]

        # A spec change starts over: the group is recreated (a new leader).
        stack.kube.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            stack.namespace,
            PLURAL,
            NAME,
            {"spec": {"parallelism": {"maxGroupRestarts": 2}}},
        )
        pod_history.wait(
            lambda v: v.type == "ADDED" and v.name == leader and v.uid not in leaders,
            TIMEOUT,
            "the group recreated after the spec changed",
            tick=stack.check_operator,
        )
