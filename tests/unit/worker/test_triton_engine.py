"""runtime.engine Triton, short of a tritonserver start: bad installs fail the worker permanently
with a message naming what and where (tritonserver started never), the generated repository,
Triton's refusals read from its log, the generate extension's request parameters, the spec and
the pod's ports."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from tests.support.worker import free_port, make_plan, running_worker
from tests.unit.operator.test_pods import container, render
from weightlift.api.model import ModelDeploymentSpec, RuntimeSpec
from weightlift.api.worker import WorkerPlan
from weightlift.worker.engines.triton.backend import sampling_settings
from weightlift.worker.engines.triton.engine import refusal
from weightlift.worker.engines.triton.install import (
    STUB,
    PythonInfo,
    TritonMissing,
    backend_dir,
    engine_python_info,
    server_root,
    stub_site,
)
from weightlift.worker.engines.triton.repository import read_config, write_repository


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(64, 8)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"vocab_size": 64}))
    vocab = {f"t{i}": i for i in range(63)}
    added = [{"id": 63, "content": "</s>", "special": True}]
    (d / "tokenizer.json").write_text(
        json.dumps({"model": {"vocab": vocab}, "added_tokens": added})
    )
    return d


def _triton_plan(d: Path) -> WorkerPlan:
    return make_plan(
        d,
        model={"uri": f"file://{d}", "format": "safetensors"},
        runtime={
            "engine": "Triton",
            "port": free_port(),
            "enginePort": free_port(),
            "engineGrpcPort": free_port(),
            "engineMetricsPort": free_port(),
        },
    )


def _failed_message(plan: WorkerPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("WEIGHTLIFT_ENGINE_DIR", str(tmp_path / "engine"))
    monkeypatch.setenv("WEIGHTLIFT_VLLM_PYTHON", sys.executable)
    with running_worker(plan) as w:
        st = w.wait_phase({"Failed", "Serving"}, timeout=120)
    assert st["phase"] == "Failed" and st["permanentFailure"], st
    assert not list((tmp_path / "engine").glob("*/tritonserver.log"))  # never started
    return str(st["message"])


def _fake_home(tmp_path: Path, versions: list[str]) -> Path:
    """A tree of the installed layout; the binaries are empty files (never run here)."""
    root = tmp_path / "triton" / "pytriton" / "tritonserver"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tritonserver").write_bytes(b"")
    for v in versions:
        (root / f"backends-py{v}" / "python").mkdir(parents=True)
        for name in (STUB, "libtriton_python.so"):
            (root / f"backends-py{v}" / "python" / name).write_bytes(b"")
    return tmp_path / "triton"


def test_tritonserver_missing_names_where_it_was_looked_for(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "no-triton"
    monkeypatch.setenv("WEIGHTLIFT_TRITON_HOME", str(home))
    msg = _failed_message(_triton_plan(hf_dir), tmp_path, monkeypatch)
    assert "tritonserver not found" in msg and str(home) in msg, msg
    assert "install-triton.sh" in msg, msg


def test_no_stub_for_the_engine_python_names_the_version_and_the_stubs_there(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = _fake_home(tmp_path, ["3.8", "3.99"])
    monkeypatch.setenv("WEIGHTLIFT_TRITON_HOME", str(home))
    msg = _failed_message(_triton_plan(hf_dir), tmp_path, monkeypatch)
    version = "{}.{}".format(*sys.version_info[:2])
    assert f"no Triton Python backend stub for Python {version}" in msg, msg
    assert f"backends-py{version}/python/{STUB}" in msg and "3.8, 3.99" in msg, msg


def test_install_lookups(tmp_path: Path) -> None:
    home = _fake_home(tmp_path, ["3.11"])
    root = server_root(home)
    assert root == home / "pytriton" / "tritonserver"
    assert backend_dir(root, "3.11") == root / "backends-py3.11"
    with pytest.raises(TritonMissing, match=r"stub-site/py3\.11/numpy"):
        stub_site("3.11", home)
    (home / "stub-site" / "py3.11" / "numpy").mkdir(parents=True)
    assert stub_site("3.11", home) == home / "stub-site" / "py3.11"


def test_a_triton_images_own_layout_uses_its_backend_and_no_numpy_of_ours(tmp_path: Path) -> None:
    """NGC's layout (/opt/tritonserver: bin/tritonserver, backends/python with the stub built for
    the image's Python), as an Injected pod's launcher names it: its own backend, and no
    stub-site (that stub was built against the image's numpy)."""
    root = tmp_path / "opt" / "tritonserver"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tritonserver").write_text("")
    python_backend = root / "backends" / "python"
    python_backend.mkdir(parents=True)
    (python_backend / "libtriton_python.so").write_text("")
    with pytest.raises(TritonMissing, match=r"no Triton Python backend stub for Python 3\.12"):
        backend_dir(root, "3.12")  # the library without its stub is no backend
    (python_backend / STUB).write_text("")
    assert server_root(root) == root
    backends = backend_dir(root, "3.12")
    assert backends == root / "backends"
    assert stub_site("3.12", root, backends) is None
    # A stub per Python version still wins, and still needs its numpy.
    (root / "backends-py3.12" / "python").mkdir(parents=True)
    for name in (STUB, "libtriton_python.so"):
        (root / "backends-py3.12" / "python" / name).write_text("")
    assert backend_dir(root, "3.12") == root / "backends-py3.12"
    with pytest.raises(TritonMissing, match=r"stub-site/py3\.12/numpy"):
        stub_site("3.12", root, root / "backends-py3.12")
    python = PythonInfo(
        "/usr/bin/python3", "3.12", "/usr/lib", True, ["/usr/lib/python3/dist-packages"]
    )
    model = write_repository(tmp_path / "repo", "llm", python, ["--model", "/m"], None)
    assert all("stub-site" not in p for p in read_config(model).path_front)


def test_engine_python_info_of_this_interpreter() -> None:
    info = engine_python_info(sys.executable)
    assert info.version == "{}.{}".format(*sys.version_info[:2])
    assert info.executable == sys.executable and info.site_dirs
    with pytest.raises(TritonMissing, match="does not run"):
        engine_python_info("/nonexistent/python3")


def test_repository_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/checkout", ""]))
    python = PythonInfo("/env/bin/python", "3.11", "/py/lib", True, ["/env/site-packages"])
    argv = ["--model", "/m", "--load-format", "weightlift"]
    model = write_repository(tmp_path / "repo", "llm", python, argv, tmp_path / "np1")
    config = (model / "config.pbtxt").read_text()
    assert 'name: "llm"' in config and 'backend: "python"' in config
    assert 'name: "text_input" data_type: TYPE_STRING' in config
    assert 'name: "text_output" data_type: TYPE_STRING' in config
    conf = read_config(model)
    assert conf.engine_argv == argv and conf.executable == "/env/bin/python"
    # numpy 1.x first: in an image, the weightlift package's directory is the site-packages
    # that holds the engine's numpy 2 (worker-triton's stub crashed on every BYTES tensor).
    assert conf.path_front[:2] == [str(tmp_path / "np1"), "/checkout"]
    assert conf.site_dirs == ["/env/site-packages"]
    bootstrap = (model / "1" / "model.py").read_text()
    compile(bootstrap, "model.py", "exec")
    assert "from weightlift.worker.engines.triton.backend import (" in bootstrap
    assert "TritonPythonModel" in bootstrap and "exit_with_parent()" in bootstrap


def test_refusal_is_read_from_tritonservers_log() -> None:
    # A line as tritonserver 2.51 writes it when a Python model's initialize raises.
    line = (
        "E1124 02:51:28.440174 2350 model_lifecycle.cc:642] \"failed to load 'llm' version 1: "
        "Internal: ImportError: cannot import name 'sentinel' from 'typing_extensions'\\n\\nAt:"
        '\\n  /x.py(10): <module>\\n"'
    )
    found = refusal("I1124 loading\n" + line + "\nerror: creating server: Internal")
    assert found is not None and found.startswith("failed to load 'llm' version 1: Internal")
    assert "cannot import name 'sentinel'" in found and "\\n" not in found
    assert refusal("I1124 all fine\n") is None


def test_sampling_settings_from_request_parameters() -> None:
    assert sampling_settings('{"max_tokens": 8, "temperature": 0}') == {
        "max_tokens": 8,
        "temperature": 0.0,
    }
    assert sampling_settings("") == {"max_tokens": 16, "temperature": 0.0}
    assert sampling_settings({"max_tokens": 2, "top_k": 1})["top_k"] == 1
    with pytest.raises(ValueError, match="must be an object"):
        sampling_settings("[1]")


def test_triton_spec_ports_and_format() -> None:
    rt = RuntimeSpec(engine="Triton")
    assert (rt.port, rt.engine_port, rt.engine_metrics_port, rt.engine_grpc_port) == (
        8000,
        8001,
        8002,
        8003,
    )
    with pytest.raises(ValidationError, match=r"engineGrpcPort and engineMetricsPort must differ"):
        RuntimeSpec(engine="Triton", engine_grpc_port=8002)
    with pytest.raises(ValidationError, match=r"engine Triton needs spec\.model\.format"):
        ModelDeploymentSpec.model_validate(
            {"model": {"uri": "hostpath:///m"}, "runtime": {"engine": "Triton"}}
        )


def test_pod_declares_tritons_ports() -> None:
    spec = ModelDeploymentSpec.model_validate(
        {
            "model": {"uri": "hostpath:///m", "format": "safetensors"},
            "runtime": {"engine": "Triton"},
        }
    )
    ports = {p["name"]: p["containerPort"] for p in container(render(spec))["ports"]}
    assert ports == {"http": 8000, "triton-http": 8001, "triton-metrics": 8002, "triton-grpc": 8003}
