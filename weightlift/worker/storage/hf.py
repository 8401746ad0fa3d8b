"""hf://org/repo[@revision]: the repo's safetensors and small files, read from the Hub directly.

The revision (branch, tag or commit) is resolved to its commit once (`HfApi.model_info`) and the
file list read there (`list_repo_tree`), so a branch moving mid-download cannot mix two commits.
Each file is then located with huggingface_hub's own HEAD (`get_hf_file_metadata` on its
`resolve` URL at that commit: size, ETag, commit, CDN redirect) and read with parallel ranged
GETs written straight into the destination files' pages (`ranged.fetch_files`, shared with s3://)
instead of `snapshot_download`, which reads each file on one connection and leaves its own
metadata beside the files. The listed sha256 of an LFS file must match the Hub's ETag of it and
the listed size the served size. `HF_ENDPOINT` (or spec.model.endpoint) selects the Hub;
`HF_TOKEN` comes from the credentials Secret and is sent only to the Hub's own host (never to a
CDN it redirects to) and never written to a message. Weight formats other than safetensors
(*.bin, *.pt, ...) are skipped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from weightlift.worker.storage import ranged
from weightlift.worker.storage.errors import StorageError, redact
from weightlift.worker.storage.hfread import GATED, REPO_NOT_FOUND, HubReader

# Other weight formats the Hub carries next to safetensors: never needed here.
IGNORED = ["*.bin", "*.pt", "*.pth", "*.msgpack", "*.h5", "*.onnx", "*.ot", "*.gguf", "*.ckpt"]
RANGE_BYTES = 16 << 20  # as s3://: large enough that a GET's round trip is noise


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    sha256: str | None = None  # an LFS file's sha256 from the listing; the Hub's ETag of it


@dataclass(frozen=True)
class HubSnapshot:
    repo_id: str
    commit: str
    files: list[HubFile]


def _configure() -> None:
    """Before huggingface_hub is imported (it reads these once): a writable HF_HOME (the pod's
    root filesystem is read-only; /tmp is an emptyDir), no telemetry, no progress bars in logs."""
    os.environ.setdefault("HF_HOME", os.path.join(tempfile.gettempdir(), "huggingface"))
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _hub_errors() -> tuple[type[Exception], ...]:
    from huggingface_hub.errors import HfHubHTTPError

    return (HfHubHTTPError,)


def resolve(repo_id: str, revision: str, *, endpoint: str | None, token: str | None) -> HubSnapshot:
    """The commit `revision` names and the files to fetch there; StorageError says what is wrong."""
    _configure()
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"hf://{repo_id}@{revision}"
    api = HfApi(endpoint=endpoint, token=token or False)
    try:
        info = api.model_info(repo_id, revision=revision)
        commit = info.sha or revision
        tree = [
            f
            for f in api.list_repo_tree(repo_id, revision=commit, recursive=True)
            if hasattr(f, "size")
        ]
    except RevisionNotFoundError:
        raise StorageError(f"{where}: revision {revision!r} does not exist in {repo_id}") from None
    except GatedRepoError:
        raise StorageError(f"{where}: {GATED}") from None
    except RepositoryNotFoundError:
        raise StorageError(f"{where}: {REPO_NOT_FOUND}") from None
    except (httpx2.ConnectError, httpx2.TimeoutException) as exc:
        raise StorageError(
            f"{where}: Hub unreachable: {redact(str(exc))}", permanent=False
        ) from None
    except _hub_errors() as exc:
        raise StorageError(f"{where}: {redact(str(exc).splitlines()[0])}") from None
    from fnmatch import fnmatch

    files = [
        HubFile(f.path, int(f.size), getattr(getattr(f, "lfs", None), "sha256", None))
        for f in tree
        if not any(fnmatch(f.path, pat) for pat in IGNORED)
    ]
    if not any(f.name.endswith(".safetensors") and "/" not in f.name for f in files):
        names = ", ".join(f.name for f in files[:8]) or "no files"
        raise StorageError(f"{where}: no .safetensors files at commit {commit} ({names})")
    return HubSnapshot(repo_id, commit, files)


def fetch(
    snap: HubSnapshot,
    dest: Path,
    on_bytes: Callable[[int], None],
    *,
    endpoint: str | None,
    token: str | None,
    names: list[str] | None = None,
    threads: int = 8,
    chunk_bytes: int = RANGE_BYTES,
) -> list[Path]:
    """Download `names` (default: all of `snap.files`) at the pinned commit into `dest`."""
    _configure()
    listed = {f.name: f for f in snap.files}
    want = names if names is not None else list(listed)
    reader = HubReader(snap.repo_id, snap.commit, endpoint=endpoint, token=token, threads=threads)
    located = reader.locate([listed[n] for n in want])
    return ranged.fetch_files(
        located,
        dest,
        reader.read_range,
        on_bytes,
        threads=threads,
        chunk_bytes=chunk_bytes,
        thread_name="wl-hf",
    )
