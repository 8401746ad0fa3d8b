"""The demo model a real node's worker (uid 1000, hostPath mount) reads must be world-readable:
safetensors writes its files 0600."""

from __future__ import annotations

from pathlib import Path

from weightlift.local.models import make_demo


def test_every_demo_model_file_is_world_readable(tmp_path: Path) -> None:
    make_demo(tmp_path / "m", 0.05, hook=False, parts=2)
    files = [p for p in (tmp_path / "m").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    for p in files:
        assert p.stat().st_mode & 0o004, f"{p} is not readable by others"
