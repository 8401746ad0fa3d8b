"""The models `weightlift bench chaos` deploys: the right one, other weights of the same shapes,
a program of other dimensions, the tiny Llama vLLM serves, and broken copies (a truncated file,
a lying header length, overlapping offsets, NaN weights, a compile-cache archive with a flipped
byte) whose status must name what is wrong."""

from __future__ import annotations

import json
import shutil
import struct
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightlift.local.llm import ensure_vllm_env, make_in_engine_env, vllm_python
from weightlift.local.stack import make_demo_model

JSON = dict[str, Any]


@dataclass
class Models:
    """The right model, a different one (for the swapped program) and broken copies."""

    work: Path
    # An existing demo model (`weightlift model make-demo`, with its init hook) or None: one is
    # made under `work`.
    good: Path | None = None
    probe: JSON = field(init=False)

    def __post_init__(self) -> None:
        if self.good is None:
            self.good = self.work / "good"
        if not (self.good / "probe.json").exists():
            make_demo_model(self.good, 8.0)
        self.probe = json.loads((self.good / "probe.json").read_text())

    @property
    def model(self) -> Path:
        assert self.good is not None
        return self.good

    def alt(self) -> tuple[Path, JSON]:
        """The good model's program, hook and tensor shapes with other weights (another seed),
        and its probe: a replica that serves one where the other belongs answers wrongly, while
        shapes alone never tell them apart (only the model identity and the probe do)."""
        out = self.work / "alt"
        header, data = _split(_weights(self.model))
        if not (out / "probe.json").exists():
            # A byte under the good size: make-demo rounds layers up, so this gives as many.
            make_demo_model(out, (len(data) - 1) / 1e6, seed=11)
        alt_header, _ = _split(_weights(out))
        shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
        alt_shapes = {k: v["shape"] for k, v in alt_header.items() if k != "__metadata__"}
        if shapes != alt_shapes:
            raise RuntimeError(f"{out}: tensor shapes differ from {self.model}'s")
        probe: JSON = json.loads((out / "probe.json").read_text())
        return out, probe

    def copy(self, name: str) -> Path:
        out = self.work / name
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(self.model, out)
        return out

    def llm(self) -> tuple[Path, JSON]:
        """The tiny Llama in HF layout (local/llm.py, made once under `work` with the vLLM
        environment's transformers) and its completion probe: transformers' greedy text."""
        out = self.work / "llm"
        return out, make_in_engine_env(vllm_python() or ensure_vllm_env(), out)

    def other(self) -> Path:
        """A demo model of other dimensions (its program expects other weight shapes)."""
        out = self.work / "other"
        if not (out / "probe.json").exists():
            make_demo_model(out, 64.0, hook=False, seed=7)
        return out


def _weights(model_dir: Path) -> Path:
    return model_dir / "model.safetensors"


def _split(path: Path) -> tuple[JSON, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(path: Path, header: JSON, data: bytes) -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def truncate(model_dir: Path) -> str:
    path = _weights(model_dir)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size - 4096)
    return path.name


def lying_header_length(model_dir: Path) -> str:
    path = _weights(model_dir)
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) + 1024)
    path.write_bytes(bytes(raw))
    return path.name


def overlapping_offsets(model_dir: Path) -> str:
    path = _weights(model_dir)
    header, data = _split(path)
    names = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )
    first, second = header[names[0]], header[names[1]]
    begin, end = second["data_offsets"]
    shift = (first["data_offsets"][1] - first["data_offsets"][0]) // 2
    second["data_offsets"] = [begin - shift, end - shift]
    _join(path, header, data)
    return path.name


def nan_weights(model_dir: Path) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    path = _weights(model_dir)
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(path), metadata={"weightlift": "demo", "rank": "0"})
    return "non-finite"


def flip_a_byte(archive: Path) -> None:
    """One bit of a compile-cache archive's program bytes (not a tar header: the manifest's
    checksum must catch it)."""
    with tarfile.open(archive) as tar:
        offset = next(m.offset_data for m in tar if m.name.endswith("/model"))
    with archive.open("r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)[0]
        f.seek(offset + 100)
        f.write(bytes([byte ^ 0x01]))
