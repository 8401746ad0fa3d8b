"""`weightlift bench load --uri hf://org/repo`: a source replica's cold start from the Hub.

Two ways from the same files at the same commit to tensors in host memory, in one run, each
verified bit for bit against safetensors' `load_file` of a reference copy:
 - weightlift-hf-preload: the worker's path (worker/storage/hf.py): resolve the revision and list
   the files with huggingface_hub's API, locate each file (its HEAD), then ranged GETs in parallel
   written straight into the destination files' pages; the preload loader maps those pages.
 - hf-snapshot-download-then-load: huggingface_hub's `snapshot_download` into a fresh cache dir
   (its own threads, `max_workers` = threads), then safetensors `load_file` of every file.
Timed: resolving the revision + transfer + load + reading one byte per page of the result. The
Hub's own limit is measured in the same run: the same ranged GETs into anonymous memory (no
files, no tensors). Without --endpoint the project's Hub API server (local/hubserver.py) is
started on loopback with a fresh demo model; it shares the machine's cores with the clients.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from weightlift.api.uri import ModelUri, hf_repo
from weightlift.bench.measure import Tensors
from weightlift.bench.remote import (
    RemoteLoader,
    bench_remote,
    ignore,
    noop,
    print_remote_table,
    ranged_get_gbps,
    write_doc,
)
from weightlift.worker.loaders.preload import PreloadLoader
from weightlift.worker.storage import hf
from weightlift.worker.storage.hfread import HubReader
from weightlift.worker.weights.files import index_files
from weightlift.worker.weights.progress import LoadProgress

HF_LOADERS = ("weightlift-hf-preload", "hf-snapshot-download-then-load")

NOTES = [
    "weightlift-hf-preload: HfApi model_info + list_repo_tree at the commit, "
    "get_hf_file_metadata per file, then ranged GETs (16 MiB each, `threads` in flight) of "
    "the resolve URLs, each piece pwritten at its offset into the destination files; preload "
    "maps those page-cache pages (no read back).",
    "hf-snapshot-download-then-load: huggingface_hub snapshot_download(allow_patterns="
    "*.safetensors, max_workers = threads, a fresh cache_dir) then safetensors load_file.",
    "hf_ranged_get_gbps: the same ranged GETs into anonymous memory: what the Hub server and the "
    "HTTP stack deliver here, the ceiling for every contender.",
    "CPU s: this process's CPU time over all its threads, the local Hub server's included "
    "(it runs in the bench's process): steadier than wall time on a busy machine.",
]


class HubTarget:
    """One repo at one revision on one Hub endpoint, with the token as the worker gets it."""

    def __init__(
        self, repo_id: str, revision: str, endpoint: str, token: str | None, threads: int
    ) -> None:
        self.repo_id, self.revision, self.endpoint = repo_id, revision, endpoint
        self.token, self.threads = token, threads

    def snapshot(self) -> hf.HubSnapshot:
        snap = hf.resolve(self.repo_id, self.revision, endpoint=self.endpoint, token=self.token)
        weights = [f for f in snap.files if f.name.endswith(".safetensors")]
        return hf.HubSnapshot(snap.repo_id, snap.commit, weights)

    def fetch(self, dest: Path) -> list[Path]:
        snap = self.snapshot()
        return hf.fetch(
            snap, dest, ignore, endpoint=self.endpoint, token=self.token, threads=self.threads
        )


def make_hf_loaders(hub: HubTarget, threads: int, chunk_mib: int) -> dict[str, RemoteLoader]:
    cpu = torch.device("cpu")

    def weightlift(tmp: Path) -> tuple[Tensors, Any]:
        tensors = PreloadLoader().load_index(
            index_files(hub.fetch(tmp)),
            cpu,
            LoadProgress(),
            threads=threads,
            chunk_bytes=chunk_mib << 20,
        )
        return tensors, noop

    def snapshot_then_load(tmp: Path) -> tuple[Tensors, Any]:
        from huggingface_hub import snapshot_download
        from safetensors.torch import load_file

        root = snapshot_download(
            hub.repo_id,
            revision=hub.revision,
            cache_dir=tmp,
            allow_patterns=["*.safetensors"],
            endpoint=hub.endpoint,
            token=hub.token or False,
            max_workers=threads,
        )
        out: Tensors = {}
        for p in sorted(Path(root).glob("*.safetensors")):
            out.update(load_file(str(p)))
        return out, noop

    return {
        "weightlift-hf-preload": weightlift,
        "hf-snapshot-download-then-load": snapshot_then_load,
    }


def hub_ceiling_gbps(hub: HubTarget) -> float:
    snap = hub.snapshot()
    reader = HubReader(
        snap.repo_id, snap.commit, endpoint=hub.endpoint, token=hub.token, threads=hub.threads
    )
    objs = reader.locate(snap.files)
    return ranged_get_gbps(objs, reader.read_range, hub.threads, hf.RANGE_BYTES)


def bench_hf(
    hub: HubTarget, repeat: int, chunk_mib: int, loaders: list[str], scratch: Path
) -> dict[str, Any]:
    from safetensors.torch import load_file

    reference: Tensors = {}
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        paths = hub.fetch(Path(tmp))
        for p in paths:
            reference.update({k: v.clone() for k, v in load_file(str(p)).items()})
    return bench_remote(
        make_hf_loaders(hub, hub.threads, chunk_mib),
        loaders,
        reference,
        scratch=scratch,
        repeat=repeat,
        threads=hub.threads,
        chunk_mib=chunk_mib,
        cache="hf",
        ceiling=("hf_ranged_get_gbps", lambda: hub_ceiling_gbps(hub)),
        doc={
            "uri": f"hf://{hub.repo_id}@{hub.revision}",
            "commit": hub.snapshot().commit,
            "objects": [p.name for p in paths],
            "hf_range_bytes": hf.RANGE_BYTES,
        },
        notes=NOTES,
    )


def print_hf_table(doc: dict[str, Any]) -> None:
    print_remote_table(doc, "hf_ranged_get_gbps", "Hub GET")


def run_hf_bench(
    uri: str,
    endpoint: str | None,
    *,
    size_mb: float,
    parts: int,
    repeat: int,
    threads: int,
    chunk_mib: int,
    loaders: list[str],
    json_path: Path,
) -> dict[str, Any]:
    """Bench `uri` on `endpoint` (token: HF_TOKEN); without one, the local Hub API server
    holding a fresh demo model as that repo."""

    from weightlift.local.hubserver import HubRepo, HubServer
    from weightlift.local.models import make_demo

    u = ModelUri.parse(uri)
    repo_id, revision = hf_repo(u, "main")
    if u.scheme != "hf" or "/" not in repo_id:
        raise ValueError(f"--uri {uri!r}: expected hf://org/repo[@revision]")
    scratch = Path(os.environ.get("WL_BENCH_TMP") or tempfile.gettempdir())
    local = endpoint is None
    token = os.environ.get("HF_TOKEN") or None
    with contextlib.ExitStack() as stack:
        if endpoint is None:
            tmp = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="wl-hfbench-", dir=scratch))
            )
            make_demo(tmp / "model", size_mb, tp=1, hook=False, parts=parts)
            repo = HubRepo()
            repo.add_commit(tmp / "model", ref=revision)
            token = "hf_bench_token_0000"  # the local Hub asks for one, as a private repo does
            server = stack.enter_context(HubServer({repo_id: repo}, token=token))
            endpoint = server.endpoint
        hub = HubTarget(repo_id, revision, endpoint, token, threads)
        doc = bench_hf(hub, repeat, chunk_mib, loaders, scratch)
    return write_doc(
        doc,
        json_path=json_path,
        uri=uri,
        endpoint=None if local else endpoint,
        local_server="local Hub API server",
        args=f"--size-mb {size_mb:g} --parts {parts} --repeat {repeat} --threads {threads} "
        f"--chunk-mib {chunk_mib}",
        loaders=loaders,
        known=list(HF_LOADERS),
    )
