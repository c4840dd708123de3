"""Output correction (quantize --correct): the guided backbone output scaled and shifted per timestep, in the
host loop (``CorrectionHost``) and the sampling graph (``CorrectionLoop``, the host's twin). The fitted table,
``OutputCorrection``, is below; quantize/correction.py fits it.

Sampler-side error correction in the spirit of PTQD (numpy only), run time's side:
the fitted table and the per-step wrapper of the model function. Fitted at quantize time: quantize/correction.py.

On paired outputs over the calibration trajectories, fit per timestep t_k

    eps_fp32 ~= scale_k * eps_quant + bias_k[c]        (one scale, one bias per latent channel)

by least squares. The sampler applies it to the guided backbone output; because the map is
affine, correcting both halves and then guiding equals guiding and then correcting. Between
calibration timesteps scale and bias are interpolated linearly in t (hat functions; constant
beyond the ends), so any sampler and step count can use the table. The ONNX twin of `weights`
is ``CorrectionLoop`` below (same float32 formula).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .host_base import HostTechnique
from .loop_base import LoopTechnique, StepIO


@dataclass(frozen=True)
class OutputCorrection:
    t: np.ndarray  # (K,) ascending float32
    scale: np.ndarray  # (K,)
    bias: np.ndarray  # (K, C)

    def __post_init__(self) -> None:
        t = np.asarray(self.t, np.float32)
        if t.ndim != 1 or len(t) < 1 or np.any(np.diff(t) <= 0):
            raise ValueError("correction timesteps must be a strictly ascending 1-D array")
        scale = np.asarray(self.scale, np.float32)
        bias = np.asarray(self.bias, np.float32)
        if scale.shape != t.shape or bias.ndim != 2 or bias.shape[0] != len(t):
            raise ValueError(f"correction tables disagree: t {t.shape}, scale {scale.shape}, bias {bias.shape}")
        object.__setattr__(self, "t", t)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "bias", bias)

    # -- the piecewise-linear lookup, as the graph computes it ---------------------------------
    def hat_coefficients(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(il, cl, ir, cr) with w_k(t) = clip(min(t*il_k + cl_k, t*ir_k + cr_k), 0, 1)."""
        t = self.t.astype(np.float64)
        k = len(t)
        il, cl = np.zeros(k), np.ones(k)
        ir, cr = np.zeros(k), np.ones(k)
        for i in range(1, k):
            il[i] = 1.0 / (t[i] - t[i - 1])
            cl[i] = -t[i - 1] * il[i]
        for i in range(k - 1):
            ir[i] = -1.0 / (t[i + 1] - t[i])
            cr[i] = t[i + 1] / (t[i + 1] - t[i])
        f = np.float32
        return il.astype(f), cl.astype(f), ir.astype(f), cr.astype(f)

    def table(self) -> np.ndarray:
        """(K, 1 + C): scale then the channel biases, the matrix the weights multiply."""
        return np.concatenate([self.scale[:, None], self.bias], axis=1).astype(np.float32)

    def weights(self, t: float) -> np.ndarray:
        il, cl, ir, cr = self.hat_coefficients()
        tt = np.float32(t)
        return np.clip(np.minimum(tt * il + cl, tt * ir + cr), np.float32(0), np.float32(1))

    def at(self, t: float) -> tuple[np.float32, np.ndarray]:
        v = self.weights(t)[None, :] @ self.table()
        return np.float32(v[0, 0]), v[0, 1:].astype(np.float32)

    def apply(self, out: np.ndarray, t: float) -> np.ndarray:
        s, b = self.at(t)
        return out * s + b.reshape(1, -1, *([1] * (out.ndim - 2)))

    def wrap(self, model_fn):
        """model_fn(x, t) -> corrected model_fn(x, t) for the host loop."""

        def corrected(x, t):
            return self.apply(model_fn(x, t), t)

        return corrected

    # -- storage ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"t": self.t.tolist(), "scale": self.scale.tolist(), "bias": self.bias.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> OutputCorrection:
        return cls(np.asarray(d["t"], np.float32), np.asarray(d["scale"], np.float32), np.asarray(d["bias"], np.float32))


NAME = "correction"


def read_record(entry) -> OutputCorrection | None:
    """The correction a backbone's manifest entry (a manifest Component) records (quantize --correct), or None."""
    return OutputCorrection.from_dict(entry.correction) if entry.correction else None


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
