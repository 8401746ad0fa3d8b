"""hf://org/repo[@revision]: the repo's safetensors and small files, through huggingface_hub.

The revision (branch, tag or commit) is resolved to its commit once (`model_info`), and every
file is then downloaded at that commit, so a branch moving mid-download cannot mix two commits.
`HF_ENDPOINT` (or spec.model.endpoint) selects the Hub; `HF_TOKEN` comes from the credentials
Secret. Weight formats other than safetensors (*.bin, *.pt, ...) are skipped.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from weightlift.worker.storage.errors import StorageError, redact

# Other weight formats the Hub carries next to safetensors: never needed here.
IGNORED = ["*.bin", "*.pt", "*.pth", "*.msgpack", "*.h5", "*.onnx", "*.ot", "*.gguf", "*.ckpt"]
_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int


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
        raise StorageError(f"{where}: repository is gated; the token has no access") from None
    except RepositoryNotFoundError:
        raise StorageError(
            f"{where}: repository not found, or private and the token (credentials Secret "
            "HF_TOKEN) is missing or not allowed"
        ) from None
    except (httpx2.ConnectError, httpx2.TimeoutException) as exc:
        raise StorageError(
            f"{where}: Hub unreachable: {redact(str(exc))}", permanent=False
        ) from None
    except _hub_errors() as exc:
        raise StorageError(f"{where}: {redact(str(exc).splitlines()[0])}") from None
    from fnmatch import fnmatch

    files = [
        HubFile(f.path, int(f.size))
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
) -> list[Path]:
    """Download `names` (default: all of `snap.files`) at the pinned commit into `dest`."""
    from huggingface_hub import snapshot_download

    want = names if names is not None else [f.name for f in snap.files]
    dest.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    watcher = threading.Thread(
        target=_watch_bytes, args=(dest, on_bytes, stop), name="wl-hf-progress", daemon=True
    )
    watcher.start()
    try:
        snapshot_download(
            snap.repo_id,
            revision=snap.commit,
            local_dir=dest,
            allow_patterns=want,
            endpoint=endpoint,
            token=token or False,
            max_workers=threads,
        )
    except _hub_errors() as exc:
        first = redact(str(exc).splitlines()[0])
        raise StorageError(f"hf://{snap.repo_id}@{snap.commit}: download failed: {first}") from None
    finally:
        stop.set()
        watcher.join()
    missing = [n for n in want if not (dest / n).is_file()]
    if missing:
        raise StorageError(
            f"hf://{snap.repo_id}@{snap.commit}: files missing after download: {missing}"
        )
    sizes = {f.name: f.size for f in snap.files}
    for n in want:
        got = (dest / n).stat().st_size
        if got != sizes[n]:
            raise StorageError(
                f"hf://{snap.repo_id}@{snap.commit}/{n}: {got} bytes, the Hub lists {sizes[n]}"
            )
    return [dest / n for n in want]


def _tree_bytes(dest: Path) -> int:
    total = 0
    for p in dest.rglob("*"):
        # the files themselves, and huggingface_hub's .cache/**/*.incomplete while they grow
        counted = p.suffix == ".incomplete" or ".cache" not in p.relative_to(dest).parts
        try:
            if counted and p.is_file():
                total += p.stat().st_size
        except OSError:  # renamed from .incomplete to its final name meanwhile
            continue
    return total


def _watch_bytes(dest: Path, on_bytes: Callable[[int], None], stop: threading.Event) -> None:
    """Report bytes as the download grows files under `dest` (its .incomplete files included):
    huggingface_hub has no per-byte callback, but the files it writes are the truth."""
    seen = _tree_bytes(dest)
    while True:
        done = stop.wait(_POLL_SECONDS)
        now = _tree_bytes(dest)
        if now > seen:
            on_bytes(now - seen)
            seen = now
        if done:
            return
