"""Sampler-side error correction in the spirit of PTQD (numpy only): the fit, per calibration timestep, of
eps_fp32 ~= scale_k * eps_quant + bias_k[c] by least squares over paired outputs on the calibration trajectories.
What the table means and how the sampler applies it (interpolated in t, any sampler and step count) is
techniques/correction.py's docstring; the ONNX twin of `weights` lives in ``samplers.graph``.
"""

from __future__ import annotations

import numpy as np

from ..techniques.correction import OutputCorrection as _RuntimeCorrection


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


class OutputCorrection(_RuntimeCorrection):
    """The run-time correction (techniques/correction.py) with its fitting."""

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
