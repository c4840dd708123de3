"""GGUF weight blocks -> ONNX Runtime's MatMulNBits blocks (block 32), in numpy.

Exact, bit for bit, no float in between:
  Q8_0: 32 int8 + one fp16 scale      -> 8-bit blocks: the int8 offset by 128 (MatMulNBits' default zero point),
                                          the fp16 scale widened to fp32 (exact).
  Q4_0: 32 x 4 bits + one fp16 scale   -> 4-bit blocks: the nibbles re-ordered (GGUF puts elements j and j+16 in
        (implicit zero point 8)           byte j, MatMulNBits elements 2i and 2i+1 in byte i), zero point 8 being
                                          MatMulNBits' default.
Re-quantized (dequantized with the `gguf` package, then rounded to 8-bit blocks of 32 with one fp32 scale):
  every other type the `gguf` package can dequantize (Q4_1, Q5_0/1, Q2_K...Q6_K, IQ*, ...). The rounding error
  against the GGUF weights is reported per tensor (`snr_db`) and measured in experiments/families/gguf.md.
Float types (F32, F16, BF16) stay float weights.

`export --gguf-layout int8-channel` re-quantizes every quantized type (Q8_0 and Q4_0 too) to one symmetric int8
scale per output channel (`Channel8`, ONNX Runtime's DynamicQuantizeMatMul: the int32 accumulator runs over the
whole K, where MatMulNBits converts it to float every 32 inputs; experiments/families/step_kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UserError

BLOCK = 32
F32, F16, Q4_0, Q8_0, BF16 = 0, 1, 2, 8, 30
FLOAT_TYPES = (F32, F16, BF16)
EXACT = {Q8_0: 8, Q4_0: 4}


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


@dataclass(frozen=True)
class NBits:
    """One weight [N, K] as MatMulNBits inputs: `b` uint8 [N, K/32, 32*bits/8], `scales` float32 [N * K/32]."""

    b: np.ndarray
    scales: np.ndarray
    bits: int
    exact: bool
    snr_db: float | None  # re-quantized: the rounding's signal-to-noise against the GGUF weights; exact: None


@dataclass(frozen=True)
class Channel8:
    """One weight [N, K] as DynamicQuantizeMatMul inputs: `b` int8 [K, N] (symmetric: no zero point), `scales`
    float32 [N], one per output channel. Always re-quantized (`exact` False, `snr_db` against the GGUF weights)."""

    b: np.ndarray
    scales: np.ndarray
    bits: int = 8
    exact: bool = False
    snr_db: float | None = None


def _snr(ref: np.ndarray, err: np.ndarray) -> float:
    """A re-quantization's signal-to-noise in dB (the rounding error `err` against the weights `ref`)."""
    noise = float(np.square(err, dtype=np.float64).sum())
    signal = float(np.square(ref, dtype=np.float64).sum())
    return float("inf") if noise == 0 else 10 * np.log10(max(signal, 1e-300) / noise)


def _blocks(raw: np.ndarray, shape: tuple[int, ...], block_bytes: int) -> np.ndarray:
    n, k = shape
    return np.asarray(raw).reshape(n, k // BLOCK, block_bytes)


def finite(a: np.ndarray, what: str) -> np.ndarray:
    if not np.isfinite(a).all():
        raise UserError(f"{what} holds non-finite values (inf or NaN): a damaged or crafted file")
    return a


def _scales(blocks: np.ndarray) -> np.ndarray:
    return finite(np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32).reshape(-1),
                  "a block scale")


def _q8_0(raw: np.ndarray, shape) -> NBits:
    blocks = _blocks(raw, shape, 2 + BLOCK)
    return NBits(np.ascontiguousarray(blocks[..., 2:]) ^ np.uint8(0x80), _scales(blocks), 8, True, None)


def _q4_0(raw: np.ndarray, shape) -> NBits:
    blocks = _blocks(raw, shape, 2 + BLOCK // 2)
    qs = blocks[..., 2:]
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15, then 16..31
    packed = values[..., 0::2] | (values[..., 1::2] << 4)
    return NBits(np.ascontiguousarray(packed, dtype=np.uint8), _scales(blocks), 4, True, None)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor as float32 (the `gguf` package's reference dequantization)."""
    if ggml_type == F32:
        return np.asarray(raw).view(np.float32).reshape(shape).copy()
    if ggml_type == F16:
        return np.asarray(raw).view(np.float16).reshape(shape).astype(np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        rows = np.asarray(raw).reshape(int(np.prod(shape[:-1], dtype=np.int64)), -1)
        return gguf_dequantize(rows, GGMLQuantizationType(ggml_type)).reshape(shape).astype(np.float32, copy=False)
    except (NotImplementedError, ValueError, TypeError) as e:
        raise UserError(f"GGUF {type_name(ggml_type)} tensors cannot be read here: {str(e).splitlines()[0][:200]}") \
            from None


def requantize8(w: np.ndarray) -> NBits:
    """float [N, K] -> symmetric 8-bit blocks of 32 (what Q8_0 would hold, with fp32 scales)."""
    n, k = w.shape
    blocks = finite(w, "a weight").reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks / scale), -127, 127).astype(np.int16)
    return NBits((q + 128).astype(np.uint8), scale.reshape(-1), 8, False, _snr(blocks, q * scale - blocks))


def requantize4(w: np.ndarray) -> NBits:
    """float [N, K] -> symmetric 4-bit blocks of 32 as Q4_0 rounds them (the signed value of largest magnitude is
    -8 steps, so a block's range uses all 16 levels), fp32 scales, zero point 8 (MatMulNBits' default)."""
    n, k = w.shape
    blocks = finite(w, "a weight").reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    idx = np.abs(blocks).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(blocks, idx, axis=-1)
    scale = np.where(peak != 0, peak / -8.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks / scale), -8, 7).astype(np.int16)
    u = (q + 8).astype(np.uint8)
    packed = u[..., 0::2] | (u[..., 1::2] << 4)
    return NBits(np.ascontiguousarray(packed, dtype=np.uint8), scale.reshape(-1), 4, False,
                 _snr(blocks, q * scale - blocks))


def to_nbits(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> NBits:
    """A quantized 2-D weight [N, K] (K a multiple of 32) as MatMulNBits blocks: exact where the format allows."""
    if len(shape) != 2 or shape[1] % BLOCK:
        raise UserError(f"a {type_name(ggml_type)} weight of shape {list(shape)} is not a [N, K] matrix with K a "
                        f"multiple of {BLOCK}")
    if ggml_type == Q8_0:
        return _q8_0(raw, shape)
    if ggml_type == Q4_0:
        return _q4_0(raw, shape)
    return requantize8(dequantize(raw, ggml_type, shape))


def requantize_channel8(w: np.ndarray) -> Channel8:
    """float [N, K] -> symmetric int8 with one fp32 scale per row (output channel), stored [K, N]."""
    w = finite(w, "a weight").astype(np.float32, copy=False)
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    snr = _snr(w, q * scale - w)
    return Channel8(np.ascontiguousarray(q.T), scale.reshape(-1), snr_db=snr)


def to_channel8(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> Channel8:
    """A quantized 2-D weight [N, K] re-quantized per output channel (from the GGUF's own dequantized values)."""
    if len(shape) != 2 or shape[1] % BLOCK:
        raise UserError(f"a {type_name(ggml_type)} weight of shape {list(shape)} is not a [N, K] matrix with K a "
                        f"multiple of {BLOCK}")
    return requantize_channel8(dequantize(raw, ggml_type, shape))


def channel8_to_float(c: Channel8) -> np.ndarray:
    """What DynamicQuantizeMatMul computes with (its dequantized weight, [N, K]), for tests and reports."""
    return (c.b.T.astype(np.float32) * c.scales[:, None])


def nbits_to_float(nb: NBits, shape: tuple[int, int]) -> np.ndarray:
    """What MatMulNBits computes with (its dequantized weight), for tests and reports."""
    n, k = shape
    if nb.bits == 8:
        q = nb.b.astype(np.float32) - 128
    else:
        q = np.stack([nb.b & 0x0F, nb.b >> 4], axis=-1).reshape(n, k // BLOCK, BLOCK).astype(np.float32) - 8
    return (q.reshape(n, k // BLOCK, BLOCK) * nb.scales.reshape(n, k // BLOCK, 1)).reshape(n, k)
