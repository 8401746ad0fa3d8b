"""A small, synchronous Kubernetes REST client on httpx for the process node and the demo.

It speaks plain JSON dicts (what the API server sends), which is all the process node needs:
get/list/create/patch/delete and line-delimited watch streams. The kubeconfig's current context
may use a bearer token, client certificates (file or inline data) and a CA (file or inline data).
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

JSON = dict[str, Any]
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


class KubeError(RuntimeError):
    def __init__(self, status: int, body: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class KubeConfig:
    server: str
    token: str | None
    verify: str | bool
    cert: tuple[str, str] | None

    @classmethod
    def load(cls, path: Path, tmp_dir: Path | None = None) -> KubeConfig:
        doc = yaml.safe_load(path.read_text())
        current = doc.get("current-context")
        contexts = {c["name"]: c["context"] for c in doc.get("contexts", [])}
        if current not in contexts:
            if not contexts:
                raise ValueError(f"{path}: no contexts")
            current = next(iter(contexts))
        ctx = contexts[current]
        cluster = {c["name"]: c["cluster"] for c in doc["clusters"]}[ctx["cluster"]]
        user = {u["name"]: u["user"] for u in doc.get("users", [])}.get(ctx.get("user"), {})
        base = path.parent
        scratch = tmp_dir or Path(tempfile.mkdtemp(prefix="weightlift-kube-"))

        def materialize(file_key: str, data_key: str, section: dict[str, Any]) -> str | None:
            if section.get(file_key):
                p = Path(section[file_key])
                return str(p if p.is_absolute() else base / p)
            if section.get(data_key):
                out = scratch / f"{data_key}.pem"
                out.write_bytes(base64.b64decode(section[data_key]))
                out.chmod(0o600)
                return str(out)
            return None

        verify: str | bool = True
        if cluster.get("insecure-skip-tls-verify"):
            verify = False
        else:
            ca = materialize("certificate-authority", "certificate-authority-data", cluster)
            if ca:
                verify = ca
        cert_file = materialize("client-certificate", "client-certificate-data", user)
        key_file = materialize("client-key", "client-key-data", user)
        token = user.get("token")
        if not token and user.get("tokenFile"):
            token = Path(user["tokenFile"]).read_text().strip()
        return cls(
            server=cluster["server"].rstrip("/"),
            token=token,
            verify=verify,
            cert=(cert_file, key_file) if cert_file and key_file else None,
        )


class Kube:
    """`Kube(kubeconfig).get("/api/v1/nodes/x")` etc. Thread-safe (httpx.Client is)."""

    def __init__(self, kubeconfig: Path, timeout: float = 30.0) -> None:
        self.config = KubeConfig.load(kubeconfig)
        headers = {"Accept": "application/json"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        verify: ssl.SSLContext | bool = False
        if self.config.verify is not False:
            cafile = self.config.verify if isinstance(self.config.verify, str) else None
            verify = ssl.create_default_context(cafile=cafile)
            if self.config.cert:
                verify.load_cert_chain(*self.config.cert)
        self._client = httpx.Client(
            base_url=self.config.server, headers=headers, verify=verify, timeout=timeout
        )

    def close(self) -> None:
        self._client.close()

    def _check(self, resp: httpx.Response, what: str) -> JSON:
        if resp.status_code >= 400:
            raise KubeError(resp.status_code, resp.text, what)
        if not resp.content:
            return {}
        data: JSON = resp.json()
        return data

    def get(self, path: str, params: dict[str, str] | None = None) -> JSON:
        return self._check(self._client.get(path, params=params), f"GET {path}")

    def get_or_none(self, path: str) -> JSON | None:
        try:
            return self.get(path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, body: JSON, params: dict[str, str] | None = None) -> JSON:
        return self._check(self._client.post(path, json=body, params=params), f"POST {path}")

    def replace(self, path: str, body: JSON) -> JSON:
        return self._check(self._client.put(path, json=body), f"PUT {path}")

    def patch(self, path: str, body: JSON, content_type: str = STRATEGIC) -> JSON:
        resp = self._client.patch(
            path, content=json.dumps(body), headers={"Content-Type": content_type}
        )
        return self._check(resp, f"PATCH {path}")

    def delete(self, path: str, body: JSON | None = None) -> JSON | None:
        resp = self._client.request("DELETE", path, json=body or {})
        if resp.status_code == 404:
            return None
        return self._check(resp, f"DELETE {path}")

    def watch(self, path: str, params: dict[str, str], timeout_seconds: int = 60) -> Iterator[JSON]:
        """Yield watch events ({"type", "object"}) until the server ends the stream."""
        query = {**params, "watch": "1", "timeoutSeconds": str(timeout_seconds)}
        timeout = httpx.Timeout(10.0, read=timeout_seconds + 15.0)
        with self._client.stream("GET", path, params=query, timeout=timeout) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise KubeError(resp.status_code, resp.text, f"WATCH {path}")
            for line in resp.iter_lines():
                if line.strip():
                    event: JSON = json.loads(line)
                    yield event
