"""The GGUF reader on untrusted files: a valid file reads back the writer's table, and hundreds of crafted files
(truncated, wrong magic or version, absurd counts, lengths, dimensions, types, offsets; random byte flips) each
end as a table or one UserError line, quickly: no other exception, no hang, no allocation the file cannot back."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.export.gguf import check_file
from onnxdiffusion.export.gguf_blocks import FLOAT_TYPES, dequantize, finite, to_nbits
from onnxdiffusion.export.gguf_file import read_gguf
from onnxdiffusion.families import get_family

from gguf_files import write_gguf


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    rng = np.random.default_rng(0)
    tensors = {"transformer_blocks.0.attn.to_q.weight": rng.standard_normal((8, 64)),
               "transformer_blocks.0.attn.to_q.bias": rng.standard_normal(8),
               "proj_out.weight": rng.standard_normal((4, 32))}
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "v.gguf", tensors, "Q8_0", "qwen_image")
    return path.read_bytes()


def test_valid_file_reads_back(tmp_path, valid):
    path = tmp_path / "v.gguf"
    path.write_bytes(valid)
    gg = read_gguf(path)
    assert gg.architecture == "qwen_image" and gg.version == 3
    t = gg.tensors["transformer_blocks.0.attn.to_q.weight"]
    assert t.shape == (8, 64) and t.nbytes == 8 * 2 * 34 and t.ggml_type == 8
    assert gg.tensors["transformer_blocks.0.attn.to_q.bias"].shape == (8,)


def _layout(data: bytes) -> dict:
    """Byte positions of the header fields the crafted files aim at (from a plain walk of the valid file)."""
    pos = {"version": 4, "n_tensors": 8, "n_kv": 16}
    p = 24
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    for i in range(n_kv):
        klen = struct.unpack_from("<Q", data, p)[0]
        pos.setdefault("key_len", p)
        p += 8 + klen
        vtype = struct.unpack_from("<I", data, p)[0]
        pos.setdefault("value_type", p)
        p += 4
        if vtype == 8:
            pos.setdefault("string_len", p)
            p += 8 + struct.unpack_from("<Q", data, p)[0]
        else:
            p += {4: 4, 5: 4, 6: 4, 10: 8}.get(vtype, 4)
    pos["tensor_name_len"] = p
    nlen = struct.unpack_from("<Q", data, p)[0]
    pos["n_dims"] = p + 8 + nlen
    pos["dim0"] = pos["n_dims"] + 4
    n_dims = struct.unpack_from("<I", data, pos["n_dims"])[0]
    pos["type"] = pos["dim0"] + 8 * n_dims
    pos["offset"] = pos["type"] + 4
    return pos


def _crafted(valid: bytes, rng) -> list[bytes]:
    files = [b"", b"GGUF", valid[:23], b"GGUX" + valid[4:], b"\0" * 64, valid[:4] + struct.pack("<I", 1) + valid[8:]]
    files += [valid[:n] for n in sorted(set(rng.integers(0, len(valid), 120).tolist()))]  # truncated
    pos = _layout(valid)
    huge = (2**64 - 1, 2**63, 2**40, 2**32 + 1, 10**6, 0xFFFFFFFF, 65, 3)
    for field, fmt in (("n_tensors", "<Q"), ("n_kv", "<Q"), ("key_len", "<Q"), ("string_len", "<Q"),
                       ("tensor_name_len", "<Q"), ("dim0", "<Q"), ("offset", "<Q")):
        for v in (*huge, 0, 1, 31, 33):
            files.append(valid[:pos[field]] + struct.pack(fmt, v) + valid[pos[field] + 8:])
    for field in ("version", "value_type", "n_dims", "type"):
        for v in (0, 2, 5, 7, 9, 13, 29, 31, 40, 255, 2**31, 2**32 - 1):
            files.append(valid[:pos[field]] + struct.pack("<I", v) + valid[pos[field] + 4:])
    buf = np.frombuffer(valid, np.uint8)
    while len(files) < 620:  # random flips anywhere, header-heavy
        b = buf.copy()
        limit = len(valid) if rng.random() < 0.3 else min(len(valid), 400)
        for i in rng.integers(0, limit, rng.integers(1, 6)):
            b[i] = rng.integers(0, 256)
        files.append(b.tobytes())
    return files


def test_crafted_files_end_in_one_line(tmp_path, valid):
    rng = np.random.default_rng(43)
    family = get_family("qwenimage")
    files = _crafted(valid, rng)
    assert len(files) >= 500
    outcomes = {"read": 0, "refused": 0}
    for i, data in enumerate(files):
        path = tmp_path / f"c{i}.gguf"
        path.write_bytes(data)
        start = time.monotonic()
        try:
            gg = read_gguf(path)
            for t, _, _ in check_file(gg, family).values():  # what export does next with each tensor
                raw = gg.raw(t)
                if t.ggml_type in FLOAT_TYPES or len(t.shape) != 2:
                    finite(dequantize(raw, t.ggml_type, t.shape), t.name)
                else:
                    to_nbits(raw, t.ggml_type, t.shape)
            outcomes["read"] += 1
        except UserError as e:
            assert "\n" not in str(e) and str(e), f"file {i}: {e!r}"
            outcomes["refused"] += 1
        assert time.monotonic() - start < 5, f"file {i} took {time.monotonic() - start:.1f}s"
        path.unlink()
    print(f"{len(files)} crafted files: {outcomes}")
    assert outcomes["refused"] >= 300 and outcomes["read"] >= 1, outcomes


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        read_gguf(tmp_path / "absent.gguf")
