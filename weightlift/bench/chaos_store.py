"""Chaos scenarios for vLLM's compile-cache stores (worker/engines/vllm/compile_store*.py): an
entry that is damaged (a flipped byte, moved under another key, its archive or its manifest
gone) and a store that cannot be written (mounted read-only, a full tmpfs, the cluster store on
S3 with a Secret whose secret key MinIO refuses).

The store is vLLM's only: each scenario deploys one compiled vLLM replica of the tiny Llama
(chaos_models.Models.llm) whose node store is the stack's own directory (LocalStack.compile_store,
a hostPath at the same path on the process node). The first store scenario of a run seeds it
once: a replica compiles from an empty store and puts its entry; the entry is kept as a pristine
copy, and every scenario starts from that copy (or from an empty store), damaged or mounted over.
Each must converge with its replica Ready anyway: a damaged entry is a `miss (<reason>)` that
names the damage, vLLM compiles (its log: a program saved, none loaded: nothing unverified was
installed) and a good entry is stored again; a store that cannot be written costs nothing but
its write, which the worker only logs (a warning, no status field or event: the check reads the
worker's log). Every one answers transformers' greedy text (here and in the runner's watch).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from weightlift.api.worker import COMPILE_STORE_S3_ENDPOINT_ENV, COMPILE_STORE_URI_ENV
from weightlift.bench.chaos_models import flip_a_byte
from weightlift.bench.chaos_run import Run, ScenarioSkipped, answers_right, pod_ports
from weightlift.local.kube import KUBE_ERRORS, call
from weightlift.local.observe import pod_vllm_dirs, pod_vllm_log
from weightlift.local.s3server import MinioServer
from weightlift.local.stack import VLLM_ENV, vllm_engine_args
from weightlift.operator.settings import COMPILE_STORE_SECRET_ENV
from weightlift.worker.engines.vllm.compile_cache import (
    CacheManifest,
    CacheRejected,
    engine_init_seconds,
    read_compiles,
    verify_archive,
)
from weightlift.worker.engines.vllm.compile_store import ARCHIVE, MANIFEST

JSON = dict[str, Any]
# A compiled vLLM replica's start: about 60-90 s on an idle 2-core box, minutes on a busy one.
READY_TIMEOUT = 900.0
# How long after Ready the replica's store write may take (it writes right after Ready).
STORED_TIMEOUT = 120.0
# The cluster store of store-s3-credentials-refused: MinIO on loopback, a Secret with the right
# access key and a wrong secret key (which must never show in a log or the status).
BUCKET, PREFIX = "chaos-compile-store", "cc"
SECRET = "chaos-compile-store-s3"
WRONG_SECRET_KEY = "chaos-not-the-secret-key-4c1d"
# The worker's lines (worker/engines/vllm/compile_cache.py) when it installs a cache, and when a
# store write fails or succeeds.
INSTALLED = " installed: "
NOT_STORED = "compile cache not stored in "
STORED = "compile cache stored in "


# ------------------------------------------------------------------------------- the seed


@dataclass(frozen=True)
class Seed:
    """The store's one good entry, as the seed replica stored it."""

    pristine: Path  # a copy of the store holding only that entry
    entry: str  # "<want>/<vllm hash>"
    model: Path
    probe: JSON


_SEEDS: dict[str, Seed] = {}  # by store directory: seeded once per chaos run


def seeded(run: Run) -> Seed:
    """The seed of this run's store (made by the first store scenario: a replica compiles from
    an empty store and puts its entry, then is deleted); the watch probes with its probe."""
    store = _store(run)
    _unmount(store)  # an earlier run's mount left behind
    seed = _SEEDS.get(str(store))
    if seed is None:
        model, probe = run.models.llm()
        if run.watch is not None:
            run.watch.probe = probe
        seed = _SEEDS[str(store)] = _seed(run, store, model, probe)
    if run.watch is not None:
        run.watch.probe = seed.probe
    run.notes["seed"] = seed
    return seed


def _seed_of(run: Run) -> Seed:
    """The seed the scenario's inject used (for its verify)."""
    seed: Seed = run.notes["seed"]
    return seed


def _seed(run: Run, store: Path, model: Path, probe: JSON) -> Seed:
    _empty(store)
    since = time.time()
    _deploy(run, model, probe)
    run.wait("the seed replica Ready", lambda: run.converged(1), timeout=READY_TIMEOUT)
    (row,) = run.replicas()
    cc = str(row.get("compileCache"))
    assert cc.startswith("miss (no compile cache for this build"), f"seed: compileCache {cc!r}"
    run.wait(
        "the seed replica's store entry",
        lambda: bool(store_entries(store, since)),
        timeout=STORED_TIMEOUT,
    )
    (entry,) = store_entries(store, since)
    _gone(run)
    assert run.stack.get_md(run.name) is None, "the seed deployment is still there"
    pristine = run.models.work / "compile-store-pristine"
    shutil.rmtree(pristine, ignore_errors=True)
    shutil.copytree(store, pristine)
    return Seed(pristine, entry, model, probe)


def _store(run: Run) -> Path:
    return Path(run.stack.compile_store)


def _empty(store: Path) -> None:
    """Remove what the store holds (not the directory: it may be a mount point)."""
    store.mkdir(parents=True, exist_ok=True)
    for child in store.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _restore(run: Run, seed: Seed, entry: bool = True) -> Path:
    """The store as the seed left it (or empty)."""
    store = _store(run)
    _empty(store)
    if entry:
        shutil.copytree(seed.pristine, store, dirs_exist_ok=True)
    return store


def store_entries(store: Path, since: float = 0.0) -> list[str]:
    """Whole entries ("<want>/<vllm hash>": archive and manifest) written since `since`."""
    return sorted(
        f"{d.parent.name}/{d.name}"
        for d in store.glob("*/*")
        if (d / MANIFEST).is_file()
        and (d / ARCHIVE).is_file()
        and (d / ARCHIVE).stat().st_mtime >= since
    )


def _deploy(run: Run, model: Path, probe: JSON) -> None:
    """One compiled vLLM replica. Its worker keeps vLLM's files (its log, its cache root) in a
    new temp folder of its own (observe.pod_vllm_dirs): no earlier replica's compiled program
    can be found there."""
    run.deploy(
        model,
        replicas=1,
        probe=probe,
        engine="vLLM",
        engine_args=vllm_engine_args(eager=False),
        env=VLLM_ENV,
        hook_library=None,
    )


def _strike(run: Run, seed: Seed) -> None:
    """The fault is in place: deploy the replica that must meet it (deleted, with its vLLM
    folders, when the scenario ends: the first of its clean-ups)."""
    run.notes["struck"] = time.time()
    run.fault_at = time.monotonic()
    run.cleanups.insert(0, lambda: _gone(run))
    _deploy(run, seed.model, seed.probe)


def _gone(run: Run) -> None:
    """Delete the deployment and wait until its pods are gone, then its vLLM folders (the
    runner still counts what is left: it looks again)."""
    pods: set[str] = set()
    with contextlib.suppress(*KUBE_ERRORS):
        pods = {p["metadata"]["name"] for p in run.stack.pods(run.name)}
        if run.stack.get_md(run.name) is not None:
            run.stack.delete_md(run.name)
    with contextlib.suppress(TimeoutError, *KUBE_ERRORS):
        run.wait("the deployment gone", lambda: run.converged(0), timeout=120.0)
        for folder in [d for pod in pods for d in pod_vllm_dirs(pod)]:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------- a damaged entry


@dataclass(frozen=True)
class Damage:
    """A store entry damaged in place; what the replica's `miss (...)` must name."""

    name: str
    apply: Callable[[Path, str], None]  # (the store, "<want>/<vllm hash>")
    names: tuple[str, ...]  # each in the compileCache reason (the last the table shows)
    dropped: bool  # refused and removed from the store (else unreadable, replaced by the put)


def other_hash(vllm_hash: str) -> str:
    """Another hash, differing in its first digit: messages show the first 12."""
    return ("1" if vllm_hash.startswith("0") else "0") + vllm_hash[1:]


def _flip(store: Path, entry: str) -> None:
    flip_a_byte(store / entry / ARCHIVE)


def _moved(store: Path, entry: str) -> None:
    """Moved under another vLLM hash of the same build: the place names one key, the manifest
    another (a mis-keyed entry)."""
    where = store / entry
    os.replace(where, where.with_name(other_hash(where.name)))


def _without(name: str) -> Callable[[Path, str], None]:
    def damage(store: Path, entry: str) -> None:
        (store / entry / name).unlink()

    return damage


DAMAGES = (
    Damage(
        "store-entry-flipped-byte",
        _flip,
        ("store entry refused: compile-cache file ", "sha256 differs from the manifest"),
        dropped=True,
    ),
    Damage(
        "store-entry-wrong-key",
        _moved,
        (" in the manifest, ", "store entry refused: mis-keyed entry"),
        dropped=True,
    ),
    Damage("store-entry-no-archive", _without(ARCHIVE), ("unreadable", ARCHIVE), dropped=False),
    Damage("store-entry-no-manifest", _without(MANIFEST), ("unreadable", MANIFEST), dropped=False),
)


def damaged(damage: Damage) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        seed = seeded(run)
        damage.apply(_restore(run, seed), seed.entry)
        _strike(run, seed)

    return inject


def verify_damaged(damage: Damage) -> Callable[[Run], str]:
    """Ready, a miss naming the damage, vLLM compiled (nothing installed), the right text, and a
    good entry in the store again: the damaged one dropped or replaced, nothing else left."""

    def verify(run: Run) -> str:
        seed = _seed_of(run)
        row, worker_log, vllm_log = _replica(run)
        cc = str(row.get("compileCache"))
        missing = [n for n in damage.names if n not in cc]
        assert cc.startswith("miss (") and not missing, f"compileCache {cc!r} lacks {missing}"
        init = _compiled(worker_log, vllm_log)
        _answers(run, row, seed)
        _good_entry_again(run, seed)
        return (
            f"miss naming {damage.names[-1].strip()!r}, compiled (init {init}), a good entry "
            f"stored again, greedy text right [{cc}]"
        )

    return verify


# --------------------------------------------------------------------- what every one checks


def _replica(run: Run) -> tuple[JSON, str, str]:
    """The Ready replica's row, its worker's log and its vLLM's log."""
    (row,) = [r for r in run.replicas() if r.get("ready")]
    vllm_log = pod_vllm_log(row["name"], run.notes["struck"])
    return row, run.pod_log(row["name"]), vllm_log


def _compiled(worker_log: str, vllm_log: str) -> str:
    """vLLM compiled and saved its program and loaded none; the worker installed nothing. Its
    init seconds (where the compile goes)."""
    compiles = read_compiles(vllm_log)
    actions = {rank: c.action for rank, c in compiles.items()}
    assert actions == {0: "saved"}, f"vLLM's program: {actions} (a compile was due)"
    assert not compiles[0].reason, f"vLLM failed to load a program: {compiles[0].reason}"
    assert INSTALLED not in worker_log, _line(worker_log, INSTALLED)
    init = engine_init_seconds(vllm_log)
    return f"{init:.0f} s" if init is not None else "?"


def _loaded(worker_log: str, vllm_log: str) -> None:
    """vLLM loaded the program the worker installed from the node store; compiled none."""
    actions = {rank: c.action for rank, c in read_compiles(vllm_log).items()}
    assert actions == {0: "loaded"}, f"vLLM's program: {actions} (a store hit was due)"
    assert "from the node store installed" in worker_log, "no install from the node store logged"


def _answers(run: Run, row: JSON, seed: Seed) -> None:
    """The replica's greedy text is transformers' (local/llm.py): the right weights."""
    port = pod_ports(run.stack.kube, run.stack.namespace, run.name)[row["name"]]
    with httpx.Client() as http:
        right = answers_right(http, f"http://{row['podIP']}:{port}", run.name, seed.probe)
    assert right, f"{row['name']} answered other than transformers' greedy text"


def _good_entry_again(run: Run, seed: Seed) -> None:
    """The store holds the seed's key again, written since the fault and passing the verifier
    file by file; no other entry (the damaged one dropped or replaced) and no half write."""
    store = _store(run)
    since = run.notes["struck"]
    run.wait(
        "a good entry stored again",
        lambda: store_entries(store, since) == [seed.entry],
        timeout=STORED_TIMEOUT,
    )
    entry = store / seed.entry
    manifest = CacheManifest.from_wire(json.loads((entry / MANIFEST).read_text()))
    with tempfile.TemporaryDirectory(dir=run.models.work) as staging:
        try:
            verify_archive(entry / ARCHIVE, manifest, Path(staging))
        except CacheRejected as exc:
            raise AssertionError(f"the entry stored again fails the verifier: {exc}") from exc
    left = sorted(str(p.relative_to(store)) for p in store.glob("*/*"))
    assert left == [seed.entry], f"the store holds {left}"


def _why(line: str) -> str:
    """What a store-write warning says went wrong (an errno's words, S3's code), for the table."""
    found = re.search(r"\[Errno \d+\] [^:']+|S3 \w+: [^(]*\(HTTP \d+\)", line)
    return found.group(0).strip() if found else line[-60:]


def _line(log: str, needle: str) -> str:
    """The log's first line with `needle` (for a message), or ""."""
    return next((line for line in log.splitlines() if needle in line), "")


def _logged(run: Run, row: JSON, needle: str) -> str:
    """Wait for the worker's log line with `needle` (the store write follows Ready)."""
    run.wait(
        f"{needle!r} in the worker's log",
        lambda: bool(_line(run.pod_log(row["name"]), needle)),
        timeout=STORED_TIMEOUT,
    )
    return _line(run.pod_log(row["name"]), needle)


# ------------------------------------------------------------------ a store that cannot be written


def _mount(run: Run, store: Path, *args: str) -> None:
    """`mount ARGS STORE`, undone when the scenario ends; ScenarioSkipped where this process
    may not mount (not root, or no CAP_SYS_ADMIN in its container)."""
    if os.geteuid() != 0:
        raise ScenarioSkipped(f"mounting over the store needs root (euid {os.geteuid()})")
    done = subprocess.run(
        ["mount", *args, str(store)], capture_output=True, text=True, check=False, timeout=30
    )
    if done.returncode != 0:
        raise ScenarioSkipped(f"mount {' '.join(args)}: {done.stderr.strip()}")
    run.cleanups.append(lambda: _unmount(store))


def mounted(path: Path) -> bool:
    """A mount point (os.path.ismount misses a bind mount within one filesystem)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return os.path.ismount(path)
    return any(line.split()[4] == str(path) for line in lines if len(line.split()) > 4)


def _unmount(store: Path) -> None:
    for lazy in ([], ["-l"], ["-l"]):  # a busy mount point: detached now, gone when unused
        if not mounted(store):
            return
        subprocess.run(["umount", *lazy, str(store)], capture_output=True, check=False, timeout=30)


def _write_refused(store: Path) -> int:
    """The errno a write into the store fails with; AssertionError when it succeeds (root
    ignores mode bits: only a read-only mount or a full filesystem really refuses)."""
    probe = store / ".chaos-write-probe"
    try:
        probe.write_bytes(b"x" * 4096)
    except OSError as exc:
        with contextlib.suppress(OSError):  # created empty on a full filesystem
            probe.unlink()
        return int(exc.errno or 0)
    probe.unlink()
    raise AssertionError(f"{store} took a write: the fault is not in place")


def read_only(run: Run) -> None:
    """The store holds the seed's entry, bind-mounted read-only: a replica reads and installs
    it (a hit), and its write after Ready (the same key, replaced) is refused."""
    seed = seeded(run)
    _empty(_store(run))
    source = run.models.work / "read-only-store"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(seed.pristine, source)
    store = _store(run)
    _mount(run, store, "--bind", str(source))
    _mount(run, store, "-o", "remount,bind,ro")
    refused = _write_refused(store)
    assert refused == errno.EROFS, f"a write into the store failed with errno {refused}"
    run.notes["tree"] = _tree(store)
    _strike(run, seed)


def _tree(store: Path) -> dict[str, str]:
    """Every file under the store and its sha256."""
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file()
    }


def verify_read_only(run: Run) -> str:
    seed = _seed_of(run)
    row, worker_log, vllm_log = _replica(run)
    cc = str(row.get("compileCache"))
    assert cc == "hit (store)", f"compileCache {cc!r}"
    _loaded(worker_log, vllm_log)
    line = _logged(run, row, NOT_STORED)
    assert "Read-only file system" in line, line
    store = _store(run)
    assert _write_refused(store) == errno.EROFS, "the store is writable again"
    assert _tree(store) == run.notes["tree"], "the read-only store changed"
    _answers(run, row, seed)
    return f"hit (store) from a read-only store; write refused, logged: {_why(line)}"


def full(run: Run) -> None:
    """A 1 MiB tmpfs mounted as the store, filled: no entry to read, and the replica's write
    after Ready (it compiled) runs out of space."""
    seed = seeded(run)
    store = _store(run)
    _empty(store)
    _mount(run, store, "-t", "tmpfs", "-o", "size=1m,mode=0755", "chaos-store-full")
    with (store / "filler").open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(64 << 10))
    refused = _write_refused(store)
    assert refused == errno.ENOSPC, f"a write into the store failed with errno {refused}"
    run.notes["tree"] = _tree(store)
    _strike(run, seed)


def verify_full(run: Run) -> str:
    seed = _seed_of(run)
    row, worker_log, vllm_log = _replica(run)
    cc = str(row.get("compileCache"))
    assert cc.startswith("miss (no compile cache for this build in the node store"), cc
    init = _compiled(worker_log, vllm_log)
    line = _logged(run, row, NOT_STORED)
    assert "No space left on device" in line, line
    store = _store(run)
    assert not store_entries(store), f"an entry in the full store: {store_entries(store)}"
    half = [str(p) for p in store.glob("*/.tmp-*")]
    assert not half, f"a half-written entry left in the store: {half}"
    assert _tree(store) == run.notes["tree"], "the full store's files changed"
    _answers(run, row, seed)
    return f"miss, compiled (init {init}); write refused, logged: {_why(line)}"


# --------------------------------------------------------------- the cluster store refuses


def s3_refused(run: Run) -> None:
    """The cluster store on S3 (MinIO on loopback) signed with a Secret whose secret key is
    wrong; the node store empty: the replica's read of the cluster store and its write after
    Ready are both refused (HTTP 403), and it compiles."""
    seed = seeded(run)
    _restore(run, seed, entry=False)
    data = run.models.work / "minio"
    shutil.rmtree(data, ignore_errors=True)
    s3 = MinioServer(data, log_file=run.models.work / "minio.log")
    s3.start()
    run.cleanups.insert(0, s3.stop)  # the last to go
    s3.make_bucket(BUCKET)
    run.notes["s3"] = s3
    stack = run.stack
    _delete_secret(run)  # an earlier run's
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": stack.namespace},
        "stringData": {
            "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": WRONG_SECRET_KEY,
        },
    }
    call(stack.kube.core.create_namespaced_secret, stack.namespace, secret)
    run.cleanups.insert(0, lambda: _delete_secret(run))
    _operator_with(
        run,
        {
            COMPILE_STORE_URI_ENV: f"s3://{BUCKET}/{PREFIX}",
            COMPILE_STORE_S3_ENDPOINT_ENV: s3.endpoint,
            COMPILE_STORE_SECRET_ENV: SECRET,
        },
    )
    _strike(run, seed)


def _delete_secret(run: Run) -> None:
    with contextlib.suppress(*KUBE_ERRORS):
        call(run.stack.kube.core.delete_namespaced_secret, SECRET, run.stack.namespace)


def _operator_with(run: Run, env: dict[str, str]) -> None:
    """The operator restarted with `env` (its settings are its environment), and again without
    it when the scenario ends, after the deployment is gone (its pods carry the env)."""
    stack = run.stack
    before = dict(stack.operator_env)
    stack.operator_env.update(env)
    stack.restart_operator()

    def restore() -> None:
        _gone(run)
        stack.operator_env.clear()
        stack.operator_env.update(before)
        stack.restart_operator()

    run.cleanups.insert(0, restore)  # the first to run


def verify_s3_refused(run: Run) -> str:
    seed = _seed_of(run)
    row, worker_log, vllm_log = _replica(run)
    cc = str(row.get("compileCache"))
    read = f"the cluster store s3://{BUCKET}/{PREFIX} unreadable: S3 list: "
    assert cc.startswith("miss (") and read in cc and "(HTTP 403)" in cc, f"compileCache {cc!r}"
    init = _compiled(worker_log, vllm_log)
    line = _logged(run, row, f"{NOT_STORED}the cluster store")
    assert "S3 put: " in line and "(HTTP 403)" in line, line
    assert _line(run.pod_log(row["name"]), f"{STORED}the node store"), "the node store not written"
    s3: MinioServer = run.notes["s3"]
    objects = s3.client().list_objects_v2(Bucket=BUCKET).get("Contents", [])
    assert not objects, f"objects in the bucket: {[o['Key'] for o in objects]}"
    texts = {
        "the worker's log": run.pod_log(row["name"]),
        "vLLM's log": vllm_log,
        "the operator's log": run.stack.operator_log().read_text(errors="replace"),
        "the status": json.dumps(run.stack.get_md(run.name)),
    }
    leaked = [name for name, text in texts.items() if WRONG_SECRET_KEY in text]
    assert not leaked, f"the secret key shows in {leaked}"
    _answers(run, row, seed)
    return f"read and write refused (HTTP 403), compiled (init {init}); bucket empty; no key shown"


# ------------------------------------------------------------------------------ the list

STORE_SCENARIOS: tuple[tuple[str, Callable[[Run], None], Callable[[Run], str]], ...] = (
    *((d.name, damaged(d), verify_damaged(d)) for d in DAMAGES),
    ("store-read-only", read_only, verify_read_only),
    ("store-full", full, verify_full),
    ("store-s3-credentials-refused", s3_refused, verify_s3_refused),
)
