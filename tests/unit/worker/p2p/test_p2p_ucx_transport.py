"""The UCX transport of a pull: options per agent, what UCX says it used, what a pull does when
UCX only emulates GPU memory.

Covers: the one agent constructor hands NIXL's UCX backend our options (NIXL lists them, UCX
logs taking or refusing each); the options are the agent's own (two agents of one process, one
told UCX_TLS=tcp, report different transports for the same READ); UCX's protocol records parsed
(memory types, READ size ranges, several endpoint configurations); a two-process pull reports
the transport UCX named; the decision on software emulation of GPU memory (a pure function);
and a loader that gives a peer up for storage on that decision tries no other candidate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.p2p import needs_nixl, source_process
from weightlift.api.worker import PeerCandidate
from weightlift.local.sharded import make_plan
from weightlift.worker.loaders.p2p import PeerToPeerLoader
from weightlift.worker.p2p import target, ucx_proto
from weightlift.worker.p2p.nixl_compat import new_agent, proto_dir
from weightlift.worker.p2p.transport import (
    AGENT_UCX_OPTIONS,
    EmulationChoice,
    choose_on_emulation,
    engine_config,
)
from weightlift.worker.p2p.ucx_proto import ReadTransport, read_transports
from weightlift.worker.weights.progress import LoadError, LoadProgress

CPU = torch.device("cpu")
FAST = target.PullOptions(transfer_timeout_s=5, stall_seconds=3, liveness_interval_s=0.25)

# ------------------------------------------------------------------ options, per agent

_MAKE_AGENT = """
import json
from weightlift.worker.p2p.nixl_compat import new_agent
agent = new_agent("probe", record_reads=True)
print(json.dumps(agent.get_backend_params("UCX")))
del agent
"""


@needs_nixl
def test_the_agents_options_reach_its_ucx_backend() -> None:
    """NIXL lists the backend's init parameters; UCX (through NIXL's debug log) says whether it
    took each option. GET over cuda_ipc exists only where UCX's CUDA transports loaded: on a
    host without a GPU UCX refuses the name, on a GPU host it must take it. ~1 s."""
    env = {**os.environ, "NIXL_LOG_LEVEL": "DEBUG"}
    for name in ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "UCX_PROTO_INFO", "UCX_PROTO_INFO_DIR"):
        env.pop(name, None)  # set, it would win over ours
    out = subprocess.run(
        [sys.executable, "-c", _MAKE_AGENT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    params = json.loads(out.stdout.splitlines()[-1])
    assert params["ucx_error_handling_mode"] == "peer"
    assert "CUDA_IPC_ENABLE_GET_ZCOPY=y" in params["engine_config"].split(",")
    said = [line for line in out.stderr.splitlines() if "UCX config: CUDA_IPC_ENABLE_GET" in line]
    assert len(said) == 1, out.stderr[-3000:]
    if torch.cuda.is_available():
        assert "Modified UCX config: CUDA_IPC_ENABLE_GET_ZCOPY=y" in said[0]
    took = [line for line in out.stderr.splitlines() if "Modified UCX config: PROTO_INFO" in line]
    assert len(took) == 2, out.stderr[-3000:]  # PROTO_INFO and PROTO_INFO_DIR


def test_engine_config_refuses_what_would_split_wrongly() -> None:
    """NIXL splits engine_config on commas: a list value (UCX_TLS=rc,cuda_ipc) cannot pass
    through it and is refused, not cut in two."""
    for bad in ({"UCX_TLS": "rc,cuda_ipc"}, {"A=B": "y"}, {"": "y"}):
        with pytest.raises(ValueError, match="UCX option"):
            engine_config(bad)
    assert engine_config({"UCX_TLS": "tcp", "X": "a=b"}) == "TLS=tcp,X=a=b"
    assert engine_config(AGENT_UCX_OPTIONS) == "CUDA_IPC_ENABLE_GET_ZCOPY=y"


def _read_once(reader: object, source: object) -> None:
    """One 1 MiB READ between two agents of this process, driven to completion."""
    src = torch.arange(1 << 20, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    a, b = reader, source
    b.register_memory([(src.data_ptr(), src.numel(), 0, "")], "DRAM")  # type: ignore[attr-defined]
    a.register_memory([(dst.data_ptr(), dst.numel(), 0, "")], "DRAM")  # type: ignore[attr-defined]
    name = a.add_remote_agent(b.get_agent_metadata())  # type: ignore[attr-defined]
    local = a.get_xfer_descs([(dst.data_ptr(), dst.numel(), 0)], "DRAM")  # type: ignore[attr-defined]
    remote = a.get_xfer_descs([(src.data_ptr(), src.numel(), 0)], "DRAM")  # type: ignore[attr-defined]
    h = a.initialize_xfer("READ", local, remote, name)  # type: ignore[attr-defined]
    assert a.transfer(h) != "ERR"  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while (state := a.check_xfer_state(h)) == "PROC" and time.monotonic() < deadline:  # type: ignore[attr-defined]
        b.get_new_notifs()  # type: ignore[attr-defined]
        time.sleep(0.001)
    assert state == "DONE" and torch.equal(src, dst)
    a.release_xfer_handle(h)  # type: ignore[attr-defined]
    a.remove_remote_agent(name)  # type: ignore[attr-defined]


@needs_nixl
def test_options_are_the_agents_own_and_ucx_reports_its_choice() -> None:
    """Same process, same READ: an agent told UCX_TLS=tcp (its own engine_config) reports
    software emulation over tcp, one with our defaults reports what UCX picks on one host
    (cma here: zero-copy). ~0.2 s."""
    source = new_agent("src-proto")
    plain = new_agent("plain-proto", record_reads=True)
    tcp = new_agent("tcp-proto", record_reads=True, ucx_options={"TLS": "tcp"})
    _read_once(plain, source)
    _read_once(tcp, source)
    seen = {}
    for who, agent in (("plain", plain), ("tcp", tcp)):
        directory = proto_dir(agent)
        assert directory is not None
        seen[who] = read_transports(directory, local_mem="DRAM", remote_mem="DRAM", nbytes=1 << 20)
    # tcp over whichever interface UCX picks (lo, or a bridge another test made)
    assert len(seen["tcp"]) == 1 and seen["tcp"][0].emulated, seen
    assert seen["tcp"][0].config.startswith("tcp/"), seen
    assert len(seen["plain"]) == 1 and not seen["plain"][0].emulated, seen
    assert seen["plain"][0].config.split("/")[0] in ("cma", "sysv", "posix", "tcp"), seen
    gone = proto_dir(tcp)
    assert gone is not None
    del tcp, agent  # the loop left the last one in `agent`
    assert not gone.exists()  # the record goes with its agent


# ------------------------------------------------------------------ UCX's records, parsed

_DOT = 'digraph {{\n\tnode0 [label="{desc}\\n{config}" shape=box style=rounded]\n}}\n'


def _record(folder: Path, name: str, desc: str, config: str) -> None:
    (folder / name).write_text(_DOT.format(desc=desc, config=config))


def test_records_parsed_by_memory_types_and_read_size(tmp_path: Path) -> None:
    host = "t_intra_node_cfg_1_get_multi_into_host_memory_from_host"
    gpu = "t_intra_node_cfg_2_get_multi_into_cuda_memory_from_cuda"
    _record(tmp_path, f"{host}_0_626.dot", "short", "tcp/lo")
    _record(tmp_path, f"{host}_627_inf.dot", "zero-copy", "cma/memory")
    _record(tmp_path, f"{gpu}_0_64K.dot", "software emulation", "tcp/lo")
    _record(tmp_path, f"{gpu}_65537_inf.dot", "zero-copy", "cuda_ipc/cuda")
    _record(tmp_path, "t_intra_node_cfg_1_put_multi_from_host_0_inf.dot", "zero-copy", "x/y")
    got = read_transports(tmp_path, local_mem="DRAM", remote_mem="DRAM", nbytes=64 << 20)
    assert got == [ReadTransport("zero-copy", "cma/memory")]
    got = read_transports(tmp_path, local_mem="VRAM", remote_mem="VRAM", nbytes=64 << 20)
    assert [str(t) for t in got] == ["cuda_ipc/cuda (zero-copy)"]
    small = read_transports(tmp_path, local_mem="VRAM", remote_mem="VRAM", nbytes=4096)
    assert small == [ReadTransport("software emulation", "tcp/lo")] and small[0].emulated
    assert read_transports(tmp_path, local_mem="DRAM", remote_mem="VRAM", nbytes=1) == []


def test_records_of_several_endpoint_configurations_all_named(tmp_path: Path) -> None:
    """An agent that pulled before keeps its records: a pull reads the ones new since it
    started (target.learn_transport), and names every distinct one it finds."""
    _record(tmp_path, "t_cfg_1_get_into_host_memory_from_host_0_inf.dot", "zero-copy", "cma/memory")
    _record(
        tmp_path, "t_cfg_2_get_into_host_memory_from_host_0_inf.dot", "zero-copy", "rc/mlx5_0:1"
    )
    both = read_transports(tmp_path, local_mem="DRAM", remote_mem="DRAM", nbytes=1)
    assert [t.config for t in both] == ["cma/memory", "rc/mlx5_0:1"]
    new = {"t_cfg_2_get_into_host_memory_from_host_0_inf.dot"}
    got = read_transports(tmp_path, local_mem="DRAM", remote_mem="DRAM", nbytes=1, names=new)
    assert [t.config for t in got] == ["rc/mlx5_0:1"]


def test_record_dirs_of_gone_processes_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed (or ended by os._exit) leaves its records: the next process to make one
    removes the roots of pids that no longer exist, never a live one's. ~0.05 s."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ucx_proto, "_roots", {})
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid names no process now
    gone = tmp_path / f"wl-ucx-proto-{ended.pid}"
    live = tmp_path / f"wl-ucx-proto-{os.getppid()}"
    for root in (gone, live):
        (root / "agent").mkdir(parents=True)
    made = ucx_proto.record_dir()
    assert made is not None and made.parent == tmp_path / f"wl-ucx-proto-{os.getpid()}"
    assert not gone.exists() and live.exists()


# ------------------------------------------------------------------ software emulation


EMULATED = ReadTransport("software emulation", "tcp/lo")
IPC = ReadTransport("zero-copy", "cuda_ipc/cuda")
CMA = ReadTransport("zero-copy", "cma/memory")


@pytest.mark.parametrize(
    ("transports", "local", "remote", "storage", "want"),
    [
        ([IPC], "VRAM", "VRAM", True, None),  # the fast path
        ([CMA], "DRAM", "DRAM", True, None),
        ([EMULATED], "DRAM", "DRAM", True, None),  # host memory over TCP: the network's speed
        ([EMULATED], "VRAM", "VRAM", True, EmulationChoice.STORAGE),
        ([EMULATED], "DRAM", "VRAM", True, EmulationChoice.STORAGE),  # a GPU peer, a CPU target
        ([IPC, EMULATED], "VRAM", "VRAM", True, EmulationChoice.STORAGE),
        ([EMULATED], "VRAM", "VRAM", False, EmulationChoice.CONTINUE),
        ([], "VRAM", "VRAM", True, None),  # UCX recorded nothing: no guess
    ],
)
def test_emulated_gpu_memory_goes_to_storage_when_the_plan_allows(
    transports: list[ReadTransport],
    local: str,
    remote: str,
    storage: bool,
    want: EmulationChoice | None,
) -> None:
    got = choose_on_emulation(
        transports, local_mem=local, remote_mem=remote, storage_fallback=storage
    )
    if want is None:
        assert got is None
        return
    assert got is not None and got.action == want
    assert "tcp/lo (software emulation)" in got.reason  # UCX's own words, in the status
    assert ("loading from storage" in got.reason) == (want == EmulationChoice.STORAGE)


# ------------------------------------------------------------------ real pulls


@pytest.fixture(scope="module")
def two_sources(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[PeerCandidate]]:
    tmp = tmp_path_factory.mktemp("src")
    with (
        source_process(model_dir, tmp, pod="src-a") as (_, a),
        source_process(model_dir, tmp, pod="src-b") as (_, b),
    ):
        yield [a, b]


@needs_nixl
@pytest.mark.timeout(120)
def test_a_pull_reports_the_transport_ucx_named(
    model_dir: Path, two_sources: list[PeerCandidate]
) -> None:
    """~0.3 s beside the sources' start (~3 s, shared with the next test)."""
    plan = make_plan(model_dir, pod="tgt-0", role="Target", peers=two_sources[:1])  # type: ignore[arg-type]
    progress = LoadProgress()
    loader = PeerToPeerLoader(options=FAST)
    loader.load(plan, 0, CPU, progress)
    result = loader.last_result
    assert result is not None and progress.transport == result.transport
    name, _, desc = result.transport.partition(" ")
    assert name.split("/")[0] in ("cma", "sysv", "posix", "tcp"), result.transport
    assert desc.startswith("(") and "unknown" not in result.transport
    assert result.transport_note == ""


@needs_nixl
@pytest.mark.timeout(120)
def test_a_peer_given_up_for_storage_ends_the_candidates(
    model_dir: Path, two_sources: list[PeerCandidate], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision above says storage (here for host memory, as it would for GPU memory on a
    host whose UCX can only emulate it) as the first READ is posted: the pull releases it, the
    loader tries no other candidate, says why, and the storage fallback follows (LoadError).
    ~0.3 s."""

    def always(*args: object, **kw: object) -> object:
        return choose_on_emulation(
            [EMULATED], local_mem="VRAM", remote_mem="VRAM", storage_fallback=True
        )

    monkeypatch.setattr(target, "choose_on_emulation", always)
    plan = make_plan(model_dir, pod="tgt-0", role="Target", peers=two_sources)  # type: ignore[arg-type]
    progress = LoadProgress()
    loader = PeerToPeerLoader(options=FAST)
    quarantined = len(target._QUARANTINE)
    with pytest.raises(LoadError, match="loading from storage instead"):
        loader.load(plan, 0, CPU, progress)
    assert [f.kind for f in loader.failures] == ["emulated"]
    assert len(target._QUARANTINE) == quarantined  # its one READ in flight was released
    assert progress.transport_note.startswith("UCX moves GPU memory")
    assert progress.transport and "unknown" not in progress.transport
