"""numpy twins of the low-bit float formats: what ONNX's QuantizeLinear / DequantizeLinear compute.

FP8 E4M3FN (1 sign, 4 exponent, 3 mantissa bits, bias 7, no infinities, max 448) and FP4 E2M1
(1, 2, 1, bias 1, max 6: the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6). Rounding is to the nearest grid
point, ties to even, with saturation (ONNX's `saturate=1` default): out-of-range values clamp to
the largest finite magnitude.

NVFP4 (NVIDIA Model Optimizer's recipe, TensorRT's format) scales in two levels: a per-tensor
float32 scale `s2 = amax / (6 * 448)` and per-block FP8 E4M3 scales `round_e4m3(block_amax / 6 / s2)`
over blocks of 16 along the input dimension; values are `round_e2m1(x / (s8 * s2))`. The graph
dequantizes with two DequantizeLinear nodes: `s = float32(s8) * s2`, then `x = float32(q) * s`.
Every product and quotient here is formed in float32, as the graph forms it, so a twin and the
graph agree bit for bit (tests check it against onnx.reference.ReferenceEvaluator).

Pure numpy; values on a grid are returned as float32 arrays holding exactly representable values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16


@dataclass(frozen=True)
class FloatFormat:
    name: str
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal number (below it: subnormal spacing)
    max_value: float


E4M3FN = FloatFormat("float8e4m3fn", 3, -6, E4M3_MAX)
E2M1 = FloatFormat("float4e2m1", 1, 0, E2M1_MAX)


def round_to_grid(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Nearest value of `fmt`'s grid, ties to even, saturating at +-max (NaN stays NaN)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.minimum(np.abs(x).astype(np.float64), fmt.max_value)
    # exponent of the binade a lies in (frexp: a = m * 2**e with m in [0.5, 1)), floored at the
    # smallest normal exponent so that subnormals share its spacing
    _, e = np.frexp(a)
    e = np.maximum(e - 1, fmt.min_exponent)
    quantum = np.ldexp(1.0, e - fmt.mantissa_bits)
    q = np.rint(a / quantum) * quantum  # power-of-two division is exact; rint is ties-to-even
    q = np.minimum(q, fmt.max_value)
    out = np.copysign(q, x).astype(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out)


def fp8_e4m3(x: np.ndarray) -> np.ndarray:
    return round_to_grid(x, E4M3FN)


def fp4_e2m1(x: np.ndarray) -> np.ndarray:
    return round_to_grid(x, E2M1)


def _divide(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / scale in float32 as QuantizeLinear forms it; a zero scale (an all-zero block) gives 0."""
    x = np.asarray(x, np.float32)
    scale = np.asarray(scale, np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.divide(x, scale, dtype=np.float32)
    return np.where(scale == 0, np.float32(0), q)


# --- FP8: per-tensor and per-channel ---------------------------------------------------------

def fp8_scale(amax: np.ndarray | float) -> np.ndarray:
    """The scale that maps amax onto E4M3's largest value (a zero range gets scale 1)."""
    amax = np.asarray(amax, np.float32)
    return np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)


def channel_scale(w: np.ndarray, axis: int) -> np.ndarray:
    """Per-channel FP8 scales along `axis` (the output channels) from each channel's amax."""
    w = np.asarray(w, np.float32)
    axes = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
    return fp8_scale(np.abs(w).max(axis=axes))


def _expand(scale: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return np.asarray(scale, np.float32).reshape(shape)


def fp8_quantize(x: np.ndarray, scale: np.ndarray | float, axis: int | None = None) -> np.ndarray:
    """QuantizeLinear to FLOAT8E4M3FN (saturating): per tensor, or per channel along `axis`."""
    x = np.asarray(x, np.float32)
    s = np.asarray(scale, np.float32) if axis is None else _expand(scale, x.ndim, axis)
    return fp8_e4m3(_divide(x, s))


def fp8_dequantize(q: np.ndarray, scale: np.ndarray | float, axis: int | None = None) -> np.ndarray:
    q = np.asarray(q, np.float32)
    s = np.asarray(scale, np.float32) if axis is None else _expand(scale, q.ndim, axis)
    return (q * s).astype(np.float32)


def fp8_fake(x: np.ndarray, scale: np.ndarray | float, axis: int | None = None) -> np.ndarray:
    """DequantizeLinear(QuantizeLinear(x)) for FP8."""
    return fp8_dequantize(fp8_quantize(x, scale, axis), scale, axis)


# --- NVFP4: two-level block scaling ----------------------------------------------------------

def _blocks(x: np.ndarray, axis: int, block: int) -> tuple[np.ndarray, int]:
    """x with `axis` moved last and split into (..., nblocks, block); zero-padded to a whole block."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], pad), np.float32)], axis=-1)
    return x.reshape(*x.shape[:-1], -1, block), n


def _unblocks(xb: np.ndarray, n: int, axis: int) -> np.ndarray:
    x = xb.reshape(*xb.shape[:-2], -1)[..., :n]
    return np.moveaxis(x, -1, axis)


def nvfp4_tensor_scale(amax: np.ndarray | float) -> np.float32:
    """Per-tensor scale: the largest block scale then lands on E4M3's max (a zero tensor gets 1)."""
    amax = float(amax)
    return np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)


@dataclass(frozen=True)
class Nvfp4:
    """A tensor in NVFP4: E2M1 values (float32 on the grid), E4M3 block scales, the float32 scale."""

    values: np.ndarray  # same shape as the input
    block_scales: np.ndarray  # the input's shape with `axis` divided (ceil) by the block size
    tensor_scale: np.float32
    axis: int
    block: int

    def scales(self) -> np.ndarray:
        """First DequantizeLinear: float32(block scale) * tensor scale."""
        return (self.block_scales * self.tensor_scale).astype(np.float32)

    def dequantize(self) -> np.ndarray:
        """Second DequantizeLinear: each value times its block's scale (blocks along `axis`)."""
        s = np.repeat(self.scales(), self.block, axis=self.axis)
        s = np.take(s, np.arange(self.values.shape[self.axis]), axis=self.axis)
        return (self.values * s).astype(np.float32)


def nvfp4_quantize(x: np.ndarray, axis: int = -1, block: int = NVFP4_BLOCK, tensor_scale: float | None = None) -> Nvfp4:
    """Two-level NVFP4 quantization of `x`, blocks of `block` along `axis`.

    `tensor_scale` None: from x's own amax (weights, and TRT_FP4DynamicQuantize's view of an
    activation whose per-tensor scale was calibrated is passed in explicitly).
    """
    x = np.asarray(x, np.float32)
    axis = axis % x.ndim
    s2 = nvfp4_tensor_scale(np.abs(x).max(initial=0.0)) if tensor_scale is None else np.float32(tensor_scale)
    xb, n = _blocks(x, axis, block)
    block_amax = np.abs(xb).max(axis=-1)
    s8 = fp8_e4m3(_divide(block_amax / np.float32(E2M1_MAX), s2))  # QuantizeLinear(amax/6, s2) -> E4M3
    scale = (s8 * s2).astype(np.float32)
    q = fp4_e2m1(_divide(xb, scale[..., None]))
    values = _unblocks(q, n, axis)
    return Nvfp4(values, np.moveaxis(s8, -1, axis), s2, axis, block)


def nvfp4_fake(x: np.ndarray, axis: int = -1, block: int = NVFP4_BLOCK, tensor_scale: float | None = None) -> np.ndarray:
    """The float tensor the two DequantizeLinear nodes give back."""
    return nvfp4_quantize(x, axis, block, tensor_scale).dequantize()
