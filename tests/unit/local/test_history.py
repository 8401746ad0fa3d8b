"""local/history.py's watch loop on canned API answers: a watch that ends resumes from the last
resourceVersion it delivered (bookmarks included), and one the API server refuses to resume
(410 Gone, the version compacted away) is a gap every wait reports, never a silent re-list."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from weightlift.local import history as history_module
from weightlift.local.history import History, HistoryGap

JSON = dict[str, Any]


class _Response:
    def __init__(self, body: bytes, status: int = 200) -> None:
        self.data, self.status = body, status

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        yield self.data

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def _cm(rv: int, n: int) -> JSON:
    return {"metadata": {"name": "cm", "uid": "u1", "resourceVersion": str(rv)}, "data": {"n": n}}


class _FakeKube:
    def __init__(self, kubeconfig: Path, agent: str) -> None:
        pass

    def close(self) -> None:
        pass


class _Server:
    """A LIST at resourceVersion 10, then one canned answer per watch request; records the
    resourceVersion each watch asked for."""

    def __init__(self, watches: list[list[JSON]]) -> None:
        self.watches = watches
        self.asked: list[str] = []
        self.done = threading.Event()

    def method(self, kube: Any) -> Callable[..., _Response]:
        def list_or_watch(*args: Any, **kwargs: Any) -> _Response:
            if not kwargs.get("watch"):
                doc = {"metadata": {"resourceVersion": "10"}, "items": [_cm(10, 0)]}
                return _Response(json.dumps(doc).encode())
            self.asked.append(kwargs["resource_version"])
            if not self.watches:
                self.done.set()
                return _Response(b"")
            events = self.watches.pop(0)
            return _Response(b"".join(json.dumps(e).encode() + b"\n" for e in events))

        return list_or_watch


@pytest.fixture(autouse=True)
def _no_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_module, "Kube", _FakeKube)


def test_each_watch_resumes_where_the_last_one_stopped() -> None:
    server = _Server(
        [
            [
                {"type": "MODIFIED", "object": _cm(11, 1)},
                {"type": "MODIFIED", "object": _cm(12, 2)},
            ],
            [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}}],
            [{"type": "MODIFIED", "object": _cm(21, 3)}],
        ]
    )
    with History(Path("kubeconfig"), server.method) as history:
        versions = history.through(_cm(21, 3), timeout=10)
        assert server.done.wait(10)
    assert [v.obj["data"]["n"] for v in versions] == [0, 1, 2, 3]
    assert [v.type for v in versions] == ["LISTED", "MODIFIED", "MODIFIED", "MODIFIED"]
    assert server.asked[:4] == ["10", "12", "20", "21"]


def test_a_refused_resume_is_a_gap() -> None:
    gone = {"kind": "Status", "code": 410, "message": "too old resource version: 10 (15)"}
    server = _Server(
        [[{"type": "MODIFIED", "object": _cm(11, 1)}], [{"type": "ERROR", "object": gone}]]
    )
    with History(Path("kubeconfig"), server.method) as history:
        history.wait(lambda v: v.rv == "11", 10, "version 11")
        with pytest.raises(HistoryGap, match="could not resume at resourceVersion 11"):
            history.wait(lambda v: v.rv == "12", 10, "version 12")
    assert server.asked == ["10", "11"]  # and no LIST again past the gap


def test_an_error_status_answer_is_a_gap_too() -> None:
    class _Gone(_Server):
        def method(self, kube: Any) -> Callable[..., _Response]:
            inner = super().method(kube)

            def answer(*args: Any, **kwargs: Any) -> _Response:
                if kwargs.get("watch"):
                    self.asked.append(kwargs["resource_version"])
                    return _Response(b'{"code": 410}', status=410)
                return inner(*args, **kwargs)

            return answer

    server = _Gone([])
    with History(Path("kubeconfig"), server.method) as history, pytest.raises(HistoryGap):
        history.wait(lambda v: v.rv == "11", 10, "version 11")
