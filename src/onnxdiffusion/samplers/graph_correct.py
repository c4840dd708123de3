"""The guided output's corrections in the sampling graph: CFG rescale (cfg_combine(..., rescale=True)'s
twin) and the per-timestep output correction of a quantized backbone (OutputCorrection's twin)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def rescale(b, guided: str, cond: str, n: Callable[[str], str]) -> str:
    """guided * |cond| / |guided|, norms over the last axis (cfg_combine(..., rescale=True)'s twin)."""
    def norm(x: str, hint: str) -> str:
        sq = b.op("ReduceSum", [b.op("Mul", [x, x], n(hint + "_sq")), "last_axis"], n(hint + "_sumsq"), keepdims=1)
        return b.op("Sqrt", [sq], n(hint + "_norm"))

    ratio = b.op("Div", [norm(cond, "cond"), norm(guided, "guided")], n("rescale_ratio"))
    return b.op("Mul", [guided, ratio], n("rescaled"))


def correction_prologue(b, pre: dict[str, str], correction) -> None:
    """Constants of the sampler-side output correction (quantize --correct), read by every step."""
    il, cl, ir, cr = correction.hat_coefficients()
    for name, v in (("corr_il", il), ("corr_cl", cl), ("corr_ir", ir), ("corr_cr", cr)):
        pre[name] = b.const(name, v)
    pre["corr_table"] = b.const("corr_table", correction.table())
    pre["corr_zero"] = b.const("corr_zero_f", np.array(0.0, np.float32))
    pre["corr_one"] = b.const("corr_one_f", np.array(1.0, np.float32))
    b.const("corr_s_index", np.array([0], np.int64))
    b.const("corr_b_start", np.array([1], np.int64))
    b.const("corr_b_end", np.array([1 << 30], np.int64))
    b.const("corr_axis1", np.array([1], np.int64))
    b.const("corr_b_shape", np.array([1, -1, 1, 1], np.int64))


def correct(b, pre: dict[str, str], t: str, out: str, n: Callable[[str], str]) -> str:
    """out * s(t) + b(t): hat-function interpolation of the per-timestep tables (OutputCorrection's twin)."""
    left = b.op("Add", [b.op("Mul", [t, pre["corr_il"]], n("corr_tl")), pre["corr_cl"]], n("corr_left"))
    right = b.op("Add", [b.op("Mul", [t, pre["corr_ir"]], n("corr_tr")), pre["corr_cr"]], n("corr_right"))
    w = b.op("Clip", [b.op("Min", [left, right], n("corr_min")), pre["corr_zero"], pre["corr_one"]], n("corr_w"))
    w2 = b.op("Unsqueeze", [w, "axes0"], n("corr_w2"))
    vals = b.op("MatMul", [w2, pre["corr_table"]], n("corr_vals"))  # (1, 1 + C)
    s = b.op("Gather", [vals, "corr_s_index"], n("corr_s"), axis=1)  # (1, 1)
    bias = b.op("Slice", [vals, "corr_b_start", "corr_b_end", "corr_axis1"], n("corr_bvec"))
    bias = b.op("Reshape", [bias, "corr_b_shape"], n("corr_b"))  # (1, C, 1, 1)
    return b.op("Add", [b.op("Mul", [out, s], n("corr_scaled")), bias], n("corrected"))
