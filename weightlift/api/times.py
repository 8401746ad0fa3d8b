"""RFC 3339 timestamps as Kubernetes writes them (seconds, UTC, trailing Z)."""

from __future__ import annotations

from datetime import UTC, datetime

_SECONDS = "%Y-%m-%dT%H:%M:%SZ"
_MICROS = "%Y-%m-%dT%H:%M:%S.%fZ"


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(_SECONDS)


def now_rfc3339() -> str:
    return rfc3339(datetime.now(UTC))


def now_micro() -> str:
    """MicroTime, as Leases and Events v1 want it."""
    return datetime.now(UTC).strftime(_MICROS)


def parse_rfc3339(text: str) -> datetime:
    return datetime.strptime(text, _SECONDS).replace(tzinfo=UTC)
