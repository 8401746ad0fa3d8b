"""Leader election's decisions (client-go's tryAcquireOrRenew) and the standby's liveness
endpoint; the loop itself runs against a real API server (tests/integration/test_leader_live.py)."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request

import pytest

from weightlift.operator.leader import Elector, Observation, next_spec
from weightlift.operator.lease_health import serve_standby_health
from weightlift.operator.settings import LeaderElection, default_identity

T0, T1 = "2026-01-01T00:00:00.000000Z", "2026-01-01T00:00:02.000000Z"


def test_first_record_starts_at_zero_transitions() -> None:
    assert next_spec(None, "a", 15.0, T0) == {
        "holderIdentity": "a",
        "leaseDurationSeconds": 15,
        "acquireTime": T0,
        "renewTime": T0,
        "leaseTransitions": 0,
    }


def test_renewal_keeps_acquire_time_and_transitions() -> None:
    held = next_spec(None, "a", 15.0, T0) | {"leaseTransitions": 4}
    renewed = next_spec(held, "a", 15.0, T1)
    assert renewed["acquireTime"] == T0 and renewed["renewTime"] == T1
    assert renewed["leaseTransitions"] == 4


@pytest.mark.parametrize("previous", ["a", ""])  # taken from a holder, or after a release
def test_taking_over_counts_a_transition(previous: str) -> None:
    held = next_spec(None, previous, 15.0, T0) | {"leaseTransitions": 2}
    taken = next_spec(held, "b", 2.5, T1)
    assert taken["holderIdentity"] == "b" and taken["acquireTime"] == T1
    assert taken["leaseTransitions"] == 3
    assert taken["leaseDurationSeconds"] == 3  # whole seconds, never shorter than asked


def test_expiry_is_judged_from_when_the_record_last_changed() -> None:
    seen = Observation()
    spec = next_spec(None, "a", 15.0, T0)
    seen.see(spec, now=100.0)
    assert seen.valid_for_other(spec, "b", now=114.9)
    seen.see(dict(spec), now=110.0)  # the same record again: the clock does not restart
    assert not seen.valid_for_other(spec, "b", now=115.0)
    renewed = next_spec(spec, "a", 15.0, T1)
    seen.see(renewed, now=112.0)  # renewed: valid for another lease duration from now
    assert seen.valid_for_other(renewed, "b", now=126.9)
    assert not seen.valid_for_other(renewed, "a", now=113.0)  # never "taken" from its holder
    assert not seen.valid_for_other(renewed | {"holderIdentity": ""}, "b", now=113.0)


def test_settings_refuse_a_deadline_that_outlives_the_lease() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeaderElection(lease_duration=10, renew_deadline=10)
    with pytest.raises(ValueError, match="retry period"):
        LeaderElection(renew_deadline=2, retry_period=2)
    assert LeaderElection(identity="x").identity == "x"
    assert default_identity({"POD_NAME": "op-1"}) == "op-1"
    assert default_identity({}).endswith(f"_{os.getpid()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_standby_answers_liveness_while_it_tries_and_frees_the_port() -> None:
    port = _free_port()
    alive = [True]
    url = f"http://127.0.0.1:{port}/healthz"
    with serve_standby_health("127.0.0.1", port, lambda: alive[0]):
        with urllib.request.urlopen(url, timeout=5) as r:
            assert r.status == 200 and b"standby" in r.read()
        alive[0] = False
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 503
    with socket.socket() as s:  # kopf's own endpoint binds it next
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_leader_past_its_renew_deadline_gives_up_before_a_pass() -> None:
    """A process stalled past its deadline (stopped, starved) must not run one more pass: the
    check before each pass gives up the same way the renew thread would."""
    lost: list[str] = []
    settings = LeaderElection(identity="a", lease_duration=4, renew_deadline=3, retry_period=1)
    elector = Elector(settings, api=None, on_lost=lost.append)  # type: ignore[arg-type]
    elector.acquired_at = time.monotonic()
    elector.renewed_at = elector.acquired_at
    elector.check()
    assert lost == []
    elector.renewed_at -= 3.5  # the last good renewal began 3.5 s ago
    elector.check()
    assert lost and "not renewed within 3s" in lost[0]
