"""Sampler-side error correction in the spirit of PTQD (numpy only: the run-time side imports this).

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


def _affine_fit(f: np.ndarray, q: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Least-squares f ~= s * q + b[c] on (rows, C, H, W): the scale s and the channel means of f, q."""
    fm = f.mean(axis=(0, 2, 3), keepdims=True)
    qm = q.mean(axis=(0, 2, 3), keepdims=True)
    qc = q - qm
    denom = float((qc * qc).sum())
    s = float((qc * (f - fm)).sum()) / denom if denom > 0 else 1.0
    return s, fm, qm


def affine_explained_fraction(reference: np.ndarray, quantized: np.ndarray) -> float:
    """Share of the backbone's quantization MSE that the best per-step affine map removes.

    reference/quantized: (steps, rows, C, H, W) paired outputs on the same inputs. The map is
    fitted in-sample and unclipped (one scale, one bias per channel, per step), so this is the
    ceiling for any correction of this form; the rest is error that varies per sample and pixel.
    """
    total = resid = 0.0
    for f, q in zip(reference.astype(np.float64), quantized.astype(np.float64)):
        s, fm, qm = _affine_fit(f, q)
        total += float(((f - q) ** 2).sum())
        resid += float(((f - fm - s * (q - qm)) ** 2).sum())
    return 1.0 - resid / total if total > 0 else 0.0


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

    # -- fitting and storage -------------------------------------------------------------------
    @classmethod
    def fit(cls, timesteps: np.ndarray, reference: np.ndarray, quantized: np.ndarray,
            max_scale_change: float = 0.2) -> OutputCorrection:
        """reference/quantized: (steps, rows, C, H, W) paired backbone outputs at `timesteps`."""
        ts, scales, biases = [], [], []
        for k, t in enumerate(timesteps):
            s, fm, qm = _affine_fit(reference[k].astype(np.float64), quantized[k].astype(np.float64))
            s = float(np.clip(s, 1.0 - max_scale_change, 1.0 + max_scale_change))
            b = (fm - s * qm).reshape(-1)
            ts.append(float(t))
            scales.append(s)
            biases.append(b)
        order = np.argsort(ts)
        return cls(np.asarray(ts)[order], np.asarray(scales)[order], np.asarray(biases)[order])

    @classmethod
    def fit_trajectory(cls, run_backbone, calib, table, max_scale_change: float = 0.2) -> OutputCorrection:
        """Fit step by step along the quantized model's own (corrected) trajectory.

        At step k the quantized backbone runs on the current quantized latents; scale and bias are
        chosen so that the sampler's next latents match the fp32 trajectory's in least squares.
        That removes the systematic part of this step's error and of the drift accumulated so far.
        `run_backbone(feed) -> out` runs the quantized backbone; `calib` holds the fp32 trajectories
        (``CalibrationSet`` with latents and pairs); `table` is the sampler table they were run with.
        """
        u_rows, c_rows = calib.pairs[:, 0], calib.pairs[:, 1]
        guided = bool(np.all(u_rows >= 0))
        g = np.float32(calib.guidance)
        x = (calib.latents[0] * np.float32(table.init_scale)).astype(np.float32)
        d_prev = np.zeros_like(x)
        ts, scales, biases = [], [], []
        if np.any(table.column("k")):  # the fit inverts a linear update; clip_sample is not one
            raise ValueError("the trajectory correction needs a sampler without clip_sample")
        if table.host_only:  # the fit reads one D_prev; PNDM/UniPC rows carry a longer history
            raise ValueError(f"the trajectory correction does not fit {table.sampler}'s multistep history; "
                             "calibrate with another sampler (e.g. ddim)")
        for k, (t, c_in, p, q, a, c, d, e, *_clip) in enumerate(table.rows):
            sample = np.empty_like(calib.samples[k])
            sample[c_rows] = x * c_in
            if guided:
                sample[u_rows] = x * c_in
            feed = {"sample": sample, "timestep": np.full((len(sample),), t, np.float32),
                    **calib.conditioning()}
            out = run_backbone(feed)
            o = out[u_rows] + g * (out[c_rows] - out[u_rows]) if guided else out[c_rows]
            target_d = (calib.latents[k + 1] - a * x - d * d_prev) / c
            target = (target_d - p * x) / q
            s, fm, qm = _affine_fit(target.astype(np.float64), o.astype(np.float64))
            s = float(np.clip(s, 1 - max_scale_change, 1 + max_scale_change))
            bias = (fm - s * qm).reshape(-1)
            ts.append(float(t))
            scales.append(s)
            biases.append(bias)
            corrected = (o * np.float32(s) + bias.astype(np.float32).reshape(1, -1, 1, 1)).astype(np.float32)
            den = p * x + q * corrected
            x = a * x + c * den + d * d_prev
            d_prev = den
        order = np.argsort(ts)
        return cls(np.asarray(ts)[order], np.asarray(scales)[order], np.asarray(biases)[order])

    def to_dict(self) -> dict:
        return {"t": self.t.tolist(), "scale": self.scale.tolist(), "bias": self.bias.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> OutputCorrection:
        return cls(np.asarray(d["t"], np.float32), np.asarray(d["scale"], np.float32), np.asarray(d["bias"], np.float32))
