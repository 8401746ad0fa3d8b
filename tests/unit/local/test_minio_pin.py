"""hack/build-minio.sh builds the MinIO that local/s3server.py looks for."""

from __future__ import annotations

import re
from pathlib import Path

from weightlift.local.s3server import MINIO_VERSION

REPO = Path(__file__).resolve().parents[3]


def test_build_script_and_launcher_pin_the_same_minio() -> None:
    script = (REPO / "hack" / "build-minio.sh").read_text()
    pinned = re.search(r'^MINIO_VERSION="([^"]+)"', script, re.M)
    assert pinned is not None
    assert pinned.group(1) == MINIO_VERSION
