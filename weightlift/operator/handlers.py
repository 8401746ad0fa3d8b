"""kopf handlers: thin wiring around observe -> plan -> apply.

One daemon per ModelDeployment runs the reconcile loop; pod events and spec changes wake it
early, a timer (the plan's requeue_after) wakes it otherwise. All decisions live in planning.py.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from weightlift.api.labels import DEPLOYMENT_LABEL, DEPLOYMENT_UID_LABEL, MANAGED_BY
from weightlift.api.model import GROUP, KIND, PLURAL, VERSION
from weightlift.operator import apicalls, kube, leader, metrics, watchtrim
from weightlift.operator.diffbase import NoDiffBaseStorage
from weightlift.operator.reconcile import pod_essentials, published_by, reconcile
from weightlift.operator.state import OperatorState

log = logging.getLogger("weightlift.operator")
watchtrim.install()  # before kopf starts its watches: see watchtrim.py
apicalls.install_kopf()  # before kopf makes its session: its requests are counted
# kopf runs one worker per object with events, which holds the object's last whole body (a Pod,
# its managedFields dropped: ~28 KB of Python objects) until it has been idle this long. kopf's
# 5 s kept the bodies of every pod of a rollout alive at once: 489 workers at 200 x 4 in
# `bench operator`, 111 with 0.5 s, and 20-30 MB less peak RSS. A worker that exits is made
# again by the object's next event (a task, microseconds).
IDLE_WORKER_SECONDS = 0.5
# Young objects before a collection (Python's default: 700). Each event and request allocates
# hundreds; at 700 the collector ran ~16 times a second and a full collection every ~10 s, a
# third of the operator's CPU in `bench operator -n 200` (gc callbacks' timings).
GC_YOUNG_OBJECTS = 10_000


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Keep kopf's bookkeeping in annotations: status belongs to the ModelDeployment's users.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    # No change handler needs a diff base: kopf writes none (diffbase.py).
    settings.persistence.diffbase_storage = NoDiffBaseStorage()
    # One event path: reconcile posts each transition's Event itself (kube.post_event). kopf's
    # own posting would add its handler chatter, and with posting.loggers on (the default of
    # older kopf) every log line of a handler as a second Event.
    settings.posting.enabled = False
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.queueing.idle_timeout = IDLE_WORKER_SECONDS
    settings.networking.request_timeout = 30
    # The threads our blocking API calls (asyncio.to_thread) run in: see kube.API_THREADS.
    executor = ThreadPoolExecutor(max_workers=kube.API_THREADS, thread_name_prefix="kube-api")
    asyncio.get_running_loop().set_default_executor(executor)
    state = memo["state"] = OperatorState.from_environment()
    if state.settings.metrics_port is not None:
        host, port = state.settings.metrics_host, state.settings.metrics_port
        memo["metrics_server"] = metrics.serve(host, port, state.metrics)
        log.info("serving metrics on %s:%d/metrics", host, port)
    # What exists now (modules, pydantic's and the kubernetes client's classes: ~70k objects)
    # lives as long as the process. Frozen, the cyclic collector stops walking it on every
    # full collection, which the operator's churn of events and requests triggers often.
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS)


@kopf.on.cleanup()
async def stop_metrics(memo: kopf.Memo, **_: Any) -> None:
    server = memo.get("metrics_server")
    if server is not None:  # its port is free again for an operator started in this process
        await asyncio.to_thread(server.shutdown)
        server.server_close()


def _state(memo: Any) -> OperatorState:
    state: OperatorState = memo["state"]
    return state


# The indexers are coroutines: kopf runs a plain function in a thread, one hop per watch event.
@kopf.index(GROUP, VERSION, PLURAL)
async def published_sources(
    namespace: str | None, body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], list[Any]]:
    """Every ModelDeployment's status.sources by namespace and model identity, kept current by
    kopf's watch: a reconcile finds the sibling sources of its own identity without listing
    ModelDeployments, and reads none of the others (at 1000 deployments a pass that looked at
    every source of the namespace spent most of the operator's CPU). Deployments publishing
    nothing (or being deleted) are not in it."""
    by_identity: dict[tuple[str | None, str], list[Any]] = {}
    for raw in published_by(body):
        identity = raw.get("modelIdentity") if isinstance(raw, dict) else None
        if isinstance(identity, str):
            by_identity.setdefault((namespace, identity), []).append(raw)
    return by_identity


@kopf.index("", "v1", "pods", labels=MANAGED_BY)
async def pods_by_owner(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    """Worker pods by their ModelDeployment's uid, kept current by kopf's pod watch: a reconcile
    pass reads its pods from memory instead of listing them."""
    owners = body.metadata.get("ownerReferences", [])
    uids = [o["uid"] for o in owners if o.get("kind") == KIND and o.get("uid")]
    # A multi-pod replica's pods are owned by LWS's StatefulSets; they carry the uid instead.
    by_label = (body.metadata.get("labels") or {}).get(DEPLOYMENT_UID_LABEL)
    uids = uids or ([by_label] if by_label else [])
    if not uids:
        return {}
    essentials = pod_essentials(body)
    return {owner: essentials for owner in uids}


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def reconcile_loop(
    body: kopf.Body,
    namespace: str | None,
    uid: str,
    stopped: kopf.DaemonStopped,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **kwargs: Any,
) -> None:
    """The reconcile loop of one ModelDeployment. `body` is kopf's live view, refreshed by the
    watch; pods and sibling sources come from kopf's indexes: a pass reads nothing from the API
    server, and the kubernetes client only writes."""
    assert namespace is not None  # ModelDeployments are namespaced
    # kopf injects each index by its indexer's name (not part of its DaemonFn protocol).
    published_sources: kopf.Index[tuple[str | None, str], list[Any]] = kwargs["published_sources"]
    pods_index: kopf.Index[str, dict[str, Any]] = kwargs["pods_by_owner"]
    state = _state(memo)
    wake = state.wake_event(uid)

    def sources_of(identity: str) -> list[Any]:
        # The indexes are live: every pass reads them afresh.
        key = (namespace, identity)
        return [raw for batch in published_sources.get(key, []) for raw in batch]

    # kopf cancels a loop that has not returned `cancellation_timeout` after the deployment was
    # deleted (a pass waiting for its turn or on a slow probe): it must leave the gauges anyway.
    try:
        while not stopped:
            started: float | None = None
            try:
                async with state.passes:  # a turn first: what the pass reads is read in its turn
                    started = time.perf_counter()
                    wake.clear()
                    pods = list(pods_index.get(uid, []))
                    leader.check_leading()  # a leader stalled past its deadline acts no more
                    delay = await reconcile(state, body, pods, sources_of, logger)
                state.metrics.reconciled(time.perf_counter() - started, ok=True)
                state.deployment(uid).error = None
                leader.reconciled()  # the Lease records a new leader's first pass
            except Exception as exc:  # never let one object take the operator down
                if started is not None:
                    state.metrics.reconciled(time.perf_counter() - started, ok=False)
                logger.exception("reconcile of %s/%s failed", namespace, body.metadata.name)
                record = state.deployment(uid)
                if record.error != str(exc):  # one Event per new error, not per retry
                    record.error = str(exc)
                    await state.post_event(dict(body), "Warning", "ReconcileError", str(exc))
                delay = 5.0
            await _sleep(wake, stopped, delay)
    finally:
        state.forget(uid)


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, delay: float) -> None:
    """Until the next pass is due, a pod/spec change wakes us, or kopf stops the daemon.

    Waking on `stopped` lets an idle loop end by returning, so kopf sees a graceful exit
    instead of having to cancel the task.
    """
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def generation_changed(
    body: kopf.Body, event: kopf.RawEvent, uid: str, memo: kopf.Memo, **_: Any
) -> None:
    """A spec change moves metadata.generation (status and label writes do not): it wakes the
    loop early. A watching handler, not on.update: kopf keeps no diff base for it."""
    if event.get("type") != "DELETED":
        _state(memo).wake_on_generation(uid, body.metadata.get("generation"))


@kopf.on.event("", "v1", "pods", labels=MANAGED_BY)
async def pod_changed(body: kopf.Body, event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    state = _state(memo)
    if event.get("type") == "DELETED":
        state.forget_pod(body.metadata.uid or "")
    for owner in body.metadata.get("ownerReferences", []):
        if owner.get("kind") == "ModelDeployment":
            state.wake(owner["uid"])
    if group_owner := (body.metadata.get("labels") or {}).get(DEPLOYMENT_UID_LABEL):
        state.wake(group_owner)  # a LeaderWorkerSet's pod (owned by its StatefulSet)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def delete_pods(
    name: str, namespace: str | None, uid: str, spec: kopf.Spec, memo: Any, **_: Any
) -> None:
    """Finalizer: the ModelDeployment goes away only once none of its pods is left. Its
    LeaderWorkerSets go first: they would recreate the pods of their groups."""
    assert namespace is not None
    state = _state(memo)
    selector = f"{DEPLOYMENT_LABEL}={name}"
    pods_per_replica = (spec.get("parallelism") or {}).get("podsPerReplica")
    multi_pod = isinstance(pods_per_replica, int) and pods_per_replica > 1
    if multi_pod or state.deployment(uid).lws:
        await asyncio.to_thread(kube.delete_lws_sets, state.custom, namespace, selector)
    pods = await asyncio.to_thread(kube.list_pods, state.core, namespace, selector)
    for pod in pods:
        if not pod["metadata"].get("deletionTimestamp"):
            await asyncio.to_thread(kube.delete_pod, state.core, namespace, pod["metadata"]["name"])
    if pods:
        raise kopf.TemporaryError(f"waiting for {len(pods)} worker pod(s) to terminate", delay=2)
