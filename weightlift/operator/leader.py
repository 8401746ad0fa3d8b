"""Leader election on a coordination.k8s.io Lease: one operator replica reconciles, the others
wait in standby without starting kopf (no watches, no handlers, no writes).

It follows client-go's leaderelection (tryAcquireOrRenew, the renew loop, ReleaseOnCancel), and
controller-runtime's answer to a lost Lease: the process exits at once (its pod restarts and
becomes a standby). Not the official client's `kubernetes.leaderelection`: its requests have no
timeout (a hung renew keeps a holder acting past its deadline), it never counts
leaseTransitions and never releases the Lease on shutdown. kopf's peering is no answer either:
operators of equal priority all pause.

Safety rests on two clocks that never meet: a standby takes the Lease only after it has seen
the record unchanged for leaseDurationSeconds (its own monotonic clock), and the holder exits
once renew_deadline (< lease_duration) has passed since the start of its last good renewal (its
own monotonic clock). Each request's timeout is what is left of that deadline.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightlift.api.labels import FIRST_RECONCILE_ANNOTATION
from weightlift.api.times import now_micro
from weightlift.operator.kube import api_error
from weightlift.operator.settings import LeaderElection

log = logging.getLogger("weightlift.operator.leader")
Obj = dict[str, Any]
# The exit status of a holder that lost its Lease (controller-runtime: "leader election lost").
LEASE_LOST_EXIT = 3
# client-go waits RetryPeriod x [1, 2.2) between tries to take the Lease; with two replicas
# there is little to spread out, and every second of jitter is a second more of takeover.
ACQUIRE_JITTER = 0.2


class Outcome(Enum):
    HELD = "held"  # we hold the Lease (acquired or renewed)
    TAKEN = "taken"  # another candidate holds it and it has not expired
    FAILED = "failed"  # no answer, or a conflicting write: try again


def lease_duration_seconds(spec: Obj) -> int:
    return int(spec.get("leaseDurationSeconds") or 0)


def next_spec(current: Obj | None, identity: str, duration: float, stamp: str) -> Obj:
    """The record a candidate writes to hold the Lease (client-go's tryAcquireOrRenew): a
    renewal keeps acquireTime and leaseTransitions, a change of holder counts one more."""
    current = current or {}
    spec: Obj = {
        "holderIdentity": identity,
        "leaseDurationSeconds": math.ceil(duration),
        "renewTime": stamp,
    }
    if current.get("holderIdentity") == identity:
        spec["acquireTime"] = current.get("acquireTime") or stamp
        spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0)
    else:
        spec["acquireTime"] = stamp
        # A first record starts at 0; taking over from someone (or from a release) adds one.
        had_holder = "holderIdentity" in current
        spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + int(had_holder)
    return spec


@dataclass
class Observation:
    """The record last seen and when (monotonic): expiry is judged by our clock, not by the
    renewTime another machine wrote."""

    raw: str = ""
    at: float = 0.0

    def see(self, spec: Obj, now: float) -> None:
        raw = json.dumps(spec, sort_keys=True)
        if raw != self.raw:
            self.raw, self.at = raw, now

    def valid_for_other(self, spec: Obj, identity: str, now: float) -> bool:
        """Someone else holds the Lease and it has not run out since we saw it change."""
        holder = spec.get("holderIdentity") or ""
        return bool(holder) and holder != identity and now < self.at + lease_duration_seconds(spec)


class Elector:
    """One candidate. `acquire` blocks until it holds the Lease; `start_renewing` keeps it (or
    ends the process); `release` hands it on at a graceful shutdown."""

    def __init__(
        self,
        settings: LeaderElection,
        api: client.CoordinationV1Api,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        # Called with plain dicts and raw answers (_preload_content=False), which the client's
        # stubs do not describe.
        self.api: Any = api
        self.on_lost = on_lost or _exit_lost
        self.observed = Observation()
        self.holder = ""  # the holder named by the last record read
        self.last_try = time.monotonic()  # the standby's liveness
        self.acquired_at: float | None = None  # monotonic start of the acquiring try
        self.renewed_at = 0.0  # monotonic start of the last good renewal
        self._lease: Obj | None = None  # the last Lease read or written (its resourceVersion)
        self._first_reconcile: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = False

    # -- one try
    def try_acquire_or_renew(self, timeout: float) -> Outcome:
        s = self.settings
        now, stamp = time.monotonic(), now_micro()
        try:
            lease = self._read(timeout)
            if lease is None:
                return self._create(next_spec(None, s.identity, s.lease_duration, stamp), timeout)
            spec = lease.get("spec") or {}
            self.holder = spec.get("holderIdentity") or ""
            self.observed.see(spec, now)
            if self.observed.valid_for_other(spec, s.identity, now):
                return Outcome.TAKEN
            new = next_spec(spec, s.identity, s.lease_duration, stamp)
            return self._replace(lease, new, now, timeout)
        except ApiException as exc:
            log.warning("Lease %s/%s: %s", s.namespace, s.lease_name, api_error(exc))
        except Exception as exc:  # urllib3: no answer within the timeout, refused, reset
            log.warning("Lease %s/%s: %s", s.namespace, s.lease_name, exc)
        return Outcome.FAILED

    def _read(self, timeout: float) -> Obj | None:
        s = self.settings
        try:
            response = self.api.read_namespaced_lease(
                s.lease_name, s.namespace, _preload_content=False, _request_timeout=timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        lease: Obj = json.loads(response.data)
        return lease

    def _create(self, spec: Obj, timeout: float) -> Outcome:
        s = self.settings
        body = {"metadata": {"name": s.lease_name, "namespace": s.namespace}, "spec": spec}
        try:
            response = self.api.create_namespaced_lease(
                s.namespace, body, _preload_content=False, _request_timeout=timeout
            )
        except ApiException as exc:
            if exc.status == 409:  # another candidate created it first
                return Outcome.FAILED
            raise
        self._held(json.loads(response.data))
        return Outcome.HELD

    def _replace(self, lease: Obj, spec: Obj, now: float, timeout: float) -> Outcome:
        s = self.settings
        meta = lease["metadata"]
        annotations = dict(meta.get("annotations") or {})
        if spec["holderIdentity"] != (lease.get("spec") or {}).get("holderIdentity"):
            annotations.pop(FIRST_RECONCILE_ANNOTATION, None)  # the last holder's
        elif self._first_reconcile is not None:
            annotations[FIRST_RECONCILE_ANNOTATION] = self._first_reconcile
        body = {
            "metadata": {
                "name": s.lease_name,
                "namespace": s.namespace,
                # Optimistic concurrency: of two candidates writing the same record, one wins.
                "resourceVersion": meta["resourceVersion"],
                "annotations": annotations,
                "labels": meta.get("labels") or {},
            },
            "spec": spec,
        }
        try:
            response = self.api.replace_namespaced_lease(
                s.lease_name, s.namespace, body, _preload_content=False, _request_timeout=timeout
            )
        except ApiException as exc:
            if exc.status == 409:
                return Outcome.FAILED
            raise
        self._held(json.loads(response.data))
        self.observed.see(spec, now)
        return Outcome.HELD

    def _held(self, lease: Obj) -> None:
        self._lease = lease
        self.holder = self.settings.identity
        self.observed.see(lease.get("spec") or {}, time.monotonic())

    # -- standby
    def acquire(self) -> None:
        """Block until this candidate holds the Lease (standby until then)."""
        s = self.settings
        log.info("standby: %s waits for Lease %s/%s", s.identity, s.namespace, s.lease_name)
        last_holder = None
        while True:
            started = time.monotonic()
            outcome = self.try_acquire_or_renew(timeout=s.renew_deadline)
            self.last_try = time.monotonic()
            if outcome is Outcome.HELD:
                self.acquired_at = started
                spec = (self._lease or {}).get("spec") or {}
                log.info(
                    "leader: %s holds Lease %s/%s (transitions %s)",
                    s.identity,
                    s.namespace,
                    s.lease_name,
                    spec.get("leaseTransitions"),
                )
                return
            if outcome is Outcome.TAKEN and self.holder != last_holder:
                log.info("standby: Lease held by %s", self.holder)
                last_holder = self.holder
            time.sleep(s.retry_period * (1 + random.random() * ACQUIRE_JITTER))

    def alive(self) -> bool:
        """The standby's liveness: it tried to take the Lease lately."""
        s = self.settings
        return time.monotonic() - self.last_try < 3 * s.retry_period + s.renew_deadline

    # -- leader
    def start_renewing(self) -> None:
        assert self.acquired_at is not None, "acquire first"
        self.renewed_at = self.acquired_at
        global _ACTIVE
        _ACTIVE = self
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        s = self.settings
        while not self._stop.wait(s.retry_period):
            deadline = self.renewed_at + s.renew_deadline
            while True:
                started = time.monotonic()
                if started >= deadline:
                    self._give_up(f"not renewed within {s.renew_deadline:g}s")
                    return
                outcome = self.try_acquire_or_renew(timeout=deadline - started)
                if self._stop.is_set():
                    return
                if outcome is Outcome.HELD:
                    self.renewed_at = started
                    break
                if outcome is Outcome.TAKEN or self.holder not in ("", s.identity):
                    self._give_up(f"now held by {self.holder}")
                    return
                self._stop.wait(min(s.retry_period, max(0.0, deadline - time.monotonic())))

    def check(self) -> None:
        """Give up now if the renew deadline has passed: a process that was stalled (stopped,
        starved) past it may run a pass before its renew thread wakes to notice."""
        s = self.settings
        if not self._stop.is_set() and time.monotonic() > self.renewed_at + s.renew_deadline:
            self._give_up(f"not renewed within {s.renew_deadline:g}s")

    def _give_up(self, why: str) -> None:
        self._lost = True
        s = self.settings
        self.on_lost(f"lost Lease {s.namespace}/{s.lease_name}: {why}")

    def reconciled(self) -> None:
        """The first reconcile pass since taking the Lease: stamped on the Lease by the next
        renewal (no write of its own), and logged."""
        if self._first_reconcile is None:
            self._first_reconcile = now_micro()
            since = time.monotonic() - (self.acquired_at or time.monotonic())
            log.info("leader: first reconcile pass %.2fs after taking the Lease", since)

    def release(self) -> None:
        """After kopf has stopped (no handler, no API call in flight): stop renewing and hand
        the Lease on at once (client-go's ReleaseOnCancel), so a standby need not wait for it
        to run out. Best effort: an unreleased Lease runs out by itself."""
        global _ACTIVE
        _ACTIVE = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.renew_deadline)
        if self._lost or self._lease is None:
            return
        s = self.settings
        try:
            lease = self._read(s.renew_deadline)
            spec = (lease or {}).get("spec") or {}
            if lease is None or spec.get("holderIdentity") != s.identity:
                return
            stamp = now_micro()
            released = {
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
                "acquireTime": stamp,
                "renewTime": stamp,
                "leaseTransitions": int(spec.get("leaseTransitions") or 0),
            }
            body = {**lease, "spec": released}
            self.api.replace_namespaced_lease(
                s.lease_name, s.namespace, body, _request_timeout=s.renew_deadline
            )
            log.info("leader: released Lease %s/%s", s.namespace, s.lease_name)
        except Exception as exc:
            log.warning("could not release Lease %s/%s: %s", s.namespace, s.lease_name, exc)


def _exit_lost(why: str) -> None:
    """controller-runtime's answer: stop everything now. kopf's tasks and API threads die with
    the process, so nothing acts on a Lease someone else may take in a moment."""
    log.critical("leader: %s; exiting", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(LEASE_LOST_EXIT)


# The elector of this process while it leads: handlers tell it of their first pass.
_ACTIVE: Elector | None = None


def check_leading() -> None:
    """Called before each reconcile pass: exits a leader past its renew deadline."""
    if _ACTIVE is not None:
        _ACTIVE.check()


def reconciled() -> None:
    """Called after each reconcile pass; a no-op without leader election."""
    if _ACTIVE is not None:
        _ACTIVE.reconciled()
