"""Which safetensors files belong to rank r, and the validated index of one rank's shard.

Model directory layout (written by `weightlift model make-demo`, read by every loader):
  model.pt2                                   the program (weights stripped)
  model.json                                  runtime config (layout, layers, tp, inputs/outputs)
  tp == 1:  model.safetensors  or  model-00001-of-0000N.safetensors ...
  tp  > 1:  rank-{r}-of-{tp}.safetensors  or  rank-{r}-of-{tp}-0000k.safetensors (parts)
A tp == 1 model may also use rank-0-of-1*.safetensors. Tensor-parallel models must be presharded:
rank r reads only its own files.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from weightlift.worker.weights.header import SafetensorsHeader, TensorInfo, read_header
from weightlift.worker.weights.progress import LoadError

_SHARDED = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


def _rank_re(rank: int, tp: int) -> re.Pattern[str]:
    return re.compile(rf"^rank-{rank}-of-{tp}(?:-(\d+))?\.safetensors$")


def is_rank_file(name: str, ranks: Sequence[int], tp: int) -> bool:
    """Whether a file name (in the model dir's root) holds a shard of one of `ranks`."""
    return any(_rank_re(r, tp).match(name) for r in ranks)


def rank_files(model_dir: str | Path, rank: int, tp: int) -> list[Path]:
    """The safetensors files holding rank `rank`'s shard, in load order. Raises LoadError."""
    d = Path(model_dir)
    if not 0 <= rank < tp:
        raise LoadError(f"rank {rank} is outside tensor-parallel size {tp}")
    if not d.is_dir():
        raise LoadError(f"model dir {d} does not exist or is not a directory")
    names = sorted(p.name for p in d.iterdir() if p.name.endswith(".safetensors"))
    pat = _rank_re(rank, tp)
    ranked = [n for n in names if pat.match(n)]
    if ranked:
        # Parts sort numerically; the unsuffixed single file sorts first.
        def part(n: str) -> int:
            m = pat.match(n)
            return int(m.group(1)) if m and m.group(1) else -1

        return [d / n for n in sorted(ranked, key=part)]
    if tp > 1:
        others = [n for n in names if n.startswith("rank-")]
        hint = f" (found {others[:4]})" if others else ""
        raise LoadError(
            f"model dir {d}: no presharded files rank-{rank}-of-{tp}[-NNNNN].safetensors "
            f"for rank {rank} of tensor-parallel size {tp}{hint}"
        )
    if "model.safetensors" in names:
        return [d / "model.safetensors"]
    sharded = [(m, n) for n in names if (m := _SHARDED.match(n))]
    if sharded:
        counts = {int(m.group(2)) for m, _ in sharded}
        if len(counts) != 1:
            raise LoadError(f"model dir {d}: mixed shard counts {sorted(counts)} in file names")
        (total,) = counts
        have = {int(m.group(1)) for m, _ in sharded}
        missing = sorted(set(range(1, total + 1)) - have)
        if missing:
            width = len(sharded[0][0].group(1))
            lost = [f"model-{i:0{width}d}-of-{sharded[0][0].group(2)}.safetensors" for i in missing]
            raise LoadError(f"model dir {d}: missing shard files {lost}")
        return [d / n for _, n in sorted(sharded, key=lambda x: int(x[0].group(1)))]
    if names:
        raise LoadError(f"model dir {d}: unrecognised safetensors file names {names[:4]}")
    raise LoadError(f"model dir {d}: no safetensors files")


@dataclass(frozen=True)
class ShardIndex:
    """Validated headers of one rank's files and where each tensor lives."""

    rank: int
    files: list[SafetensorsHeader]
    # tensor name -> (header, info); insertion order is file order, then offset order.
    tensors: dict[str, tuple[SafetensorsHeader, TensorInfo]]

    @property
    def data_bytes(self) -> int:
        return sum(h.data_bytes for h in self.files)


def shard_index(model_dir: str | Path, rank: int, tp: int) -> ShardIndex:
    """Read and validate every header of rank `rank`; duplicate names across files are errors."""
    return index_files(list(rank_files(model_dir, rank, tp)), rank)


def index_files(paths: Sequence[str | Path], rank: int = 0) -> ShardIndex:
    """A ShardIndex over explicit files (benchmarks and tests)."""
    headers = [read_header(p) for p in paths]
    tensors: dict[str, tuple[SafetensorsHeader, TensorInfo]] = {}
    for h in headers:
        for name, info in h.tensors.items():
            if name in tensors:
                raise LoadError(
                    f"tensor {name!r} appears in both {tensors[name][0].path} and {h.path}"
                )
            tensors[name] = (h, info)
    return ShardIndex(rank=rank, files=headers, tensors=tensors)
