"""safetensors read/write with numpy alone (the run time imports no torch; the format is 8 bytes of
header length, a JSON header, then raw little-endian tensors). Anything else (a pickle checkpoint,
a truncated or foreign file) is refused with one line naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import UserError

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": None,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items() if v is not None}
_MAX_HEADER = 100 << 20


def _pickle_like(head: bytes) -> bool:
    return head[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05") or head[:2] == b"PK"  # pickle / torch zip


def read(path: Path | str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors as float32/int arrays, the header's __metadata__)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if _pickle_like(data[:8]):
        raise UserError(f"{path}: a pickle checkpoint (.ckpt/.pt/.bin); only safetensors files are read "
                        f"(pickle can run code when loaded)")
    if len(data) < 8:
        raise UserError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(_MAX_HEADER, len(data) - 8):
        raise UserError(f"{path}: not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a safetensors file ({str(e)[:100]})") from None
    meta = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + n:]
    out: dict[str, np.ndarray] = {}
    for key, spec in header.items():
        try:
            dtype, shape, (lo, hi) = spec["dtype"], [int(d) for d in spec["shape"]], spec["data_offsets"]
            if dtype not in _DTYPES or not 0 <= lo <= hi <= len(body):
                raise ValueError(dtype)
            raw = np.frombuffer(body[lo:hi], dtype=np.uint16 if dtype == "BF16" else _DTYPES[dtype])
            if dtype == "BF16":  # bfloat16 is the top half of a float32
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            out[key] = raw.reshape(shape)
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: tensor {key!r} has a bad header entry") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path}: __metadata__ is not an object")
    return out, {str(k): str(v) for k, v in meta.items()}


def write(path: Path | str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write atomically (a temporary name, then a rename)."""
    from ..folder.artifacts import atomic_write_bytes

    header: dict = {"__metadata__": dict(metadata or {})}
    chunks, offset = [], 0
    for key, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        raw = arr.tobytes()
        header[key] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    atomic_write_bytes(Path(path), struct.pack("<Q", len(text)) + text + b"".join(chunks))
