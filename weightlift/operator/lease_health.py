"""The liveness endpoint of a replica waiting for the Lease: kopf serves /healthz only once it
runs, and a standby that failed its liveness probe would be restarted over and over. It answers
200 while the election loop keeps trying, and frees the port before kopf binds it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serve_standby_health(host: str, port: int, alive: Callable[[], bool]) -> Iterator[None]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path.split("?")[0] == "/healthz" and alive()
            body = b'{"standby": true}' if ok else b'{"standby": false}'
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a probe every few seconds is not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="standby-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
