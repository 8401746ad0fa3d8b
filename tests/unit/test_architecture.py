"""The house keeps its walls (import contracts) and ARCHITECTURE.md names what exists."""

from __future__ import annotations

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
