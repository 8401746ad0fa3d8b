"""The house keeps its walls (import contracts) and ARCHITECTURE.md names what exists."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "weightlift"


def test_import_contracts_hold() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, "import-linter is not installed (the dev extra has it)"
    result = subprocess.run([lint_imports], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_architecture_names_only_modules_that_exist() -> None:
    text = (REPO / "ARCHITECTURE.md").read_text()
    rooms = re.findall(r"(\w+)/ \(", text)
    assert {"api", "operator", "worker", "local"} <= set(rooms)
    for room in rooms:
        assert (PACKAGE / room).is_dir(), f"ARCHITECTURE.md names {room}/, which does not exist"
    # Every file named inside a room's box exists in that room (or one of its subfolders).
    named = set(re.findall(r"\b(\w+\.py)\b", text))
    assert len(named) >= 15
    present = {p.name for p in PACKAGE.rglob("*.py")}
    missing = sorted(named - present - {"test_architecture.py"})
    assert not missing, f"ARCHITECTURE.md names modules that do not exist: {missing}"


# Declarative manifests and tables: long because the thing they spell out is long.
DECLARATIVE = {("operator/pods.py", "render_pod"), ("bench/fuzz_headers.py", "cases")}


def test_no_function_over_100_lines() -> None:
    """Steps instead of long functions: a function longer than 100 lines is split into the
    steps it already names (declarative manifests and tables excepted, by name)."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                where = (str(path.relative_to(PACKAGE)), node.name)
                if lines > 100 and where not in DECLARATIVE:
                    long.append(f"{where[0]}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over 100 lines: {long}"


def test_the_worker_front_process_starts_without_torch() -> None:
    """A vLLM or Triton worker only decides and starts its engine: importing torch first (~1 s
    on 2 cores) would sit on every replica's path to Ready. The builtin engine imports it."""
    code = (
        "import sys, weightlift.worker.main, weightlift.worker.engines.vllm.engine, "
        "weightlift.worker.engines.triton.engine; "
        "print(sorted(m for m in ('torch', 'safetensors', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
