"""Samplers as per-step coefficient tables.

Every sampler is reduced to rows ``(t, c_in, p, q, a, c, d, e)`` driving one loop::

    x = init_latents * init_scale
    D_prev = 0
    for t, c_in, p, q, a, c, d, e in rows:
        out = model(x * c_in, t)
        D = p * x + q * out                      # x0 estimate; p, q absorb the prediction type
        x = a * x + c * D + d * D_prev + e * noise[i]
        D_prev = D

Each sampler lives in the same state space as its diffusers twin (DDIMScheduler,
EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler
with dpmsolver++/order 2) and reproduces that scheduler's own ``set_timesteps``;
the three schedulers disagree on what "leading"/"linspace" mean, so each has its
own timestep function below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..schedules import FlowSchedule, NoiseSchedule, check_spacing
from . import flow

DISCRETE_SAMPLERS = ("ddim", "euler", "euler_a", "dpmpp_2m")  # for betas-derived schedules
FLOW_SAMPLERS = ("flow_euler",)  # for rectified-flow schedules
SAMPLERS = DISCRETE_SAMPLERS + FLOW_SAMPLERS
COLUMNS = ("t", "c_in", "p", "q", "a", "c", "d", "e")


@dataclass(frozen=True, eq=False)
class SamplerTable:
    sampler: str
    rows: np.ndarray  # float32 (num_steps, 8): what ONNX graphs consume
    init_scale: float
    needs_noise: bool
    rows64: np.ndarray | None = field(repr=False, default=None)  # same table before the float32 cast

    def __post_init__(self) -> None:
        if self.rows.ndim != 2 or self.rows.shape[1] != len(COLUMNS) or self.rows.shape[0] < 1:
            raise ValueError(f"rows must have shape (num_steps >= 1, {len(COLUMNS)}), got {self.rows.shape}")
        if self.rows64 is None:
            object.__setattr__(self, "rows64", self.rows.astype(np.float64))

    @property
    def num_steps(self) -> int:
        return int(self.rows.shape[0])

    @property
    def timesteps(self) -> np.ndarray:
        return self.rows[:, 0]

    def column(self, name: str) -> np.ndarray:
        return self.rows[:, COLUMNS.index(name)]


# --- timesteps -----------------------------------------------------------------------------

def _trailing(T: int, n: int) -> np.ndarray:
    # Same float arange as diffusers so ties at .5 round identically.  That arange
    # sometimes yields n+1 values (n = 61, 103, 121, ... for T=1000), the extra one
    # becoming timestep -1; diffusers then runs n+1 steps.  We keep exactly n.
    return np.round(np.arange(T, 0, -T / n))[:n] - 1


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


def _dpm_timesteps(T: int, n: int, spacing: str, offset: int) -> np.ndarray:
    # DPMSolver spaces n+1 points and drops the one at 0, so its grid is coarser than DDIM's.
    if spacing == "linspace":
        return np.round(np.linspace(0, T - 1, n + 1))[::-1][:-1]
    if spacing == "leading":
        return np.arange(n, 0, -1) * (T // (n + 1)) + offset
    return _trailing(T, n)


def _check_timesteps(ts: np.ndarray, sched: NoiseSchedule, sampler: str, spacing: str) -> np.ndarray:
    T = sched.num_train_timesteps
    if ts.min() < 0 or ts.max() > T - 1 or (len(ts) > 1 and np.any(np.diff(ts) >= 0)):
        raise ValueError(
            f"{sampler} with {spacing!r} spacing, {len(ts)} steps and steps_offset={sched.steps_offset} gives "
            f"timesteps that are not strictly decreasing within [0, {T - 1}]; use fewer steps or another spacing"
        )
    return ts.astype(np.float64)


# --- denoiser adapters (x0 = p*x + q*out) --------------------------------------------------

def _pq_vp(alpha: np.ndarray, sigma: np.ndarray, prediction_type: str) -> tuple[np.ndarray, np.ndarray]:
    """x0 from a variance-preserving state x = alpha*x0 + sigma*eps."""
    if prediction_type == "epsilon":
        return 1.0 / alpha, -sigma / alpha
    return alpha, -sigma  # v = alpha*eps - sigma*x0


def _pq_ve(s: np.ndarray, prediction_type: str) -> tuple[np.ndarray, np.ndarray]:
    """x0 from a variance-exploding state x = x0 + s*eps (the model sees x / sqrt(s^2+1))."""
    if prediction_type == "epsilon":
        return np.ones_like(s), -s
    return 1.0 / (s * s + 1.0), -s / np.sqrt(s * s + 1.0)


# --- samplers ------------------------------------------------------------------------------

def _ddim(sched: NoiseSchedule, n: int, spacing: str):
    T = sched.num_train_timesteps
    ts = _check_timesteps(_ddim_timesteps(T, n, spacing, sched.steps_offset), sched, "ddim", spacing)
    ac = sched.alphas_cumprod
    ac_t = ac[ts.astype(np.int64)]
    # diffusers steps to t - T//n whatever the spacing, so for "linspace"/"trailing"
    # the target noise level need not be the next row's timestep.  Reproduced on purpose.
    prev = ts.astype(np.int64) - T // n
    final = 1.0 if sched.set_alpha_to_one else ac[0]
    ac_prev = np.where(prev >= 0, ac[np.maximum(prev, 0)], final)
    p, q = _pq_vp(np.sqrt(ac_t), np.sqrt(1.0 - ac_t), sched.prediction_type)
    # eta=0 DDIM: x' = sqrt(ac')*x0 + sqrt(1-ac')*eps with eps re-derived from (x, x0).
    a = np.sqrt(1.0 - ac_prev) / np.sqrt(1.0 - ac_t)
    c = np.sqrt(ac_prev) - a * np.sqrt(ac_t)
    zeros = np.zeros(n)
    return np.stack([ts, np.ones(n), p, q, a, c, zeros, zeros], axis=1), 1.0


def _euler_sigmas(sched: NoiseSchedule, n: int, spacing: str, name: str):
    T = sched.num_train_timesteps
    ts = _check_timesteps(_euler_timesteps(T, n, spacing, sched.steps_offset), sched, name, spacing)
    s = np.interp(ts, np.arange(T), sched.sigmas)
    s_next = np.append(s[1:], 0.0)
    smax = s.max()
    # diffusers' init_noise_sigma: sqrt(smax^2+1) only for "leading", smax otherwise.
    init = np.sqrt(smax * smax + 1.0) if spacing == "leading" else smax
    return ts, s, s_next, float(init)


def _euler(sched: NoiseSchedule, n: int, spacing: str):
    ts, s, s_next, init = _euler_sigmas(sched, n, spacing, "euler")
    p, q = _pq_ve(s, sched.prediction_type)
    a = s_next / s
    zeros = np.zeros(n)
    return np.stack([ts, 1.0 / np.sqrt(s * s + 1.0), p, q, a, 1.0 - a, zeros, zeros], axis=1), init


def _euler_a(sched: NoiseSchedule, n: int, spacing: str):
    ts, s, s_next, init = _euler_sigmas(sched, n, spacing, "euler_a")
    p, q = _pq_ve(s, sched.prediction_type)
    s_up = np.sqrt(s_next**2 * (s**2 - s_next**2) / s**2)
    s_down = s_next**2 / s  # == sqrt(s_next^2 - s_up^2), without the cancellation
    a = s_down / s
    zeros = np.zeros(n)
    return np.stack([ts, 1.0 / np.sqrt(s * s + 1.0), p, q, a, 1.0 - a, zeros, s_up], axis=1), init


def _dpmpp_2m(sched: NoiseSchedule, n: int, spacing: str):
    T = sched.num_train_timesteps
    ts = _check_timesteps(_dpm_timesteps(T, n, spacing, sched.steps_offset), sched, "dpmpp_2m", spacing)
    s = np.interp(ts, np.arange(T), sched.sigmas)
    alpha = 1.0 / np.sqrt(s * s + 1.0)
    sig = s * alpha
    p, q = _pq_vp(alpha, sig, sched.prediction_type)
    lam = -np.log(s)  # log(alpha/sigma)
    a, c, d = np.zeros(n), np.ones(n), np.zeros(n)  # last step lands on sigma=0: x = D
    for i in range(n - 1):
        h = lam[i + 1] - lam[i]
        a[i] = sig[i + 1] / sig[i]
        c1 = -alpha[i + 1] * np.expm1(-h)
        if i == 0:  # no history yet: first order (== DDIM)
            c[i] = c1
        else:  # midpoint 2nd order: D + (D - D_prev) / (2 r)
            r = (lam[i] - lam[i - 1]) / h
            c[i], d[i] = c1 * (1.0 + 0.5 / r), -c1 * 0.5 / r
    # lower_order_final only matters for the last step, which final_sigmas_type="zero"
    # already forces to first order, so no extra case for n < 15.
    return np.stack([ts, np.ones(n), p, q, a, c, d, np.zeros(n)], axis=1), 1.0


_DISCRETE = {"ddim": _ddim, "euler": _euler, "euler_a": _euler_a, "dpmpp_2m": _dpmpp_2m}
_FLOW = {"flow_euler": flow.flow_euler}
_NOISY = frozenset({"euler_a"})


def _discrete_rows(sampler, schedule: NoiseSchedule, n, spacing, mu, sigmas):
    if mu is not None or sigmas is not None:
        raise ValueError("mu and base sigmas apply to flow-matching schedules only")
    return _DISCRETE[sampler](schedule, n, check_spacing(schedule.timestep_spacing if spacing is None else spacing))


def _flow_rows(sampler, schedule: FlowSchedule, n, spacing, mu, sigmas):
    if spacing is not None:
        raise ValueError("timestep spacing does not apply to flow-matching schedules")
    return _FLOW[sampler](schedule, schedule.sigmas(n, mu=mu, base=sigmas))


# One entry per schedule kind: its samplers and how a row table is made from it.
_KINDS = {NoiseSchedule: (_DISCRETE, _discrete_rows), FlowSchedule: (_FLOW, _flow_rows)}


def samplers_for(schedule: NoiseSchedule | FlowSchedule) -> tuple[str, ...]:
    """The samplers that apply to this kind of schedule."""
    return tuple(_KINDS[type(schedule)][0])


def build_table(sampler: str, schedule: NoiseSchedule | FlowSchedule, num_steps: int, spacing: str | None = None,
                *, mu: float | None = None, sigmas: np.ndarray | None = None) -> SamplerTable:
    """The coefficient table for `num_steps` steps of `sampler` on `schedule`.

    `mu` (dynamic shifting) and `sigmas` (caller-given base sigmas, as diffusers' ``set_timesteps(sigmas=)``)
    apply to flow schedules only; `spacing` overrides a discrete schedule's timestep spacing.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    builders, rows_of = _KINDS[type(schedule)]
    if sampler not in builders:
        raise ValueError(f"sampler {sampler!r} does not apply to this schedule; expected one of {tuple(builders)}")
    n = schedule.check_steps(num_steps)
    rows64, init_scale = rows_of(sampler, schedule, n, spacing, mu, sigmas)
    rows64 = np.ascontiguousarray(rows64, dtype=np.float64)
    rows = rows64.astype(np.float32)
    rows.setflags(write=False)
    rows64.setflags(write=False)
    return SamplerTable(sampler=sampler, rows=rows, init_scale=float(init_scale),
                        needs_noise=sampler in _NOISY, rows64=rows64)
