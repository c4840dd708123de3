"""CFG rescale in the sampling graph (cfg_combine(..., rescale=True)'s twin); the per-timestep output correction
of a quantized backbone is techniques/correction.py's CorrectionLoop."""

from __future__ import annotations

from collections.abc import Callable


def rescale(b, guided: str, cond: str, n: Callable[[str], str]) -> str:
    """guided * |cond| / |guided|, norms over the last axis (cfg_combine(..., rescale=True)'s twin)."""
    def norm(x: str, hint: str) -> str:
        sq = b.op("ReduceSum", [b.op("Mul", [x, x], n(hint + "_sq")), "last_axis"], n(hint + "_sumsq"), keepdims=1)
        return b.op("Sqrt", [sq], n(hint + "_norm"))

    ratio = b.op("Div", [norm(cond, "cond"), norm(guided, "guided")], n("rescale_ratio"))
    return b.op("Mul", [guided, ratio], n("rescaled"))
