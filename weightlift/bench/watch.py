"""The benchmark's own async API client (httpx): many creates at once and list+watch streams,
concurrently on one event loop, which the official client (synchronous, a thread per call in
flight) does not do. The kubeconfig is read by the official client's loader.

It runs as the cluster admin, not as the operator, so the audit log never counts it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from kubernetes import client, config

JSON = dict[str, Any]


class AsyncKube:
    def __init__(self, kubeconfig: Path) -> None:
        conf = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=conf)
        headers = {"Accept": "application/json", "User-Agent": "weightlift-bench/watch"}
        bearer = conf.auth_settings().get("BearerToken")  # when the user has a token
        if bearer and bearer["value"]:
            headers["Authorization"] = str(bearer["value"])
        verify: ssl.SSLContext | bool = False
        if conf.verify_ssl:
            verify = ssl.create_default_context(cafile=conf.ssl_ca_cert)
            if conf.cert_file and conf.key_file:
                verify.load_cert_chain(conf.cert_file, conf.key_file)
        self._client = httpx.AsyncClient(
            base_url=conf.host,
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(30.0),
            limits=httpx.Limits(max_connections=32),
            trust_env=False,
        )

    async def __aenter__(self) -> AsyncKube:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._client.aclose()

    async def create_all(
        self, path: str, bodies: list[JSON], created: dict[str, float], concurrency: int
    ) -> None:
        """POST every body, `concurrency` at a time; records when each was created. A 404
        right after the CRD became Established (discovery catching up) is retried."""
        queue: asyncio.Queue[JSON] = asyncio.Queue()
        for body in bodies:
            queue.put_nowait(body)

        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                await self.create(path, body)
                created[body["metadata"]["name"]] = time.time()

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def create(self, path: str, body: JSON) -> JSON:
        """POST one body; the created object (a 404 right after a CRD became Established is
        retried, as in create_all)."""
        for attempt in range(50):
            response = await self._client.post(path, json=body)
            if response.status_code != 404:
                break
            await asyncio.sleep(0.1 * (attempt + 1))
        if response.status_code not in (200, 201):
            name = body["metadata"]["name"]
            status, text = response.status_code, response.text[:300]
            raise RuntimeError(f"creating {name}: HTTP {status} {text}")
        created: JSON = response.json()
        return created

    async def patch_status(self, path: str, status: JSON) -> None:
        """A JSON merge patch of one object's status subresource (`path` names the object)."""
        response = await self._client.patch(
            f"{path}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        response.raise_for_status()

    async def follow(
        self,
        path: str,
        params: dict[str, str],
        on_event: Callable[[JSON], None],
        stop: asyncio.Event,
    ) -> None:
        """List, then watch from the list's resourceVersion until `stop`; each listed object
        comes as an ADDED event. Reconnects when the server ends a watch."""
        version = ""
        while not stop.is_set():
            if not version:
                listing = (await self._client.get(path, params=params)).json()
                for item in listing.get("items", []):
                    on_event({"type": "ADDED", "object": item})
                version = listing["metadata"]["resourceVersion"]
            query = {**params, "watch": "1", "resourceVersion": version, "timeoutSeconds": "60"}
            timeout = httpx.Timeout(10.0, read=90.0)
            async with self._client.stream("GET", path, params=query, timeout=timeout) as stream:
                async for line in stream.aiter_lines():
                    if not line.strip():
                        continue
                    event: JSON = json.loads(line)
                    if event.get("type") == "ERROR":  # e.g. 410 Gone: list again
                        version = ""
                        break
                    version = event["object"]["metadata"].get("resourceVersion", version)
                    if event.get("type") != "BOOKMARK":
                        on_event(event)
