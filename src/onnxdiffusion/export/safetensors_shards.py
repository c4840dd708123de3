"""A component's safetensors shards read one tensor at a time, torch-free (export bounded by memory, issue 43).

safetensors' own `safe_open` memory-maps each file, and every page a read touches stays in the process's RSS
(file-backed) while the map is open; a streamed export reads each weight once, so plain positioned reads keep
RSS at one tensor. The header is untrusted input: sizes, offsets, dtypes and shapes are checked against the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError

_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class Entry:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _header(path: Path) -> dict[str, Entry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise UserError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_HEADER_LIMIT, size - 8):
            raise UserError(f"{path}: not a safetensors file (header length {n} past the file's {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (its header is not a JSON object)")
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = spec["dtype"], tuple(int(d) for d in spec["shape"]), spec["data_offsets"]
            start, end = int(start), int(end)
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _DTYPES:
            raise UserError(f"{path}: tensor {name!r} is {dtype}; a streamed export reads F32, F16 and BF16")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if any(d < 0 for d in shape) or not 0 <= start <= end or end - start != numel * _DTYPES[dtype][1] \
                or 8 + n + end > size:
            raise UserError(f"{path}: tensor {name!r}'s offsets or shape do not fit the file")
        out[name] = Entry(path, dtype, shape, 8 + n + start, end - start)
    return out


class Shards:
    """Every tensor of a component folder's *.safetensors files, by name (entries only: nothing read yet)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise UserError(f"{self.folder}: no .safetensors weights (a streamed export reads safetensors only)")
        self.entries: dict[str, Entry] = {}
        for f in files:
            for name, entry in _header(f).items():
                if name in self.entries:
                    raise UserError(f"{self.folder}: tensor {name!r} is in two files")
                self.entries[name] = entry

    def fp32_bytes(self) -> int:
        return 4 * sum(e.numel for e in self.entries.values())

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor as float32 (bf16 widened exactly); `rows` (start, stop): only those of its first axis (an
        embedding table read a slice at a time)."""
        e = self.entries[name]
        np_dtype, size = _DTYPES[e.dtype]
        shape, offset, count = e.shape, e.offset, e.numel
        if rows is not None:
            start, stop = max(0, rows[0]), min(shape[0], rows[1])
            row = count // shape[0] if shape[0] else 0
            shape, offset, count = (max(0, stop - start), *shape[1:]), offset + start * row * size, max(0, stop - start) * row
        with open(e.path, "rb") as f:
            f.seek(offset)
            a = np.fromfile(f, dtype=np_dtype, count=count)
        if a.size != count:
            raise UserError(f"{e.path}: tensor {name!r} is cut short")
        if e.dtype == "BF16":  # widened in one pass: a 6B model's weights go through here once each
            a = np.left_shift(a, 16, dtype=np.uint32).view(np.float32)
        return a.astype(np.float32, copy=False).reshape(shape)
