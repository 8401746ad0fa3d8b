"""`weightlift bench load --uri s3://` end to end on a tiny model: every contender verified."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.storage import require_minio
from weightlift.bench.s3load import S3_LOADERS, run_s3_bench


def test_s3_bench_runs_every_contender_on_the_same_objects(tmp_path: Path) -> None:
    require_minio()
    out = tmp_path / "s3.json"
    doc = run_s3_bench(
        "s3://bench/tiny",
        None,
        None,
        size_mb=4,
        parts=2,
        repeat=1,
        threads=4,
        chunk_mib=16,
        loaders=list(S3_LOADERS),
        json_path=out,
    )
    assert [r["loader"] for r in doc["results"]] == list(S3_LOADERS)
    assert all(r["verified"] and r["gbps"] > 0 for r in doc["results"]), doc["results"]
    assert len(doc["objects"]) == 2 and doc["limits"]["s3_ranged_get_gbps"] > 0
    assert json.loads(out.read_text())["command"].startswith("weightlift bench load --uri s3://")
