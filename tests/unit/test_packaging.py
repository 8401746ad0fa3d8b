"""`pip install .` ships every module of every room under `weightlift.*`, and each one imports
from the installed copy (not from the source tree)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Modules that run only inside an engine's own environment (they subclass the engine's classes):
# shipped like every other, imported there (tests/e2e/test_vllm_worker.py), not here.
ENGINE_ONLY = {
    "weightlift.worker.engines.vllm.loader",
    "weightlift.worker.engines.vllm.inplace",  # vLLM's own reload helpers, in the engine
}


def _source_modules() -> set[str]:
    modules = set()
    for path in (REPO / "weightlift").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if "__pycache__" in parts or parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.add(".".join(parts))
    return modules


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip` builds from the checkout, unpacked into a fresh target directory."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("weightlift-*.whl")
    target = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def test_the_wheel_holds_every_module(installed: Path) -> None:
    shipped = {
        ".".join(p.relative_to(installed).with_suffix("").parts).removesuffix(".__init__")
        for p in (installed / "weightlift").rglob("*.py")
    }
    missing = _source_modules() - shipped
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    assert (installed / "weightlift" / "operator" / "planning.py").is_file()


def test_the_wheel_holds_the_data_files(installed: Path) -> None:
    """What the code reads beside its modules (the OIP spec of `weightlift bench oip`)."""
    data = {
        p.relative_to(REPO)
        for p in (REPO / "weightlift").rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc")
    }
    assert Path("weightlift/bench/data/open_inference_rest.yaml") in data
    missing = {p for p in data if not (installed / p).is_file()}
    assert not missing, f"data files missing from the wheel: {sorted(map(str, missing))}"


def test_every_installed_module_imports_from_the_wheel(installed: Path) -> None:
    # -I -S: no editable finder (.pth) and no repo on sys.path; the venv's site-packages are
    # added as plain paths so third-party dependencies (torch, kopf) still resolve.
    site = sysconfig.get_paths()["purelib"]
    package_dir = str(installed / "weightlift")
    script = (
        "import importlib, sys\n"
        f"sys.path[:0] = [{str(installed)!r}]\n"
        f"sys.path.append({site!r})\n"
        "import weightlift\n"
        f"assert list(weightlift.__path__) == [{package_dir!r}], weightlift.__path__\n"
        f"for name in {sorted(_source_modules() - ENGINE_ONLY)!r}:\n"
        "    importlib.import_module(name)\n"
        "print('imported', len(sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script], capture_output=True, text=True, cwd=installed
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("imported")
