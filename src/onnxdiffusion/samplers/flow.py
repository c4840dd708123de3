"""Sampler rows for rectified-flow schedules (x = (1 - sigma) x0 + sigma noise).

The backbone predicts a velocity v = noise - x0, so the denoiser is D = x - sigma * v:
p = 1, q = -sigma in every row.  The model sees x unscaled (c_in = 1) and the timestep
sigma * num_train_timesteps; the loop starts from the noise itself (init_scale = 1).
"""

from __future__ import annotations

import math

import numpy as np

from .schedules import FlowSchedule
from . import sigmas as grids
from .dpm import dpmpp_rows, second_order_mask
from .options import SamplerOptions


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def _rows(ts, p, q, a, c, d=None, e=None):
    z = np.zeros(len(ts))
    cols = [ts, np.ones(len(ts)), p, q, a, c, z if d is None else d, z if e is None else e, z, z]
    return np.stack([np.broadcast_to(np.asarray(v, np.float64), (len(ts),)) for v in cols], axis=1)


def _flowmatch_grid(sched: FlowSchedule, n: int, mu, base, opts: SamplerOptions) -> tuple[np.ndarray, np.ndarray]:
    """FlowMatchEulerDiscreteScheduler.set_timesteps: (timesteps, step sigmas)."""
    s = sched.shifted(n, mu=mu, base=base)
    if opts.sigma_shape != "default":
        s = grids.reshape(opts.sigma_shape, s, n)
    s = _f32(s)
    return sched.timesteps(s), s


def flow_euler(sched: FlowSchedule, n: int, mu, base, opts: SamplerOptions):
    """x' = x + (s' - s) v == (s'/s) x + (1 - s'/s) D; stochastic_sampling: x' = (1 - s') D + s' noise."""
    ts, s = _flowmatch_grid(sched, n, mu, base, opts)
    s_next = np.append(s[1:], 0.0)
    if opts.stochastic:
        return _rows(ts, 1.0, -s, 0.0, 1.0 - s_next, e=s_next), 1.0
    a = s_next / s
    return _rows(ts, 1.0, -s, a, 1.0 - a), 1.0


def flow_heun(sched: FlowSchedule, n: int, mu, base, opts: SamplerOptions):
    """FlowMatchHeunDiscreteScheduler: two model calls per step, so two rows per step (one per call).

    Row 2i is an Euler step s_i -> s_i+1 (its result is Heun's predictor x~); row 2i+1 evaluates
    the model at (x~, s_i+1) and finishes the step.  Heun's x' = x + (s' - s)(v + v~)/2 written in
    what that row has (x~, its own D~ and the previous row's D):  x' = x~ + (s - s')/(2 s') (D~ - D).
    The last step (to sigma 0) is Euler alone, as in diffusers: 2n - 1 rows for n steps.
    """
    ts, s = _flowmatch_grid(sched, n, mu, base, opts)
    rows = []
    for i in range(n - 1):
        r = s[i + 1] / s[i]
        rows.append([ts[i], 1.0, 1.0, -s[i], r, 1.0 - r, 0.0, 0.0, 0.0, 0.0])
        k = (s[i] - s[i + 1]) / (2.0 * s[i + 1])
        rows.append([ts[i + 1], 1.0, 1.0, -s[i + 1], 1.0, k, -k, 0.0, 0.0, 0.0])
    rows.append([ts[-1], 1.0, 1.0, -s[-1], 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    return np.array(rows, np.float64), 1.0


def _dpm_flow_grid(sched: FlowSchedule, n: int, mu, base, opts: SamplerOptions):
    """DPMSolverMultistepScheduler with use_flow_sigmas: (timesteps, step sigmas)."""
    if base is not None:
        raise ValueError("DPM-Solver on flow sigmas takes no base sigmas (diffusers' set_timesteps has none)")
    if sched.use_dynamic_shifting and mu is None:
        raise ValueError("this flow schedule uses dynamic shifting: pass mu (or the image token count)")
    T = sched.num_train_timesteps
    k = math.exp(mu) if sched.use_dynamic_shifting else sched.shift  # diffusers sets flow_shift = exp(mu)
    # the same float64 operations as diffusers: timesteps are truncated, so one ulp can move one
    base = (1.0 - np.linspace(1, 1 / T, n + 1))[::-1][:-1]
    s = k * base / (1 + (k - 1) * base)
    return np.trunc(s * T), _f32(s)  # diffusers feeds int64 (truncated) timesteps


def dpmpp_2m(sched: FlowSchedule, n: int, mu, base, opts: SamplerOptions):
    """DPM-Solver++ (multistep, order <= 2) with flow sigmas: alpha = 1 - sigma."""
    grid = _dpm_flow_grid if opts.flow_grid == "dpm" else _flowmatch_grid
    ts, s = grid(sched, n, mu, base, opts)
    if opts.final_sigmas_type != "zero":
        raise ValueError("final_sigmas_type='sigma_min' with flow sigmas is not reproduced")
    s_next = np.append(s[1:], 0.0)
    second = second_order_mask(n, opts.solver_order, opts.lower_order_final, opts.euler_at_final, True)
    a, c, d, e = dpmpp_rows(1.0 - s, s, 1.0 - s_next, s_next, second, opts.solver_type, opts.sde)
    return _rows(ts, 1.0, -s, a, c, d, e), 1.0


BUILDERS = {"flow_euler": flow_euler, "flow_heun": flow_heun, "dpmpp_2m": dpmpp_2m}
