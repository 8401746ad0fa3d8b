"""A loopback HTTP server that speaks the part of the Hugging Face Hub API `snapshot_download` uses.

Endpoints (as read from huggingface_hub's own client code):
  GET  /api/models/{repo}/revision/{rev}        -> {"id", "sha", "siblings"}  (HfApi.model_info)
  GET  /api/models/{repo}/tree/{sha}?recursive=  -> [{"type": "file", "path", "size", "oid", "lfs"}]
  HEAD /{repo}/resolve/{rev}/{file}             -> X-Repo-Commit, (X-Linked-)ETag, X-Linked-Size
  GET  /{repo}/resolve/{rev}/{file}             -> the bytes (Range honoured: resumed downloads)
Errors carry X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound) as the Hub does, so the
client raises its own typed errors. A token, when set, is required as `Authorization: Bearer`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class HubRepo:
    """One model repository: branch/tag names -> commit sha, commit sha -> a directory of files."""

    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Path] = field(default_factory=dict)

    def add_commit(self, directory: Path, *, ref: str = "main") -> str:
        digest = hashlib.sha1()
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            digest.update(path.relative_to(directory).as_posix().encode())
            digest.update(_sha256(path).encode())
        sha = digest.hexdigest()
        self.commits[sha] = directory
        self.refs[ref] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


_digests: dict[tuple[str, str, int, int], str] = {}
_digests_lock = threading.Lock()


def _digest(path: Path, algo: str) -> str:
    """`algo` hex digest of `path`, computed once per (path, size, mtime): the Hub stores its
    hashes, and hashing a large file on every ranged GET would make this server the bottleneck."""
    st = path.stat()
    key = (str(path), algo, st.st_size, st.st_mtime_ns)
    with _digests_lock:
        known = _digests.get(key)
    if known is not None:
        return known
    h = hashlib.new(algo)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    with _digests_lock:
        _digests[key] = h.hexdigest()
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return _digest(path, "sha256")


class _Handler(BaseHTTPRequestHandler):
    server: HubServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _error(self, status: HTTPStatus, code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _json(self, data: object) -> None:
        payload = json.dumps(data).encode()
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _serve(self, *, body: bool) -> None:
        token = self.server.token
        if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
            self._error(
                HTTPStatus.UNAUTHORIZED,
                "RepoNotFound",
                "Invalid credentials in Authorization header",
            )
            return
        path = unquote(urlsplit(self.path).path)
        if path.startswith("/api/models/"):
            self._api(path.removeprefix("/api/models/"))
        elif "/resolve/" in path:
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            revision, _, filename = rest.partition("/")
            self._resolve(repo_id, revision, filename, body=body)
        else:
            self._error(HTTPStatus.NOT_FOUND, "EntryNotFound", f"no route {path}")

    def _repo(self, repo_id: str) -> HubRepo | None:
        repo = self.server.repos.get(repo_id)
        if repo is None:
            self._error(HTTPStatus.NOT_FOUND, "RepoNotFound", f"Repository {repo_id} not found")
        return repo

    def _api(self, rest: str) -> None:
        for marker in ("/revision/", "/tree/"):
            if marker in rest:
                repo_id, revision = rest.split(marker, 1)
                break
        else:
            self._error(HTTPStatus.NOT_FOUND, "EntryNotFound", f"no API route {rest}")
            return
        repo = self._repo(repo_id)
        if repo is None:
            return
        sha = repo.resolve(revision.strip("/"))
        if sha is None:
            self._error(HTTPStatus.NOT_FOUND, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        files = sorted(p for p in repo.commits[sha].rglob("*") if p.is_file())
        root = repo.commits[sha]
        if marker == "/revision/":
            siblings = [{"rfilename": p.relative_to(root).as_posix()} for p in files]
            self._json(
                {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": sha,
                    "siblings": siblings,
                    "private": False,
                }
            )
            return
        self._json(
            [
                {
                    "type": "file",
                    "path": p.relative_to(root).as_posix(),
                    "size": p.stat().st_size,
                    "oid": _digest(p, "sha1"),
                    "lfs": {"oid": _sha256(p), "size": p.stat().st_size, "pointerSize": 134},
                }
                for p in files
            ]
        )

    def _resolve(self, repo_id: str, revision: str, filename: str, *, body: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        sha = repo.resolve(revision)
        if sha is None:
            self._error(HTTPStatus.NOT_FOUND, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        path = repo.commits[sha] / filename
        if not path.is_file():
            self._error(
                HTTPStatus.NOT_FOUND, "EntryNotFound", f"{filename} does not exist at {sha}"
            )
            return
        size = path.stat().st_size
        start, end = 0, size - 1
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes="):
            first, _, last = ranged.removeprefix("bytes=").partition("-")
            start = int(first or 0)
            end = int(last) if last else size - 1
        self.send_response(HTTPStatus.PARTIAL_CONTENT if ranged else HTTPStatus.OK)
        etag = f'"{_sha256(path)}"'
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", etag)
        self.send_header("X-Linked-Etag", etag)
        self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if body:
            self.wfile.flush()
            with path.open("rb") as f:  # sendfile: the kernel copies, the GIL is released
                self.connection.sendfile(f, start, end - start + 1)


class HubServer(ThreadingHTTPServer):
    """`with HubServer(repos) as hub: os.environ["HF_ENDPOINT"] = hub.endpoint`."""

    daemon_threads = True

    def __init__(
        self, repos: dict[str, HubRepo], *, token: str | None = None, host: str = "127.0.0.1"
    ) -> None:
        super().__init__((host, 0), _Handler)
        self.repos = repos
        self.token = token
        self._thread = threading.Thread(target=self.serve_forever, name="hub-server", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()
