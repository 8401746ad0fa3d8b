"""`weightlift bench load` runs end to end on a tiny model and verifies every loader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from click.testing import CliRunner
from PIL import Image

from weightlift.bench.load import load_command

LOADERS = {
    "weightlift-preload",
    "weightlift-direct",
    "safetensors",
    "fastsafetensors",
    "runai-model-streamer",
}


def test_bench_load_json_png(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(
        load_command,
        [
            "--size-mb",
            "2",
            "--parts",
            "2",
            "--repeat",
            "1",
            "--json",
            str(out),
            "--dir",
            str(tmp_path / "m"),
            "--plot",
            str(tmp_path / "pictures" / "load.png"),
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["limits"]["memcpy_gbps"] > 0
    assert "odirect_read_gbps" in doc["limits"]
    assert {r["loader"] for r in doc["results"]} == LOADERS
    assert {(r["loader"], r["cache"]) for r in doc["results"]} == {
        (n, c) for n in LOADERS for c in ("warm", "cold")
    }
    assert all(r["verified"] and r["gbps"] > 0 and r["seconds"] > 0 for r in doc["results"])
    if sys.platform.startswith("linux"):  # what the notes say: who serves the files in place
        copied = {(r["loader"], r["cache"]): r["copied_bytes"] for r in doc["results"]}
        for cache in ("warm", "cold"):
            assert copied[("weightlift-preload", cache)] == 0
            assert copied[("weightlift-direct", cache)] == 0
            assert copied[("safetensors", cache)] == 0
            assert copied[("fastsafetensors", cache)] == doc["bytes"]
            assert copied[("runai-model-streamer", cache)] == doc["bytes"]
    # --plot: the picture where it says (its folder made), none next to the JSON.
    with Image.open(tmp_path / "pictures" / "load.png") as im:
        assert im.format == "PNG" and im.size == (1100, 480)
    assert not out.with_suffix(".png").exists()
