"""`weightlift bench load --uri hf://` end to end on a tiny model: every contender verified."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from weightlift.bench.charts import remote_panels
from weightlift.bench.hfload import HF_LOADERS, run_hf_bench
from weightlift.bench.load import load_command
from weightlift.local.plot import Limit


def test_hf_bench_runs_every_contender_on_the_same_files(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    doc = run_hf_bench(
        "hf://bench/tiny",
        None,
        size_mb=4,
        parts=2,
        repeat=1,
        threads=4,
        chunk_mib=16,
        loaders=list(HF_LOADERS),
        json_path=out,
    )
    assert [r["loader"] for r in doc["results"]] == list(HF_LOADERS)
    assert all(r["verified"] and r["gbps"] > 0 for r in doc["results"]), doc["results"]
    assert all(r["cpu_seconds"] > 0 for r in doc["results"]), doc["results"]
    assert len(doc["objects"]) == 2 and doc["limits"]["hf_ranged_get_gbps"] > 0
    assert len(doc["commit"]) == 40
    assert json.loads(out.read_text())["command"].startswith("weightlift bench load --uri hf://")
    # What `--plot` draws of it: every contender against the Hub's raw ranged GETs.
    (panel,) = remote_panels(doc)
    assert [b.label for b in panel.bars] == list(HF_LOADERS)
    assert panel.limits == [Limit("hf ranged get", doc["limits"]["hf_ranged_get_gbps"])]


def test_hf_bench_command_rejects_an_unknown_loader(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        load_command,
        ["--uri", "hf://bench/tiny", "--loader", "boto3-download-then-load", "--json", "x.json"],
    )
    assert res.exit_code != 0
    assert "unknown hf loader(s) ['boto3-download-then-load']" in res.output
