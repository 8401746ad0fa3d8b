"""The operator image must not need the worker's heavy dependencies (torch, NIXL)."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import sys
BLOCKED = {'torch', 'safetensors', 'numpy', 'nixl', 'nixl_cu12', 'rich', 'cryptography'}
class Block:
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ImportError('operator imported ' + name)
sys.meta_path.insert(0, Block())
import weightlift.operator.handlers, weightlift.operator.run, weightlift.api.crd
import weightlift.api.worker
import weightlift.cli
print('ok')
"""


def test_operator_modules_import_without_worker_dependencies() -> None:
    result = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
