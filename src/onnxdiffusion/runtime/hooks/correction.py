"""Sampler-side error correction in the spirit of PTQD (numpy only), run time's side:
the fitted table and the per-step wrapper of the model function. Fitted at quantize time: quantize/correction.py.

On paired outputs over the calibration trajectories, fit per timestep t_k

    eps_fp32 ~= scale_k * eps_quant + bias_k[c]        (one scale, one bias per latent channel)

by least squares. The sampler applies it to the guided backbone output; because the map is
affine, correcting both halves and then guiding equals guiding and then correcting. Between
calibration timesteps scale and bias are interpolated linearly in t (hat functions; constant
beyond the ends), so any sampler and step count can use the table. The ONNX twin of `weights`
lives in ``samplers.graph`` (same float32 formula).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
