"""A GGUF file's header and tensor table, read as untrusted input.

GGUF (llama.cpp's format; city96's ComfyUI-GGUF and stable-diffusion.cpp write diffusion backbones in it): magic
`GGUF`, a version, the tensor and key-value counts, the key-values, a table of tensor infos (name, dims innermost
first, ggml type, offset), then the data section at the next multiple of `general.alignment`. The `gguf` package's
own reader trusts the counts it reads (a crafted count makes it loop or allocate without bound), so this reader
checks every count, length, type and offset against the bytes the file actually holds before using it: whatever
the file, the result is a table or one UserError line. Only the key-values export needs are kept; the others are
skipped (bounded by the file's size). The tensor bytes themselves are memory-mapped, never read here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NAME = 1024
MAX_ALIGNMENT = 1 << 16
# ggml value types of the key-value section: type id -> struct format (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEPT = ("general.architecture", "general.alignment", "general.name")


@dataclass(frozen=True)
class GgufTensor:
    name: str
    ggml_type: int  # a ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # torch order (outermost first): GGUF lists the innermost dimension first
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GgufFile:
    path: Path
    version: int
    architecture: str | None
    tensors: dict[str, GgufTensor]

    def raw(self, tensor: GgufTensor):
        """The tensor's bytes as a read-only uint8 memory map (paged in when read)."""
        import numpy as np

        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(tensor.nbytes,))


class _Cursor:
    def __init__(self, buf, where: str):
        self.buf, self.pos, self.where = buf, 0, where

    def fail(self, why: str):
        raise UserError(f"{self.where}: not a readable GGUF file: {why}")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > len(self.buf) - self.pos:
            self.fail(f"{what} runs past the end of the file (at byte {self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count, refused where its items could not fit in the bytes left (no loop runs on a crafted count)."""
        n = self.unpack("<Q", what)
        if n * min_item_bytes > len(self.buf) - self.pos:
            self.fail(f"{what} {n} cannot fit in the {len(self.buf) - self.pos} bytes left")
        return n

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.count(f"{what} length", 1)
        if limit is not None and n > limit:
            self.fail(f"{what} is {n} bytes long (at most {limit})")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and depth == 0:
            itype = self.unpack("<I", f"{what} item type")
            if itype in _SCALARS:
                n = self.count(f"{what} item count", struct.calcsize(_SCALARS[itype]))
                self.take(n * struct.calcsize(_SCALARS[itype]), what)  # skipped: export reads no array
                return None
            if itype not in (_STRING, _ARRAY):
                self.fail(f"{what} has unknown item type {itype}")
            n = self.count(f"{what} item count", 8)  # a string or an array item holds at least a u64
            for _ in range(n):
                self.value(itype, what, depth + 1)
            return None
        if vtype == _ARRAY:
            self.fail(f"{what} nests arrays deeper than one level")
        self.fail(f"{what} has unknown value type {vtype}")


def _type_sizes() -> dict[int, tuple[int, int]]:
    from gguf import GGML_QUANT_SIZES

    return {int(k): v for k, v in GGML_QUANT_SIZES.items()}


def _tensor_info(cur: _Cursor, sizes: dict[int, tuple[int, int]], i: int) -> tuple[str, int, tuple[int, ...], int, int]:
    name = cur.string(f"tensor {i} name", MAX_NAME)
    n_dims = cur.unpack("<I", f"tensor {name!r} dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = [cur.unpack("<Q", f"tensor {name!r} dimensions") for _ in range(n_dims)]
    ggml_type = cur.unpack("<I", f"tensor {name!r} type")
    offset = cur.unpack("<Q", f"tensor {name!r} offset")
    if ggml_type not in sizes:
        cur.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
    block, block_bytes = sizes[ggml_type]
    if any(d < 1 for d in dims) or any(d > len(cur.buf) * block for d in dims):
        cur.fail(f"tensor {name!r} has impossible dimensions {dims}")
    if dims[0] % block:
        cur.fail(f"tensor {name!r}: its innermost dimension {dims[0]} is not a multiple of its type's block {block}")
    elements = 1
    for d in dims:
        elements *= d
    return name, ggml_type, tuple(reversed(dims)), offset, elements // block * block_bytes


def read_gguf(path: Path | str) -> GgufFile:
    """The header and tensor table of a GGUF file, every count, type and offset checked; UserError otherwise."""
    path = Path(path)
    where = str(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise UserError(f"{where}: not a readable GGUF file: {size} bytes, shorter than a GGUF header")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror or e}") from None
    try:
        return _parse(_Cursor(buf, where), path)
    finally:
        buf.close()


def _parse(cur: _Cursor, path: Path) -> GgufFile:
    if cur.take(4, "magic") != MAGIC:
        cur.fail("no GGUF magic (the file does not start with 'GGUF')")
    version = cur.unpack("<I", "version")
    if version not in VERSIONS:
        cur.fail(f"version {version} (this reader knows {', '.join(map(str, VERSIONS))}; a big-endian file reads "
                 f"as a huge version)")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.count("key-value count", 8 + 4 + 1)
    if n_tensors * (8 + 4 + 8 + 4 + 8) > len(cur.buf) - cur.pos:
        cur.fail(f"tensor count {n_tensors} cannot fit in the file")
    kept: dict[str, object] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}", MAX_NAME)
        vtype = cur.unpack("<I", f"type of {key!r}")
        value = cur.value(vtype, f"value of {key!r}")
        if key in _KEPT:
            kept[key] = value
    alignment = kept.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or not 1 <= alignment <= MAX_ALIGNMENT \
            or alignment & (alignment - 1):
        cur.fail(f"general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}")
    arch = kept.get("general.architecture")
    if arch is not None and not isinstance(arch, str):
        cur.fail("general.architecture is not a string")
    sizes = _type_sizes()
    infos = [_tensor_info(cur, sizes, i) for i in range(n_tensors)]
    data_start = cur.pos + (-cur.pos) % alignment
    tensors: dict[str, GgufTensor] = {}
    spans = []
    for name, ggml_type, shape, offset, nbytes in infos:
        if name in tensors:
            cur.fail(f"tensor {name!r} is listed twice")
        if offset % alignment:
            cur.fail(f"tensor {name!r}'s offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > len(cur.buf):
            cur.fail(f"tensor {name!r} ({nbytes} bytes at offset {offset}) lies past the end of the file")
        tensors[name] = GgufTensor(name, ggml_type, shape, start, nbytes)
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            cur.fail(f"tensors {a!r} and {b!r} overlap")
    return GgufFile(path, version, arch, tensors)
