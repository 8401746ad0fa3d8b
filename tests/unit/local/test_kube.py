"""local/kube.py against a real HTTP server speaking the API server's JSON: answers come back as
the wire JSON (camelCase, no model classes), 404 is None where asked, errors read as one line
with the API server's message, patches say their type, the client names itself, and a request
to a server that never answers fails at its deadline instead of hanging."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from weightlift.local import kube
from weightlift.local.kube import MERGE, Kube, call, delete, describe, get_or_none

JSON = dict[str, Any]
NODE: JSON = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {"name": "n0", "uid": "u-1"},
    "status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}}},
}
MISSING: JSON = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "message": 'nodes "gone" not found',
    "reason": "NotFound",
    "code": 404,
}


class _ApiServer(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, str, str]] = []  # method, path, content type, user agent

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        ctype, agent = self.headers.get("Content-Type", ""), self.headers.get("User-Agent", "")
        self.seen.append((self.command, self.path, ctype, agent))
        found = self.path.startswith("/api/v1/nodes/n0")
        body = json.dumps(NODE if found else MISSING).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        return None


def _kubeconfig(tmp_path: Path, port: int) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t0k3n"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    _ApiServer.seen = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_answers_are_the_wire_json(server: ThreadingHTTPServer, tmp_path: Path) -> None:
    api = Kube(_kubeconfig(tmp_path, server.server_port), "unit")
    try:
        assert api.server == f"http://127.0.0.1:{server.server_port}"
        assert call(api.core.read_node, "n0") == NODE  # "Port" as sent, not a model's "port"
        assert get_or_none(api.core.read_node, "gone") is None
        delete(api.core.delete_node, "gone")  # already gone is fine
        with pytest.raises(ApiException) as missing:
            call(api.core.read_node, "gone")
        assert missing.value.status == 404
        assert describe(missing.value) == 'HTTP 404 Not Found: nodes "gone" not found'
        call(api.core.patch_node, "n0", {"metadata": {"labels": {"a": "b"}}}, _content_type=MERGE)
    finally:
        api.close()
    methods = [(method, path) for method, path, _, _ in _ApiServer.seen]
    assert methods == [
        ("GET", "/api/v1/nodes/n0"),
        ("GET", "/api/v1/nodes/gone"),
        ("DELETE", "/api/v1/nodes/gone"),
        ("GET", "/api/v1/nodes/gone"),
        ("PATCH", "/api/v1/nodes/n0"),
    ]
    assert _ApiServer.seen[-1][2] == MERGE
    assert {agent for *_, agent in _ApiServer.seen} == {"weightlift-local/unit"}


def test_a_request_nobody_answers_fails_at_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    silent = socket.socket()  # accepts connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    monkeypatch.setattr(kube, "TIMEOUT", 0.3)
    api = Kube(_kubeconfig(tmp_path, silent.getsockname()[1]), "unit")
    try:
        with pytest.raises(urllib3.exceptions.HTTPError):
            call(api.core.read_node, "n0")
    finally:
        api.close()
        silent.close()
