"""`weightlift bench load --uri s3://bucket/prefix`: a source replica's cold start from S3.

Three ways from the same objects to tensors in host memory, in one run, each verified bit for
bit against safetensors' `load_file` of a reference copy:
 - weightlift-s3-preload: the worker's path: ranged GETs in parallel written straight into the
   destination files' pages (worker/storage/s3.py), then the preload loader maps those pages.
 - runai-model-streamer-s3: runai's own S3 backend (C++ AWS SDK) streaming into its buffers.
 - boto3-download-then-load: boto3's `download_file` (its threaded multipart transfer) to local
   files, then safetensors `load_file`.
Timed: listing + transfer + load + reading one byte per page of the result. The store's own
limit is measured in the same run: the same ranged GETs into anonymous memory (no files, no
tensors). Without --endpoint a MinIO on loopback is started and the demo model uploaded to it;
MinIO then shares the machine's cores with the clients, so the ratios are what this box can show.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightlift.api.uri import ModelUri
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
from weightlift.worker.storage.s3 import S3Store
from weightlift.worker.weights.files import index_files
from weightlift.worker.weights.progress import LoadProgress

S3Loader = RemoteLoader
S3_LOADERS = ("weightlift-s3-preload", "runai-model-streamer-s3", "boto3-download-then-load")

NOTES = [
    "weightlift-s3-preload: list, then ranged GETs (16 MiB each, `threads` in flight, "
    "If-Match on the ETag), each piece pwritten at its offset into the destination files; "
    "preload maps those page-cache pages (no read back).",
    "runai-model-streamer-s3: SafetensorsStreamer.stream_files on the s3:// URIs (its C++ S3 "
    "client; RUNAI_STREAMER_CONCURRENCY = threads).",
    "boto3-download-then-load: s3.download_file per object (boto3 TransferConfig "
    "max_concurrency = threads) into files, then safetensors load_file.",
    "s3_ranged_get_gbps: the same ranged GETs into anonymous memory: what the store and the "
    "HTTP stack deliver here, the ceiling for every contender.",
    "CPU s: this process's CPU time over all its threads (MinIO's own not included).",
]


def _safetensors(store: S3Store) -> list[Any]:
    return [o for o in store.list_objects() if o.name.endswith(".safetensors")]


def make_s3_loaders(store: S3Store, threads: int, chunk_mib: int) -> dict[str, S3Loader]:
    cpu = torch.device("cpu")

    def weightlift(tmp: Path) -> tuple[Tensors, Callable[[], None]]:
        objs = _safetensors(store)
        paths = store.fetch(objs, tmp, ignore)
        tensors = PreloadLoader().load_index(
            index_files(paths), cpu, LoadProgress(), threads=threads, chunk_bytes=chunk_mib << 20
        )
        return tensors, noop

    def runai(tmp: Path) -> tuple[Tensors, Callable[[], None]]:
        from runai_model_streamer import SafetensorsStreamer

        uris = [f"s3://{store.bucket}/{o.key}" for o in _safetensors(store)]
        out: Tensors = {}
        streamer = SafetensorsStreamer()
        streamer.__enter__()
        streamer.stream_files(uris)
        for name, t in streamer.get_tensors():
            out[name] = t
        return out, lambda: streamer.__exit__(None, None, None)

    def boto3_then_load(tmp: Path) -> tuple[Tensors, Callable[[], None]]:
        from boto3.s3.transfer import TransferConfig
        from safetensors.torch import load_file

        cfg = TransferConfig(max_concurrency=threads)  # boto3's own part size
        out: Tensors = {}
        for o in _safetensors(store):
            path = tmp / o.name
            store.client.download_file(store.bucket, o.key, str(path), Config=cfg)
            out.update(load_file(str(path)))
        return out, noop

    return {
        "weightlift-s3-preload": weightlift,
        "runai-model-streamer-s3": runai,
        "boto3-download-then-load": boto3_then_load,
    }


def bench_s3(
    store: S3Store, repeat: int, threads: int, chunk_mib: int, loaders: list[str], scratch: Path
) -> dict[str, Any]:
    from safetensors.torch import load_file

    objs = _safetensors(store)
    reference: Tensors = {}
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        for p in store.fetch(objs, Path(tmp), ignore):
            reference.update({k: v.clone() for k, v in load_file(str(p)).items()})
    return bench_remote(
        make_s3_loaders(store, threads, chunk_mib),
        loaders,
        reference,
        scratch=scratch,
        repeat=repeat,
        threads=threads,
        chunk_mib=chunk_mib,
        cache="s3",
        ceiling=(
            "s3_ranged_get_gbps",
            lambda: ranged_get_gbps(objs, store.read_range, store.threads, store.chunk_bytes),
        ),
        doc={
            "uri": f"s3://{store.bucket}/{store.prefix}",
            "objects": [o.key for o in objs],
            "s3_range_bytes": store.chunk_bytes,
        },
        notes=NOTES,
    )


def print_s3_table(doc: dict[str, Any]) -> None:
    print_remote_table(doc, "s3_ranged_get_gbps", "S3 GET")


def store_for(uri: str, endpoint: str | None, region: str | None, threads: int) -> S3Store:
    """The store as the worker opens it: its range size (S3Store's default), `threads` GETs."""
    u = ModelUri.parse(uri)
    return S3Store(u.claim, u.path, endpoint=endpoint, region=region, threads=threads)


def run_s3_bench(
    uri: str,
    endpoint: str | None,
    region: str | None,
    *,
    size_mb: float,
    parts: int,
    repeat: int,
    threads: int,
    chunk_mib: int,
    loaders: list[str],
    json_path: Path,
) -> dict[str, Any]:
    """Bench `uri` on `endpoint`; without one, MinIO on loopback holding a fresh demo model."""

    from weightlift.local.models import make_demo
    from weightlift.local.s3server import MinioServer

    u = ModelUri.parse(uri)
    if u.scheme != "s3" or not u.claim:
        raise ValueError(f"--uri {uri!r}: expected s3://bucket/prefix")
    scratch = Path(os.environ.get("WL_BENCH_TMP") or tempfile.gettempdir())
    local = endpoint is None
    with contextlib.ExitStack() as stack:
        if endpoint is None:
            tmp = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="wl-s3bench-", dir=scratch))
            )
            server = stack.enter_context(MinioServer(tmp / "minio"))
            make_demo(tmp / "model", size_mb, tp=1, hook=False, parts=parts)
            server.upload_dir(tmp / "model", u.claim, u.path)
            endpoint = server.endpoint
            os.environ["AWS_ACCESS_KEY_ID"] = server.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = server.secret_key
        # runai's C++ client reads its settings from the environment only.
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        os.environ.setdefault("AWS_REGION", region or "us-east-1")
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        os.environ["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
        os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(threads)
        store = store_for(uri, endpoint, region, threads)
        doc = bench_s3(store, repeat, threads, chunk_mib, loaders, scratch)
    return write_doc(
        doc,
        json_path=json_path,
        uri=uri,
        endpoint=None if local else endpoint,
        local_server="MinIO on loopback",
        args=f"--size-mb {size_mb:g} --parts {parts} --repeat {repeat} --threads {threads} "
        f"--chunk-mib {chunk_mib}",
        loaders=loaders,
        known=list(S3_LOADERS),
    )
