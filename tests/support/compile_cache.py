"""Compile-cache test helpers shared by the unit and e2e tests."""

from __future__ import annotations

import tarfile
from pathlib import Path


def flip_a_byte(archive: Path) -> None:
    """One bit of the compiled program's bytes (not a tar header: the checksum must catch it)."""
    with tarfile.open(archive) as tar:
        offset = next(m.offset_data for m in tar if m.name.endswith("/model"))
    with archive.open("r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)[0]
        f.seek(offset + 100)
        f.write(bytes([byte ^ 0x01]))
