"""GPTQ with per-block clip search, written here in numpy, packed into ONNX Runtime's MatMulNBits.

    hessians = input_hessians(model, names, calib, steps)
    model = _ort.int4_quantize(model, names, 32, False, 4, quantizer=GptqWeights(hessians, 32, False, 4))

Each 4-bit weight W (K x N, blocks of `block_size` along K per output column) is rounded row by row
(input channel k in order); the rounding error of row k is pushed onto the rows not yet rounded
through the inverse Hessian H = E[x^T x] of the linear's input (GPTQ, arXiv 2210.17323), so the
*output* error x (W - Q) is what is minimized, not the weight error. Each block's grid (scale and,
asymmetric, zero point) is fixed when GPTQ reaches the block's first row, from the weights as updated
so far, by a clip-ratio search that minimizes the block's H-diagonal-weighted rounding error.

Why not ONNX Runtime's vendored GPTQ (int4-weights `algorithm=gptq`): on the rotated embedded MMDiT it
made the backbone worse than round-to-nearest (SQNR 13.9 vs 17.0 dB on calibration trajectories); this
one lifts it to 23.6 dB (experiments/quantize-embedded/quantize_issue44.md). The Hessians come from the
graph being quantized (the rotated one under `rotate`), so they are the rotated activations'.

int8-static's `weights=gptq` (per-token linears, dynamic_token.py) uses the same loop for 8-bit per-channel
weights: `int8_channels`, one block of K rows per column on dynamic_token's symmetric [-127, 127] grid. It
took the rotated W8A8 MMDiT's worst held-out image from 33.8 to 37.0 dB (docs/recipes/rotation.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx

CLIP_GRID = tuple(float(r) for r in np.linspace(1.0, 0.5, 11))  # the block's range scaled by each; 1.0 = min/max
DAMP = 0.01  # of the Hessian's mean diagonal, added to it: GPTQ's default


def input_hessians(model: onnx.ModelProto, names: Iterable[str], calib, steps: Sequence[int], threads: int = 1) -> dict[str, np.ndarray]:
    """E[x^T x] (float64, K x K) of each named MatMul's input tensor over the calibration feeds at `steps`,
    every token of every row a sample. Keyed by tensor name (q, k and v read one)."""
    from .graphs import with_outputs
    from .runner import session

    nodes = {n.name: n for n in model.graph.node}
    tensors = sorted({nodes[n].input[0] for n in names})
    sess = session(with_outputs(model, tensors, only=True), threads)
    sums: dict[str, np.ndarray] = {}
    count = dict.fromkeys(tensors, 0)
    for _, feed in calib.feeds(steps):
        for t, x in zip(tensors, sess.run(tensors, feed)):
            x = x.reshape(-1, x.shape[-1]).astype(np.float64)
            sums[t] = sums[t] + x.T @ x if t in sums else x.T @ x
            count[t] += len(x)
    return {t: sums[t] / max(count[t], 1) for t in tensors}


def _grid(block: np.ndarray, symmetric: bool, weight: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Each column's (scale, zero point) for one block (rows x N) by clip search: the ratio (one, or one for
    each end when asymmetric) whose rounding error, weighted per row by `weight`, is least."""
    best_scale = best_zp = best_err = None
    mid = (top + 1) // 2
    if symmetric:  # ONNX Runtime's symmetric grid: the signed value of largest magnitude maps to -mid
        signed = np.take_along_axis(block, np.abs(block).argmax(axis=0)[None], axis=0)[0]
        pairs = [(r, r) for r in CLIP_GRID]
    else:
        lo, hi = np.minimum(block.min(axis=0), 0), np.maximum(block.max(axis=0), 0)
        pairs = [(a, b) for a in CLIP_GRID for b in CLIP_GRID]
    for a, b in pairs:
        if symmetric:
            scale, zp = signed * a / -mid, np.full(block.shape[1], float(mid))
        else:
            scale = (hi * b - lo * a) / top
        scale = np.where(scale == 0, 1.0, scale)
        if not symmetric:
            zp = np.clip(np.round(-lo * a / scale), 0, top)
        q = (np.clip(np.round(block / scale) + zp, 0, top) - zp) * scale
        err = (weight[:, None] * (block - q) ** 2).sum(axis=0)
        if best_err is None:
            best_scale, best_zp, best_err = scale, zp, err
        else:
            better = err < best_err
            best_scale, best_zp = np.where(better, scale, best_scale), np.where(better, zp, best_zp)
            best_err = np.where(better, err, best_err)
    return best_scale, best_zp


def gptq_blocks(w: np.ndarray, hessian: np.ndarray, block_size: int, symmetric: bool, bits: int = 4,
                damp: float = DAMP, top: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ of w (K x N) with per-block clip-searched grids. Returns (q: (K, N) integers in [0, top],
    scales, zero points: (blocks, N)); w is approximated by (q - zp[k // block_size]) * scale[k // block_size].
    `top` (default 2^bits - 1): the largest code; an even one with `symmetric` is a grid symmetric about zero
    (254: int8's [-127, 127] around zero point 127)."""
    top = 2 ** bits - 1 if top is None else top
    w = np.array(w, np.float64)
    k_dim, n_dim = w.shape
    h = np.array(hessian, np.float64)
    dead = np.diag(h) == 0  # a channel never active: its rows carry nothing
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h += damp * np.mean(np.diag(h)) * np.eye(k_dim)
    upper = np.linalg.cholesky(np.linalg.inv(h)).T  # H^-1's upper Cholesky factor: GPTQ's row-by-row update
    blocks = -(-k_dim // block_size)
    q = np.zeros((k_dim, n_dim), np.int64)
    scales, zps = np.zeros((blocks, n_dim)), np.zeros((blocks, n_dim))
    diag = np.diag(h)
    for b in range(blocks):
        k0, k1 = b * block_size, min((b + 1) * block_size, k_dim)
        scale, zp = _grid(w[k0:k1], symmetric, diag[k0:k1], top)
        scales[b], zps[b] = scale, zp
        for k in range(k0, k1):
            q[k] = np.clip(np.round(w[k] / scale) + zp, 0, top)
            err = (w[k] - (q[k] - zp) * scale) / upper[k, k]
            w[k + 1:] -= np.outer(upper[k, k + 1:], err)
    return q, scales, zps


def int8_channels(w: np.ndarray, hessian: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ rounding of w (K x N) to the grid dynamic_token.weight_quantize rounds to: symmetric int8 per output
    channel, codes in [-127, 127] (one block of K rows per column; its scale by the clip search, ratio 1.0 being
    max|W[:, n]| / 127). Returns (int8 (K, N) codes, float32 (N,) positive scales)."""
    q, scales, zps = gptq_blocks(w, hessian, w.shape[0], True, top=2 * 127)
    sign = np.where(scales[0] < 0, -1, 1)  # the symmetric grid's scale carries the sign of the column's extreme
    codes = (q - zps[0].astype(np.int64)) * sign
    return codes.astype(np.int8), (scales[0] * sign).astype(np.float32)


def pack(q: np.ndarray, scales: np.ndarray, zps: np.ndarray, block_size: int, bits: int = 4):
    """MatMulNBits' (B, scales, zero_points) from gptq_blocks' output, laid out as ONNX Runtime's quantizer
    writes them: B (N, blocks, block_size * bits / 8) uint8, low bits first; scales (N, blocks) float32;
    4-bit zero points two to a byte per column (N, ceil(blocks / 2)), an odd last one's high half 8."""
    k_dim, n_dim = q.shape
    blocks = scales.shape[0]
    padded = np.zeros((blocks * block_size, n_dim), np.uint8)
    padded[:k_dim] = q
    padded[k_dim:] = np.repeat(zps.astype(np.uint8), block_size, axis=0)[k_dim:]  # padding rows dequantize to 0
    cols = padded.T.reshape(n_dim, blocks, block_size)
    zp = zps.T.astype(np.uint8)
    if bits == 8:
        return cols, scales.T.astype(np.float32), zp
    packed = (cols[..., 0::2] | (cols[..., 1::2] << 4)).astype(np.uint8)
    if blocks % 2:
        zp = np.concatenate([zp, np.full((n_dim, 1), 8, np.uint8)], axis=1)
    return packed, scales.T.astype(np.float32), (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)


def weight_quantizer(hessians: dict[str, np.ndarray], block_size: int, symmetric: bool, accuracy_level: int, bits: int = 4):
    """ONNX Runtime's per-node weight-only quantizer with its block rounding replaced by gptq_blocks: the node
    it writes (names, attributes, Reshape) is ORT's own. Each MatMul's Hessian is looked up by its input."""
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    class GptqWeights(nbits.DefaultWeightOnlyQuantizer):
        def quantize(self, node, graph_stack):
            self.hessian = hessians[node.input[0]]
            return super().quantize(node, graph_stack)

        def qbits_block_quant(self, fp32weight):
            q, scales, zps = gptq_blocks(fp32weight, self.hessian, block_size, symmetric, bits)
            return pack(q, scales, zps, block_size, bits)

    return GptqWeights(nbits.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                                          accuracy_level=accuracy_level or None,
                                                          op_types_to_quantize=("MatMul",), bits=bits))


def gptq_clip_quantize(base: onnx.ModelProto, model: onnx.ModelProto, names: list[str], calib, recipe,
                       threads: int = 1) -> tuple[onnx.ModelProto, int]:
    """int4-weights' `algorithm=gptq-clip`: `names`' weights in `model` to 4-bit MatMulNBits by GPTQ, their
    Hessians from the float graph `base` (rotated, when it is) at `recipe.gptq_steps` calibration timesteps.
    Returns the model and the number of timesteps."""
    from . import _ort, files
    from ..errors import UserError

    if files.is_large(base):
        raise UserError("int4-weights algorithm=gptq-clip runs the whole backbone for its Hessians: only backbones under 2 GB")
    steps = calib.spread_steps(recipe.gptq_steps)
    hessians = input_hessians(base, names, calib, steps, threads)
    quantizer = weight_quantizer(hessians, recipe.block_size, recipe.symmetric, recipe.accuracy_level)
    return _ort.int4_quantize(model, names, recipe.block_size, recipe.symmetric, recipe.accuracy_level,
                              quantizer=quantizer), len(steps)
