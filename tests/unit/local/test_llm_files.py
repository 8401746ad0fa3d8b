"""The tiny Llama's files are readable by a real node's worker (uid 1000), not only root."""

from __future__ import annotations

import stat
from pathlib import Path

from weightlift.local.llm import readable_by_all


def test_a_private_file_becomes_readable_by_all(tmp_path: Path) -> None:
    weights = tmp_path / "sub" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"x")
    weights.chmod(0o600)  # what save_pretrained leaves
    weights.parent.chmod(0o700)
    readable_by_all(tmp_path)
    assert stat.S_IMODE(weights.stat().st_mode) == 0o644
    assert stat.S_IMODE(weights.parent.stat().st_mode) == 0o755
