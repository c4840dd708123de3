"""LCM and TCD rows: few-step consistency samplers on a betas schedule (LCMScheduler, TCDScheduler).

Both run on the distillation schedule's timesteps (``original_inference_steps`` evenly spaced
training steps, sub-sampled) and land each step on a fresh noisy sample: x' = alpha' D + sigma' noise
(LCM; D the boundary-conditioned ``denoised``), or TCD's partial re-noising from an intermediate
time s = floor((1 - eta) t').  Both are one model call per row and linear in (x, out, noise), so
their rows run in every loop form.
"""

from __future__ import annotations

import numpy as np

from .schedules import NoiseSchedule
from .discrete import _pq_vp, _rows
from .options import SamplerOptions


def consistency_timesteps(T: int, n: int, original_steps: int, name: str) -> np.ndarray:
    """LCMScheduler/TCDScheduler.set_timesteps (strength 1, no custom timesteps)."""
    if original_steps > T:
        raise ValueError(f"{name}: original_inference_steps={original_steps} exceeds num_train_timesteps={T}")
    origin = np.arange(1, original_steps + 1) * (T // original_steps) - 1
    if n > original_steps:
        raise ValueError(f"{name} runs at most original_inference_steps={original_steps} steps, got {n}")
    idx = np.floor(np.linspace(0, len(origin), num=n, endpoint=False)).astype(np.int64)
    return origin[::-1][idx].astype(np.float64)


def _final(sched: NoiseSchedule, ac: np.ndarray) -> float:
    return 1.0 if sched.set_alpha_to_one else float(ac[0])


def lcm(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    """denoised = c_skip x + c_out x0; x' = sqrt(ac') denoised + sqrt(1 - ac') noise (the last step: denoised).

    clip_sample clips x0 alone, so with it D is x0 and c_skip x goes to the a column."""
    T = sched.num_train_timesteps
    ts = consistency_timesteps(T, n, opts.original_steps, "lcm")
    ac = sched.alphas_cumprod
    it = ts.astype(np.int64)
    ac_t = ac[it]
    ac_prev = np.append(ac[it[1:]], 1.0)  # the last step returns denoised itself
    last = np.arange(n) == n - 1
    p, q = _pq_vp(np.sqrt(ac_t), np.sqrt(1.0 - ac_t), sched.prediction_type)
    st = ts * opts.timestep_scaling
    c_skip = 0.25 / (st**2 + 0.25)  # sigma_data = 0.5
    c_out = st / np.sqrt(st**2 + 0.25)
    keep, e = np.sqrt(ac_prev), np.where(last, 0.0, np.sqrt(1.0 - ac_prev))
    if opts.clip_sample_range is None:
        return _rows(ts, 1.0, c_skip + c_out * p, c_out * q, 0.0, keep, e=e), 1.0
    return _rows(ts, 1.0, p, q, keep * c_skip, 0.0, e=e, r=opts.clip_sample_range, k=keep * c_out), 1.0


def tcd(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    """x_s = sqrt(ac_s) x0 + sqrt(1 - ac_s) eps;  x' = sqrt(ac'/ac_s) x_s + sqrt(1 - ac'/ac_s) noise (eta > 0,
    not the last step), else x' = x_s."""
    T = sched.num_train_timesteps
    ts = consistency_timesteps(T, n, opts.original_steps, "tcd")
    ac = sched.alphas_cumprod
    it = ts.astype(np.int64)
    prev = np.append(it[1:], 0)
    s_t = np.floor((1.0 - opts.eta) * prev).astype(np.int64)
    ac_t, ac_s = ac[it], ac[s_t]
    ac_prev = ac[prev]  # prev >= 0 always here (the last step's prev is timestep 0)
    p, q = _pq_vp(np.sqrt(ac_t), np.sqrt(1.0 - ac_t), sched.prediction_type)
    # eps from (x, x0): (x - sqrt(ac_t) x0) / sqrt(1 - ac_t); x_s = A x + B x0
    A = np.sqrt(1.0 - ac_s) / np.sqrt(1.0 - ac_t)
    B = np.sqrt(ac_s) - A * np.sqrt(ac_t)
    noisy = (opts.eta > 0) & (np.arange(n) != n - 1)
    keep = np.where(noisy, np.sqrt(ac_prev / ac_s), 1.0)
    e = np.where(noisy, np.sqrt(np.maximum(1.0 - ac_prev / ac_s, 0.0)), 0.0)
    return _rows(ts, 1.0, p, q, keep * A, keep * B, e=e), 1.0


BUILDERS = {"lcm": lcm, "tcd": tcd}
