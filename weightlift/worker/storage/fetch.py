"""The one entry: resolve a remote model URI (s3://, hf://) to a local model directory.

`materialize` downloads into the plan's model_dir (the pod's scratch volume), or, when
`spec.loading.cache.enabled`, into the node-local cache entry of the model identity, reusing a
verified entry if one is there. Downloads write straight into the files' pages (s3) so the
preload loader that follows maps the same pages. Progress counts from the first byte.

A target (weights=False) fetches only the small files (model.pt2, config, tokenizer) and pulls
its weights from a peer; on a peer failure the worker calls again with weights=True. A pod of a
multi-pod replica fetches only its own ranks' weight files, into a cache entry of its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from weightlift.api.uri import REMOTE_SCHEMES, ModelUri, hf_repo
from weightlift.api.worker import WorkerPlan
from weightlift.worker.storage.cache import CacheMismatch, NodeCache
from weightlift.worker.storage.errors import StorageError
from weightlift.worker.weights.files import is_rank_file
from weightlift.worker.weights.header import SafetensorsFormatError, parse_header
from weightlift.worker.weights.progress import LoadProgress

log = logging.getLogger("weightlift.worker.storage")

_HEADER_PROBE = 1 << 20


@dataclass
class Fetched:
    model_dir: str
    loaded_from: str  # storage:s3, storage:hf or cache
    warnings: list[str] = field(default_factory=list)


def is_remote(plan: WorkerPlan) -> bool:
    return ModelUri.parse(plan.model.uri).scheme in REMOTE_SCHEMES


def _is_weights(name: str) -> bool:
    return name.endswith(".safetensors")


def _wanted(plan: WorkerPlan, weights: bool) -> Callable[[str], bool]:
    """Which files to fetch: the small ones always; weights when asked, and for a pod of a
    multi-pod replica only its own ranks' (presharded: rank-{r}-of-{tp}*.safetensors)."""
    group = (plan.pods_per_replica or 1) > 1

    def wanted(name: str) -> bool:
        if not _is_weights(name):
            return True
        if not weights:
            return False
        return not group or is_rank_file(name, plan.ranks, plan.tensor_parallel)

    return wanted


def cache_key(plan: WorkerPlan) -> str:
    """The node cache entry: the model identity's; a group pod's own ranks' files apart."""
    if (plan.pods_per_replica or 1) > 1:
        return f"{plan.model_identity}.ranks-{'-'.join(str(r) for r in plan.ranks)}"
    return plan.model_identity


def _check_safetensors(paths: list[Path], dest: Path, where: Callable[[str], str]) -> None:
    """A truncated or corrupt object fails here, named by its URI, not later by a local path."""
    for p in paths:
        if not _is_weights(p.name):
            continue
        rel = p.relative_to(dest).as_posix()
        size = p.stat().st_size
        with p.open("rb") as f:
            prefix = f.read(_HEADER_PROBE)
        n = int.from_bytes(prefix[:8], "little") if len(prefix) >= 8 else 0
        if 8 + n > len(prefix) and 8 + n <= size:
            with p.open("rb") as f:
                prefix = f.read(8 + n)
        try:  # tensors whose offsets run past the end of a short object fail here
            parse_header(prefix, size, where(rel))
        except SafetensorsFormatError as exc:
            raise StorageError(str(exc)) from None


def _download(plan: WorkerPlan, dest: Path, progress: LoadProgress, weights: bool) -> list[Path]:
    uri = ModelUri.parse(plan.model.uri)
    # GETs in flight: at least 8 whatever the preload's thread count (a GET waits on the
    # network, not on a core).
    gets = max(plan.loading.preload.threads or 8, 8)
    if uri.scheme == "s3":
        from weightlift.worker.storage.s3 import S3Store

        store = S3Store(
            uri.claim,
            uri.path,
            endpoint=plan.model.endpoint,
            region=plan.model.region,
            threads=gets,
        )
        objects = store.list_objects()
        if not any(_is_weights(o.name) and "/" not in o.name for o in objects):
            names = ", ".join(o.name for o in objects[:8]) or "nothing"
            raise StorageError(
                f"{store.uri()}/: no .safetensors objects under the prefix (found {names})"
            )
        want = _wanted(plan, weights)
        chosen = [o for o in objects if want(o.name)]
        progress.set_total(sum(o.size for o in chosen))
        paths = store.fetch(chosen, dest, progress.add)
        _check_safetensors(paths, dest, lambda rel: store.uri(f"{store.prefix}/{rel}".lstrip("/")))
        return paths
    from weightlift.worker.storage import hf

    repo_id, revision = hf_repo(uri, plan.model.revision)
    endpoint = plan.model.endpoint or os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    snap = hf.resolve(repo_id, revision, endpoint=endpoint, token=token)
    want = _wanted(plan, weights)
    wanted = [f.name for f in snap.files if want(f.name)]
    progress.set_total(sum(f.size for f in snap.files if f.name in wanted))
    paths = hf.fetch(
        snap,
        dest,
        progress.add,
        endpoint=endpoint,
        token=token,
        names=wanted,
        threads=gets,
    )
    _check_safetensors(paths, dest, lambda rel: f"hf://{repo_id}@{snap.commit}/{rel}")
    return paths


def materialize(plan: WorkerPlan, progress: LoadProgress, *, weights: bool = True) -> Fetched:
    """Put the model's files in a local directory; StorageError names the object on failure."""
    scheme = ModelUri.parse(plan.model.uri).scheme
    fetched_from = f"storage:{scheme}"
    cache = plan.loading.cache
    if not (cache.enabled and weights):
        _download(plan, Path(plan.model_dir), progress, weights)
        return Fetched(plan.model_dir, fetched_from)
    node_cache = NodeCache(cache.path, cache.max_size_gib << 30)
    warnings: list[str] = []
    key = cache_key(plan)
    with node_cache.locked(key) as entry:
        if entry.complete():
            try:
                entry.verify()
                total = entry.size()
                progress.set_total(total)
                progress.add(total)
                return Fetched(str(entry.files), "cache")
            except CacheMismatch as exc:
                msg = f"{exc}; dropped the entry, downloading again"
                log.warning("%s", msg)
                warnings.append(msg)
                entry.drop()
        entry.drop()  # leftovers of a download that died half-way
        _download(plan, entry.partial, progress, weights)
        entry.commit(plan.model.uri)
    node_cache.evict(keep=key)
    return Fetched(str(entry.files), fetched_from, warnings)
