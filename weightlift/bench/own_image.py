"""`bench vllm`'s `own image` row: a vLLM replica whose environment holds no weightlift, joined
as a pod with spec.template.worker Injected joins it (operator/inject.py), timed against the
`preload` row of the same run.

The team's environment: vLLM's CPU build alone (`PLAIN=1 hack/install-vllm.sh`, the same vLLM
and torch as the bench's own environment, no weightlift, no NIXL, no xxhash, no click). The
bundle: what the worker-bundle image holds (hack/build-bundle.sh), for this host's Python. The
row's clock starts where the pod's would: the init container's copy (bundle/copy.sh) into an
empty directory, then bundle/launch.sh (checks, then `python -m weightlift worker`) as the
worker container's command, until the worker's status says Serving. Same plan, role and load
format (preload) as the `preload` row; its own empty vLLM cache root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from weightlift.api.model import Role
from weightlift.local.llm import INSTALL_SCRIPT, vllm_worker_plan

REPO = INSTALL_SCRIPT.parents[1]
BUILD_BUNDLE = REPO / "hack" / "build-bundle.sh"
PLAIN_STAMP = ".engine-installed"


def _cache() -> Path:
    return Path(os.environ.get("WL_CACHE") or Path.home() / ".cache" / "weightlift")


def ensure_plain_env() -> Path:
    """vLLM's environment without weightlift (cached: minutes and ~6 GB once, from uv's cache)."""
    done = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)],
        env={**os.environ, "PLAIN": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"PLAIN=1 {INSTALL_SCRIPT} failed:\n{done.stdout[-2000:]}{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1]) / "bin" / "python"


def _run(argv: list[str], **env: str) -> None:
    done = subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr}")


def build_bundle(python: Path, out: Path) -> Path:
    """The worker-bundle image's /opt/weightlift-bundle for `python`'s version: its
    dependencies cached per version and build script, weightlift from this checkout."""
    version = subprocess.run(
        [str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    digest = hashlib.sha256(BUILD_BUNDLE.read_bytes()).hexdigest()[:12]
    deps = _cache() / f"bundle-deps-py{version}-{digest}"
    if not (deps / ".built").exists():
        shutil.rmtree(deps, ignore_errors=True)
        _run(["sh", str(BUILD_BUNDLE), "deps", str(deps)], PYTHONS=version, NIXL_PYTHONS=version)
        (deps / ".built").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(deps, out, symlinks=True)
    (out / ".built").unlink()
    # pip's --target compiles for the Python that runs it: the bench's, the same version.
    _run(["sh", str(BUILD_BUNDLE), "code", str(REPO), str(out)], PATH=_path_with(sys.executable))
    return out


def _path_with(python: str) -> str:
    return f"{Path(python).parent}:{os.environ.get('PATH', '')}"


def start_own_image(
    plain: Path, bundle: Path, model: Path, workdir: Path, args: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str, str, Path, float, float]:
    """Copy the bundle (the init container), then the launcher (the worker container); returns
    (process, address, pod, log, start time, the copy's seconds). The copy is under /dev/shm:
    `release_copies` removes it."""
    plan = vllm_worker_plan(
        model, "bench-own-image", Role.SOURCE, [], args, deployment="bench", identity="bench-llm"
    )
    plan_file = workdir / f"{plan.pod_name}.json"
    plan_file.write_text(plan.model_dump_json(by_alias=True))
    # A pod's copy goes to a memory emptyDir (operator/inject.py): tmpfs here too.
    shm = Path("/dev/shm")
    dest = Path(tempfile.mkdtemp(prefix="wl-bench-own-image-", dir=shm if shm.is_dir() else None))
    log = workdir / f"{plan.pod_name}.log"
    env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["WEIGHTLIFT_ENGINE_PYTHON"] = str(plain)
    env["WEIGHTLIFT_TERMINATION_LOG"] = str(workdir / "own-image.termination-log")
    started = time.monotonic()
    with log.open("wb") as out:
        subprocess.run(
            ["sh", str(bundle / "copy.sh"), str(dest)], env=env, stdout=out, stderr=out, check=True
        )
        copied = time.monotonic() - started
        proc = subprocess.Popen(
            ["sh", str(dest / "launch.sh"), "--plan", str(plan_file)],
            env=env,
            stdout=out,
            stderr=out,
        )
    return proc, f"127.0.0.1:{plan.runtime.port}", plan.pod_name, log, started, copied


def release_copies() -> None:
    """Remove the bundle copies `start_own_image` made in /dev/shm."""
    for copy in Path("/dev/shm").glob("wl-bench-own-image-*"):
        shutil.rmtree(copy, ignore_errors=True)
