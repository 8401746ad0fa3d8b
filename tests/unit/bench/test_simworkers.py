"""The simulated workers answer the operator's real status read and inference probe for any pod
address in the CIDR, and nothing outside it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.support.worker import free_port
from weightlift.api.model import InferenceProbe
from weightlift.api.worker import WorkerPhase
from weightlift.bench import simworkers
from weightlift.operator.probes import WorkerClient, fetch_report, probe_inference

CIDR = "127.244.0.0/16"


@pytest.fixture
async def sim_port() -> AsyncIterator[int]:
    sim = simworkers.SimulatedWorkers(CIDR)
    runner = web.AppRunner(sim.app(), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


def _probe(**changes: object) -> InferenceProbe:
    fields = {
        "request": simworkers.probe_request(),
        "expectedOutputs": simworkers.expected_outputs(),
        **changes,
    }
    return InferenceProbe.model_validate(fields)


async def test_pod_addresses_serve_report_and_pass_the_probe(sim_port: int) -> None:
    async with WorkerClient() as client:
        for ip in ("127.244.0.7", "127.244.3.200"):
            address = f"{ip}:{sim_port}"
            report = await fetch_report(client, address)
            assert report is not None and report.phase == WorkerPhase.SERVING
            assert report.bytes_loaded == report.bytes_total > 0
            result = await probe_inference(client, address, "sim", _probe(), None)
            assert result.passed, result.message


async def test_the_probe_checks_the_computed_answer(sim_port: int) -> None:
    wrong = [{"name": "y", "shape": [1, 4], "data": [2.0, 4.0, 6.0, 9.0]}]
    async with WorkerClient() as client:
        result = await probe_inference(
            client, f"127.244.0.7:{sim_port}", "sim", _probe(expectedOutputs=wrong), None
        )
    assert not result.passed
    assert "'y'[3] = 8.0 differs from expected 9.0" in result.message


async def test_addresses_outside_the_pod_cidr_get_nothing(sim_port: int) -> None:
    async with WorkerClient() as client:
        assert await fetch_report(client, f"127.0.0.1:{sim_port}") is None
        stats = (await client.request("GET", f"http://127.0.0.1:{sim_port}/sim/stats", 5)).json()
        assert stats["requests"] == {}
        response = await client.request("GET", f"http://127.244.0.7:{sim_port}/sim/stats", 5)
        assert response.status == 404


async def test_many_pods_at_once_through_the_bounded_client(sim_port: int) -> None:
    """More requests than the client lets into its pool: all complete, slots come back."""
    async with WorkerClient() as client:
        addresses = [f"127.244.{i // 250}.{i % 250 + 1}:{sim_port}" for i in range(100)]
        reports = await asyncio.gather(*(fetch_report(client, a) for a in addresses))
        assert all(r is not None and r.phase == WorkerPhase.SERVING for r in reports)
        stats = (await client.request("GET", f"http://127.0.0.1:{sim_port}/sim/stats", 5)).json()
    assert stats["requests"]["status"] == 100
    assert stats["pod_addresses"] == 100
