"""The shared ranged-GET plan (worker/storage/ranged.py) that s3:// and hf:// downloads follow."""

from __future__ import annotations

import errno
import http.server
import io
import itertools
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import urllib3

from weightlift.worker.storage.ranged import (
    BodyLost,
    Sink,
    drain,
    fetch_files,
    finish,
    ranges,
    socket_readinto,
)


@dataclass(frozen=True)
class File:
    name: str
    size: int


def test_ranges_cover_every_byte_once_with_every_header_first() -> None:
    files = [File("b.safetensors", 100), File("a.safetensors", 35), File("empty.json", 0)]
    jobs = ranges(files, 16)
    for f in files:
        spans = sorted((s, n) for g, s, n in jobs if g == f)
        assert sum(n for _, n in spans) == f.size
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
    # the first range of each file comes before any file's second range
    assert [(g.name, s) for g, s, _ in jobs[:2]] == [("a.safetensors", 0), ("b.safetensors", 0)]


def test_drain_hands_over_offsets_and_stops_at_a_short_body() -> None:
    body = io.BytesIO(bytes(range(200)) * 20000)  # 4 MB: several passes through the buffer
    out = bytearray(3_000_000)

    def sink(piece: memoryview, offset: int) -> None:
        out[offset - 1000 : offset - 1000 + len(piece)] = piece

    assert drain(body.readinto, 1000, 3_000_000, sink) == 3_000_000
    assert bytes(out) == body.getvalue()[:3_000_000]
    assert drain(io.BytesIO(b"abc").readinto, 0, 10, lambda _p, _o: None) == 3


def test_fetch_files_renames_complete_files_into_place_and_leaves_nothing_on_failure(
    tmp_path: Path,
) -> None:
    data = {"a.safetensors": bytes(range(256)) * 1000, "sub/b.json": b"{}"}
    files = [File(name, len(b)) for name, b in data.items()]
    old = tmp_path / "a.safetensors"
    old.write_bytes(b"old contents")
    with old.open("rb") as held:  # someone holds the previous file open: it stays intact

        def read(f: File, start: int, n: int, sink: Sink) -> None:
            sink(memoryview(data[f.name][start : start + n]), start)

        paths = fetch_files(files, tmp_path, read, lambda _n: None, threads=3, chunk_bytes=1000)
        assert held.read() == b"old contents"
    assert {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in paths} == data

    def broken(f: File, start: int, n: int, sink: Sink) -> None:
        if start >= 5000:
            raise OSError(f"{f.name}: connection reset at {start}")
        sink(memoryview(data[f.name][start : start + n]), start)

    with pytest.raises(OSError, match="connection reset"):
        fetch_files(files, tmp_path / "again", broken, lambda _n: None, threads=3, chunk_bytes=1000)
    assert [p for p in (tmp_path / "again").rglob("*") if p.is_file()] == []


BODY = bytes(range(256)) * 12_000  # 3 MB: several passes through the receive buffer


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection serves several GETs

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        if self.path == "/drop":  # 100 KB, then a reset: the connection dies mid-body
            self.wfile.write(BODY[:100_000])
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        self.wfile.write(BODY)

    def log_message(self, *_args: object) -> None:
        return None


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_socket_reads_keep_the_connection_and_leave_a_sinks_own_error_alone(server: str) -> None:
    pool = urllib3.PoolManager()
    out = bytearray(len(BODY))

    def sink(piece: memoryview, offset: int) -> None:
        out[offset : offset + len(piece)] = piece

    def full_disk(_piece: memoryview, _offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    resp = pool.request("GET", server + "/a", preload_content=False)
    assert drain(socket_readinto(resp), 0, len(BODY), sink) == len(BODY)
    finish(resp)
    assert bytes(out) == BODY
    made = pool.connection_from_url(server).num_connections
    resp = pool.request("GET", server + "/b", preload_content=False)  # the kept connection
    with pytest.raises(OSError) as err:  # the disk's error, not a lost body
        drain(socket_readinto(resp), 0, len(BODY), full_disk)
    assert err.value.errno == errno.ENOSPC
    finish(resp)  # 2 MB unread: closed, never handed to the next request
    resp = pool.request("GET", server + "/c", preload_content=False)
    assert drain(socket_readinto(resp), 0, len(BODY), sink) == len(BODY)
    finish(resp)
    assert bytes(out) == BODY
    assert (made, pool.connection_from_url(server).num_connections) == (1, 2)


def test_a_connection_reset_mid_body_is_a_lost_body(server: str) -> None:
    pool = urllib3.PoolManager()
    resp = pool.request("GET", server + "/drop", preload_content=False)
    with pytest.raises(BodyLost):
        drain(socket_readinto(resp), 0, len(BODY), lambda _p, _o: time.sleep(0.01))
    finish(resp)
