"""The KServe v2 / Triton HTTP tensor codec: JSON tensors and the binary tensor data extension,
as tritonclient.http sends them by default."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from aiohttp import web

from weightlift.worker.engines.builtin.runtime import V2_TO_NUMPY, InferError

HEADER_LEN = "Inference-Header-Content-Length"
NUMPY_TO_V2 = {np.dtype(v).str: k for k, v in V2_TO_NUMPY.items()}


def decode_inputs(
    body: bytes, header_len: int | None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if header_len is not None:
        if header_len < 0 or header_len > len(body):
            raise InferError(f"{HEADER_LEN} {header_len} exceeds the body ({len(body)} bytes)")
        head, binary = body[:header_len], body[header_len:]
    else:
        head, binary = body, b""
    try:
        req = json.loads(head)
    except ValueError as exc:
        raise InferError(f"request is not JSON: {exc}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise InferError("request must be an object with an 'inputs' list")
    arrays: dict[str, np.ndarray] = {}
    pos = 0
    for item in req["inputs"]:
        if not isinstance(item, dict):
            raise InferError("each input must be an object")
        name, dt, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not isinstance(name, str) or not isinstance(shape, list):
            raise InferError("each input needs 'name' and 'shape'")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InferError(f"input {name!r}: invalid shape {shape!r}")
        np_dtype = V2_TO_NUMPY.get(str(dt))
        if np_dtype is None:
            raise InferError(f"input {name!r}: unsupported datatype {dt!r}")
        numel = int(np.prod(shape)) if shape else 1
        params = item.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        try:
            if size is not None:
                if not isinstance(size, int) or size < 0 or pos + size > len(binary):
                    raise InferError(f"input {name!r}: binary_data_size {size!r} is out of range")
                want = numel * np.dtype(np_dtype).itemsize
                if size != want:
                    raise InferError(f"input {name!r}: {size} binary bytes, shape needs {want}")
                arr = np.frombuffer(binary[pos : pos + size], dtype=np_dtype).reshape(shape)
                pos += size
            else:
                if "data" not in item:
                    raise InferError(f"input {name!r} has neither 'data' nor binary data")
                arr = np.asarray(item["data"], dtype=np_dtype)
                if arr.size != numel:
                    raise InferError(
                        f"input {name!r}: {arr.size} values, shape {shape} needs {numel}"
                    )
                arr = arr.reshape(shape)
        except InferError:
            raise
        # OverflowError: a value out of the datatype's range (300 for UINT8, 2**64 for INT64).
        except (TypeError, ValueError, OverflowError) as exc:
            raise InferError(f"input {name!r}: {exc}") from None
        arrays[name] = arr
    return req, arrays


def encode_outputs(model: str, req: dict[str, Any], outputs: dict[str, np.ndarray]) -> web.Response:
    params = req.get("parameters") if isinstance(req.get("parameters"), dict) else {}
    default_binary = bool(params.get("binary_data_output", False)) if params else False
    wanted: dict[str, bool] = {}
    requested = req.get("outputs")
    if isinstance(requested, list) and requested:
        for o in requested:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InferError("each requested output needs a 'name'")
            if o["name"] not in outputs:
                raise InferError(f"unknown output {o['name']!r}")
            p = o.get("parameters") if isinstance(o.get("parameters"), dict) else {}
            wanted[o["name"]] = bool((p or {}).get("binary_data", default_binary))
    else:
        wanted = {n: default_binary for n in outputs}
    out_json: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in wanted.items():
        arr = outputs[name]
        entry: dict[str, Any] = {
            "name": name,
            "datatype": NUMPY_TO_V2.get(arr.dtype.str, "FP32"),
            "shape": list(arr.shape),
        }
        if binary:
            raw = np.ascontiguousarray(arr).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.flatten().tolist()
        out_json.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": out_json}
    if "id" in req:
        doc["id"] = req["id"]
    head = json.dumps(doc).encode()
    if not blobs:
        return web.Response(body=head, content_type="application/json")
    resp = web.Response(body=head + b"".join(blobs), content_type="application/octet-stream")
    resp.headers[HEADER_LEN] = str(len(head))
    return resp
