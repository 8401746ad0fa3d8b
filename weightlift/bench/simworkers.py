"""Simulated workers for `weightlift bench operator`: one asyncio process answering, for every
kwok pod IP on loopback, what a serving worker answers the operator.

kwok gives simulated pods addresses in POD_CIDR (127.244.0.0/16, loopback); Linux delivers all
of 127.0.0.0/8 to `lo`, so one socket bound to the wildcard address on the runtime port receives
the operator's requests for every pod IP. Requests to an address outside the pod CIDR get 404
(only the bench's own /sim/stats is served there). Per pod address:

- GET /weightlift/v1/status: a WorkerReport saying Serving, weights loaded from storage;
- POST /v2/models/{model}/infer: KServe v2; each input tensor `x` comes back as output
  `y` = 2 * x (same shape), so the operator's probe really checks a computed answer.

Run: `python -m weightlift.bench.simworkers --port P --cidr 127.244.0.0/16 --ready-file F`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
from aiohttp import web

from weightlift.api.worker import WorkerPhase, WorkerReport

SIM_BYTES = 2 << 30  # what each simulated replica claims to have loaded (2 GiB)


def probe_request() -> dict[str, Any]:
    """The inference probe the benchmark puts in each ModelDeployment's spec."""
    return {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def expected_outputs() -> list[dict[str, Any]]:
    """What the probe expects back: y = 2 * x."""
    return [{"name": "y", "shape": [1, 4], "data": [2.0, 4.0, 6.0, 8.0]}]


def infer(body: dict[str, Any]) -> dict[str, Any]:
    """The simulated model: every input tensor doubled, named y (x -> y, others -> name_out)."""
    outputs = []
    for tensor in body["inputs"]:
        name = "y" if tensor["name"] == "x" else f"{tensor['name']}_out"
        data = [2.0 * float(v) for v in tensor["data"]]
        outputs.append({"name": name, "shape": tensor["shape"], "datatype": "FP32", "data": data})
    return {"outputs": outputs}


class SimulatedWorkers:
    """The aiohttp app plus what it counts (requests per route, distinct pod addresses)."""

    def __init__(self, cidr: str) -> None:
        self.network = ipaddress.ip_network(cidr)
        self.counts: Counter[str] = Counter()
        self.addresses: set[str] = set()
        self.started = time.time()
        report = WorkerReport(
            phase=WorkerPhase.SERVING,
            message="simulated worker (weightlift bench operator)",
            strategy="preload",
            loaded_from="storage",
            bytes_loaded=SIM_BYTES,
            bytes_total=SIM_BYTES,
            gbps=10.0,
            load_seconds=SIM_BYTES / 10e9,
            hooks_run=False,
        )
        self.report_body = json.dumps(report.wire()).encode()

    def _pod_address(self, request: web.Request) -> str | None:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        if not sockname:
            return None
        address: str = sockname[0]
        return address if ipaddress.ip_address(address) in self.network else None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/weightlift/v1/status", self.status)
        app.router.add_post("/v2/models/{model}/infer", self.infer)
        app.router.add_get("/sim/stats", self.stats)
        return app

    async def status(self, request: web.Request) -> web.Response:
        address = self._pod_address(request)
        if address is None:
            raise web.HTTPNotFound(text="not a simulated pod address")
        self.counts["status"] += 1
        self.addresses.add(address)
        return web.Response(body=self.report_body, content_type="application/json")

    async def infer(self, request: web.Request) -> web.Response:
        address = self._pod_address(request)
        if address is None:
            raise web.HTTPNotFound(text="not a simulated pod address")
        self.counts["infer"] += 1
        self.addresses.add(address)
        try:
            answer = infer(await request.json())
        except (ValueError, KeyError, TypeError) as exc:
            self.counts["infer_bad_request"] += 1
            raise web.HTTPBadRequest(text=f"bad KServe v2 request: {exc}") from exc
        answer["model_name"] = request.match_info["model"]
        return web.json_response(answer)

    async def stats(self, request: web.Request) -> web.Response:
        if self._pod_address(request) is not None:
            raise web.HTTPNotFound()
        return web.json_response(self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        return {
            "time": time.time(),
            "requests": dict(self.counts),
            "pod_addresses": len(self.addresses),
        }


async def serve(port: int, cidr: str, ready_file: Path | None) -> None:
    sim = SimulatedWorkers(cidr)
    runner = web.AppRunner(sim.app(), access_log=None, handle_signals=False)
    await runner.setup()
    # Wildcard on loopback's behalf: every 127.x.y.z:port reaches this one socket.
    site = web.TCPSite(runner, "0.0.0.0", port, backlog=4096)
    await site.start()
    if ready_file is not None:
        ready_file.write_text(json.dumps({"port": port}))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(asyncio.CancelledError):
        await stop.wait()
    await runner.cleanup()


@click.command()
@click.option("--port", type=int, required=True, help="The ModelDeployments' runtime.port.")
@click.option("--cidr", default="127.244.0.0/16", show_default=True, help="kwok's pod CIDR.")
@click.option("--ready-file", type=click.Path(path_type=Path), default=None)
def main(port: int, cidr: str, ready_file: Path | None) -> None:
    network = ipaddress.ip_network(cidr)
    if not network.is_loopback:
        raise click.BadParameter(f"{cidr} is not loopback: simulated pods stay on this host")
    asyncio.run(serve(port, cidr, ready_file))


if __name__ == "__main__":
    main()
