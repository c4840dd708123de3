"""Sampler rows for betas-derived (discrete-time) schedules.

Each sampler lives in the same state space as its diffusers twin (DDIMScheduler,
EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler) and
reproduces that scheduler's own ``set_timesteps``; the schedulers disagree on what
"leading"/"linspace" mean, so each has its own timestep function below.
"""

from __future__ import annotations

import numpy as np

from .schedules import NoiseSchedule
from . import sigmas as grids
from .dpm import dpmpp_rows, second_order_mask
from .options import SamplerOptions


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def _log32(a: np.ndarray) -> np.ndarray:
    """log in float32, as diffusers takes it of its float32 sigmas: timesteps are truncated later, so
    a 1-ulp difference in the lookup can move a timestep by one."""
    return np.log(a.astype(np.float32)).astype(np.float64)


# --- timesteps -----------------------------------------------------------------------------

def _trailing(T: int, n: int, last: int | None = None) -> np.ndarray:
    # Same float arange as diffusers so ties at .5 round identically.  That arange
    # sometimes yields n+1 values (n = 61, 103, 121, ... for T=1000), the extra one
    # becoming timestep -1; diffusers then runs n+1 steps.  We keep exactly n.
    return np.round(np.arange(T if last is None else last, 0, -T / n))[:n] - 1


def _leading(T: int, n: int, offset: int) -> np.ndarray:
    return np.arange(n - 1, -1, -1) * (T // n) + offset


def _ddim_timesteps(T: int, n: int, spacing: str, offset: int) -> np.ndarray:
    if spacing == "linspace":
        return np.round(np.linspace(0, T - 1, n))[::-1]
    if spacing == "leading":
        return _leading(T, n, offset)
    return _trailing(T, n)


def _euler_timesteps(T: int, n: int, spacing: str, offset: int) -> np.ndarray:
    if spacing == "linspace":  # not rounded: fractional timesteps, sigmas interpolated
        return np.linspace(0, T - 1, n, dtype=np.float32)[::-1].astype(np.float64)
    if spacing == "leading":
        return _leading(T, n, offset)
    return _trailing(T, n)


def _dpm_timesteps(T: int, n: int, spacing: str, offset: int, last: int) -> np.ndarray:
    # DPMSolver spaces n+1 points and drops the one at 0, so its grid is coarser than DDIM's;
    # `last` < T when lambda_min_clipped cuts off the noisiest timesteps.
    if spacing == "linspace":
        return np.round(np.linspace(0, last - 1, n + 1))[::-1][:-1]
    if spacing == "leading":
        return np.arange(n, 0, -1) * (last // (n + 1)) + offset
    return _trailing(T, n, last)


def _check_timesteps(ts: np.ndarray, sched: NoiseSchedule, sampler: str, spacing: str) -> np.ndarray:
    T = sched.num_train_timesteps
    if len(ts) < 1 or ts.min() < 0 or ts.max() > T - 1 or (len(ts) > 1 and np.any(np.diff(ts) >= 0)):
        raise ValueError(
            f"{sampler} with {spacing!r} spacing, {len(ts)} steps and steps_offset={sched.steps_offset} gives "
            f"timesteps that are not strictly decreasing within [0, {T - 1}]; use fewer steps or another spacing"
        )
    return ts.astype(np.float64)


# --- denoiser adapters (x0 = p*x + q*out) --------------------------------------------------

def _pq_vp(alpha: np.ndarray, sigma: np.ndarray, prediction_type: str, s_ve: np.ndarray | None = None):
    """x0 from a state x = alpha*x0 + sigma*eps (variance preserving)."""
    rules = {
        "epsilon": lambda: (1.0 / alpha, -sigma / alpha),
        "v_prediction": lambda: (alpha, -sigma),  # v = alpha*eps - sigma*x0
        "sample": lambda: (np.zeros_like(alpha), np.ones_like(alpha)),
        # DPMSolver's flow_prediction on a betas schedule: x - s*out with the VE sigma, as diffusers does
        "flow_prediction": lambda: (np.ones_like(alpha), -(sigma if s_ve is None else s_ve)),
    }
    return rules[prediction_type]()


def _pq_ve(s: np.ndarray, prediction_type: str):
    """x0 from a variance-exploding state x = x0 + s*eps (the model sees x / sqrt(s^2+1))."""
    rules = {
        "epsilon": lambda: (np.ones_like(s), -s),
        "v_prediction": lambda: (1.0 / (s * s + 1.0), -s / np.sqrt(s * s + 1.0)),
        "sample": lambda: (np.zeros_like(s), np.ones_like(s)),
    }
    if prediction_type not in rules:
        raise ValueError(f"prediction_type={prediction_type!r} is not reproduced by this sampler")
    return rules[prediction_type]()


def _rows(ts, c_in, p, q, a, c, d=None, e=None, r=None, k=None):
    z = np.zeros(len(ts))
    cols = [ts, c_in, p, q, a, c] + [z if v is None else v for v in (d, e, r, k)]
    return np.stack([np.broadcast_to(np.asarray(v, np.float64), (len(ts),)) for v in cols], axis=1)


# --- samplers ------------------------------------------------------------------------------

def ddim(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    T = sched.num_train_timesteps
    ts = _check_timesteps(_ddim_timesteps(T, n, spacing, sched.steps_offset), sched, "ddim", spacing)
    ac = sched.alphas_cumprod
    ac_t = ac[ts.astype(np.int64)]
    # diffusers steps to t - T//n whatever the spacing, so for "linspace"/"trailing"
    # the target noise level need not be the next row's timestep.  Reproduced on purpose.
    prev = ts.astype(np.int64) - T // n
    final = 1.0 if sched.set_alpha_to_one else ac[0]
    ac_prev = np.where(prev >= 0, ac[np.maximum(prev, 0)], final)
    with np.errstate(divide="ignore", invalid="ignore"):
        p, q = _pq_vp(np.sqrt(ac_t), np.sqrt(1.0 - ac_t), sched.prediction_type)
        # eta=0 DDIM: x' = sqrt(ac')*x0 + sqrt(1-ac')*eps, eps re-derived from (x, unclipped x0).
        a = np.sqrt(1.0 - ac_prev) / np.sqrt(1.0 - ac_t)
    if opts.clip_sample_range is None:
        return _rows(ts, 1.0, p, q, a, np.sqrt(ac_prev) - a * np.sqrt(ac_t)), 1.0
    # clip_sample clips only the x0 term: x' = a x - a sqrt(ac) D + sqrt(ac') clip(D)
    return _rows(ts, 1.0, p, q, a, -a * np.sqrt(ac_t), r=opts.clip_sample_range, k=np.sqrt(ac_prev)), 1.0


def _euler_grid(sched: NoiseSchedule, n: int, spacing: str, name: str, opts: SamplerOptions):
    """EulerDiscreteScheduler.set_timesteps: (timesteps, step sigmas, next sigmas, init_noise_sigma)."""
    T = sched.num_train_timesteps
    ts = _check_timesteps(_euler_timesteps(T, n, spacing, sched.steps_offset), sched, name, spacing)
    train = sched.sigmas_floored
    log_train = _log32(train)
    if opts.interpolation_type == "linear":
        s = np.interp(ts, np.arange(T), train)
    else:  # log_linear: n+1 log-spaced sigmas over the training range, whatever the timesteps
        s = np.exp(np.linspace(log_train[-1], log_train[0], n + 1))
    if opts.sigma_shape != "default":
        s = grids.reshape(opts.sigma_shape, s, n, opts.sigma_min, opts.sigma_max)
        ts = grids.sigma_to_t(s, log_train)
    last = 0.0 if opts.final_sigmas_type == "zero" else train[0]
    s_all = _f32(np.append(s, last))
    if opts.timestep_type == "continuous" and sched.prediction_type == "v_prediction":
        ts = 0.25 * np.log(s_all[:n])
    ts = _f32(ts)
    smax = s_all.max()
    # diffusers' init_noise_sigma: sqrt(smax^2+1) only for "leading", smax otherwise.
    init = np.sqrt(smax * smax + 1.0) if spacing == "leading" else smax
    return ts, s_all[:n], s_all[1:n + 1], float(init)


def euler(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    ts, s, s_next, init = _euler_grid(sched, n, spacing, "euler", opts)
    p, q = _pq_ve(s, sched.prediction_type)
    a = s_next / s
    return _rows(ts, 1.0 / np.sqrt(s * s + 1.0), p, q, a, 1.0 - a), init


def euler_a(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    ts, s, s_next, init = _euler_grid(sched, n, spacing, "euler_a", SamplerOptions())
    p, q = _pq_ve(s, sched.prediction_type)
    s_up = np.sqrt(s_next**2 * (s**2 - s_next**2) / s**2)
    s_down = s_next**2 / s  # == sqrt(s_next^2 - s_up^2), without the cancellation
    a = s_down / s
    return _rows(ts, 1.0 / np.sqrt(s * s + 1.0), p, q, a, 1.0 - a, e=s_up), init


def _dpm_grid(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    """DPMSolverMultistepScheduler.set_timesteps on a betas schedule: (timesteps, sigmas incl. the final one)."""
    T = sched.num_train_timesteps
    ac32 = sched.alphas_cumprod_floored.astype(np.float32)
    lam = (np.log(np.sqrt(ac32)) - np.log(np.sqrt(np.float32(1) - ac32))).astype(np.float32)
    last_t = T - int(np.searchsorted(lam[::-1], np.float32(opts.lambda_min_clipped)))
    ts = _check_timesteps(_dpm_timesteps(T, n, spacing, sched.steps_offset, last_t), sched, "dpmpp_2m", spacing)
    train = sched.sigmas_floored
    log_train = _log32(train)
    rounds = sched.beta_schedule != "squaredcos_cap_v2"
    shape = opts.sigma_shape
    if shape == "default":
        s = np.interp(ts, np.arange(T), train)
    else:
        if shape == "lu":  # uniform in log sigma over the training range
            s = np.exp(np.linspace(log_train[-1], log_train[0], n))
        else:
            s = grids.reshape(shape, train[::-1], n)
        t = grids.sigma_to_t(s, log_train)
        ts = np.round(t) if rounds and shape in ("karras", "lu") else t
    last = 0.0 if opts.final_sigmas_type == "zero" else train[0]
    return np.trunc(ts), _f32(np.append(s, last))  # diffusers stores int64 timesteps


def dpmpp_2m(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    ts, s_all = _dpm_grid(sched, n, spacing, opts)
    n = len(ts)
    with np.errstate(divide="ignore"):
        alpha_all = 1.0 / np.sqrt(s_all * s_all + 1.0)
    sig_all = s_all * alpha_all
    alpha, sigma = alpha_all[:n], sig_all[:n]
    p, q = _pq_vp(alpha, sigma, sched.prediction_type, s_all[:n])
    second = second_order_mask(n, opts.solver_order, opts.lower_order_final, opts.euler_at_final,
                               opts.final_sigmas_type == "zero")
    a, c, d, e = dpmpp_rows(alpha, sigma, alpha_all[1:n + 1], sig_all[1:n + 1], second, opts.solver_type, opts.sde)
    return _rows(ts, 1.0, p, q, a, c, d, e), 1.0


BUILDERS = {"ddim": ddim, "euler": euler, "euler_a": euler_a, "dpmpp_2m": dpmpp_2m}
