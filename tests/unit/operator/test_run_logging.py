"""The operator's log keeps what it did and kopf's failures, not a line per handled watch event."""

from __future__ import annotations

import logging

from weightlift.operator.run import _drop_handler_successes


def _record(level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)


def test_kopf_handler_successes_are_dropped_and_everything_else_kept() -> None:
    assert not _drop_handler_successes(_record(logging.INFO, "Handler 'pod_changed' succeeded."))
    assert not _drop_handler_successes(_record(logging.INFO, "Daemon 'reconcile_loop' succeeded."))
    assert _drop_handler_successes(_record(logging.INFO, "created Source pod llama-abcdef-0"))
    failed = "Handler 'pod_changed' failed temporarily: boom"
    assert _drop_handler_successes(_record(logging.ERROR, failed))
    assert _drop_handler_successes(_record(logging.WARNING, "x succeeded."))
