"""Output correction (quantize --correct): the guided backbone output scaled and shifted per timestep, in the
host loop (``CorrectionHost``) and the sampling graph (``CorrectionLoop``, the host's twin). The fitted table is
runtime/hooks/correction.py's ``OutputCorrection``."""

from __future__ import annotations

from .host_base import HostTechnique
from .loop_base import LoopTechnique, StepIO

NAME = "correction"


class CorrectionHost(HostTechnique):
    name = NAME

    def __init__(self, correction):
        self.correction = correction

    def wrap(self, model_fn, ctx):
        return self.correction.wrap(model_fn)


class CorrectionLoop(LoopTechnique):
    """out * s(t) + b(t) after guidance: hat-function interpolation of the per-timestep tables in the graph."""

    name = NAME
    loop_only = False

    def __init__(self, correction):
        self.correction = correction

    def prologue(self, b, bb, form: str, state) -> None:
        import numpy as np

        il, cl, ir, cr = self.correction.hat_coefficients()
        self.names = {name: b.const(name, v) for name, v in (("corr_il", il), ("corr_cl", cl), ("corr_ir", ir),
                                                                ("corr_cr", cr))}
        self.names["table"] = b.const("corr_table", self.correction.table())
        self.names["zero"] = b.const("corr_zero_f", np.array(0.0, np.float32))
        self.names["one"] = b.const("corr_one_f", np.array(1.0, np.float32))
        b.const("corr_s_index", np.array([0], np.int64))
        b.const("corr_b_start", np.array([1], np.int64))
        b.const("corr_b_end", np.array([1 << 30], np.int64))
        b.const("corr_axis1", np.array([1], np.int64))
        b.const("corr_b_shape", np.array([1, -1, 1, 1], np.int64))

    def after_guidance(self, b, guided: str, step: StepIO) -> str:
        c, t, n = self.names, step.t, step.n
        left = b.op("Add", [b.op("Mul", [t, c["corr_il"]], n("corr_tl")), c["corr_cl"]], n("corr_left"))
        right = b.op("Add", [b.op("Mul", [t, c["corr_ir"]], n("corr_tr")), c["corr_cr"]], n("corr_right"))
        w = b.op("Clip", [b.op("Min", [left, right], n("corr_min")), c["zero"], c["one"]], n("corr_w"))
        w2 = b.op("Unsqueeze", [w, "axes0"], n("corr_w2"))
        vals = b.op("MatMul", [w2, c["table"]], n("corr_vals"))  # (1, 1 + C)
        s = b.op("Gather", [vals, "corr_s_index"], n("corr_s"), axis=1)  # (1, 1)
        bias = b.op("Slice", [vals, "corr_b_start", "corr_b_end", "corr_axis1"], n("corr_bvec"))
        bias = b.op("Reshape", [bias, "corr_b_shape"], n("corr_b"))  # (1, C, 1, 1)
        return b.op("Add", [b.op("Mul", [guided, s], n("corr_scaled")), bias], n("corrected"))
