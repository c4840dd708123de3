"""PNDM (PLMS) and UniPC rows: multistep methods whose memory is longer than one D_prev.

Both schedulers keep state diffusers hides in attributes (PNDM's ``ets`` and ``cur_sample``, UniPC's
``model_outputs`` and ``last_sample``, whose corrector rewrites the sample the model has just seen).
Rather than re-deriving closed forms, each builder runs the scheduler's own algorithm once on
*symbols*: every tensor is a vector of coefficients over the basis (initial x, H_0, H_1, ...), H_j
being the j-th model evaluation's history value (its D, or for PNDM its raw output).  Everything the
schedulers do is linear in those, so each step's result x_{i+1} is such a vector too, and
``x_{i+1} = a x_i + sum_L coef_L H_{i-L}`` falls out by one division (the x_init coefficient) and a
subtraction; lags beyond the table's history columns must vanish (checked).  Recovering a past
sample from the current one divides by a step's x coefficient, which is > 0 on every step but one
to sigma 0, after which nothing runs.
"""

from __future__ import annotations

import numpy as np

from .schedules import NoiseSchedule
from . import sigmas as grids
from .discrete import _check_timesteps, _f32, _log32, _pq_vp, _trailing
from .options import SamplerOptions


class _Trace:
    """Symbolic tensors over (x_init, H_0 .. H_{n-1}) and the rows they reduce to."""

    def __init__(self, n: int):
        self.n = n
        self.rows_a: list[float] = []
        self.rows_h: list[list[float]] = []  # per step: coefficients on H_i (lag 0), H_{i-1}, ...

    def x_init(self) -> np.ndarray:
        v = np.zeros(1 + self.n)
        v[0] = 1.0
        return v

    def h(self, i: int) -> np.ndarray:
        v = np.zeros(1 + self.n)
        v[1 + i] = 1.0
        return v

    def step(self, i: int, x_cur: np.ndarray, x_next: np.ndarray) -> None:
        """Record x_next = a x_cur + sum_L coef_L H_{i-L}."""
        a = x_next[0] / x_cur[0]
        res = x_next - a * x_cur
        scale = 1.0 + float(np.abs(x_next).max())
        if abs(res[0]) > 1e-9 * scale or np.any(np.abs(res[2 + i:]) > 1e-9 * scale):
            raise AssertionError("multistep trace: the step is not a function of past history")  # a bug, not input
        self.rows_a.append(float(a))
        self.rows_h.append([float(res[1 + i - lag]) for lag in range(i + 1)])

    def columns(self, depth_max: int) -> tuple[np.ndarray, np.ndarray]:
        """(a per step, (steps, depth) lag coefficients), depth = the longest lag used + 1."""
        n = len(self.rows_a)
        scale = max(1.0, max(max(abs(c) for c in h) for h in self.rows_h))
        depth = 1
        for h in self.rows_h:
            used = [lag for lag, c in enumerate(h) if abs(c) > 1e-12 * scale]
            depth = max(depth, (max(used) + 1) if used else 1)
        if depth > depth_max:
            raise AssertionError(f"multistep trace needs {depth - 1} past values, more than {depth_max - 1}")
        lags = np.zeros((n, depth))
        for i, h in enumerate(self.rows_h):
            m = min(len(h), depth)
            lags[i, :m] = h[:m]
            # the dropped tail is below 1e-12 of the largest coefficient: round it away
        return np.array(self.rows_a), lags


def _assemble(ts, c_in, p, q, a, lags, of_output: bool, e=None) -> np.ndarray:
    """Rows from per-step a and lag coefficients; an output history's lag-0 term goes through D."""
    n = len(ts)
    lag0 = lags[:, 0]
    if of_output:  # coef * out_i == coef/q * D_i - coef*p/q * x_i
        c = lag0 / q
        a = a - lag0 * p / q
    else:
        c = lag0
    z = np.zeros(n)
    d = lags[:, 1] if lags.shape[1] > 1 else z
    cols = [ts, np.broadcast_to(c_in, (n,)), p, q, a, c, d, z if e is None else e, z, z]
    cols += [lags[:, j] for j in range(2, lags.shape[1])]
    return np.stack([np.asarray(v, np.float64) for v in cols], axis=1)


# --- PNDM (PLMS with skip_prk_steps, as Stable Diffusion folders ship it) -------------------------

def _pndm_timesteps(T: int, n: int, spacing: str, offset: int) -> np.ndarray:
    if spacing == "linspace":
        base = np.round(np.linspace(0, T - 1, n)).astype(np.int64)
    elif spacing == "leading":
        base = np.arange(0, n) * (T // n) + offset
    else:
        base = (np.round(np.arange(T, 0, -T / n))[::-1] - 1).astype(np.int64)[-n:]
    return np.concatenate([base[:-1], base[-2:-1], base[-1:]])[::-1]


def pndm(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    """PNDMScheduler.step_plms: n + 1 model calls for n steps (its second timestep is run twice)."""
    if not opts.skip_prk_steps:
        raise ValueError("PNDM's Runge-Kutta warm-up (skip_prk_steps=False) is not reproduced; "
                         "Stable Diffusion folders ship skip_prk_steps=true")
    T = sched.num_train_timesteps
    ts = _pndm_timesteps(T, n, spacing, sched.steps_offset).astype(np.float64)
    if len(ts) < 1 or ts.min() < 0 or ts.max() > T - 1 or np.any(np.diff(ts) > 0):
        raise ValueError(f"pndm with {spacing!r} spacing, {n} steps and steps_offset={sched.steps_offset} gives "
                         f"timesteps outside [0, {T - 1}]; use fewer steps or another spacing")
    ac = sched.alphas_cumprod
    final = 1.0 if sched.set_alpha_to_one else ac[0]
    ratio = T // n
    v_pred = sched.prediction_type == "v_prediction"
    tr = _Trace(len(ts))
    x, cur, ets = tr.x_init(), None, []
    for i, t in enumerate(ts.astype(np.int64)):
        o = tr.h(i)
        prev_t = t - ratio
        if i != 1:
            ets = ets[-3:] + [o]
        else:
            prev_t, t = t, t + ratio
        sample = x
        if len(ets) == 1 and i == 0:
            e, cur = o, x
        elif len(ets) == 1 and i == 1:
            e, sample = (o + ets[-1]) / 2, cur
        elif len(ets) == 2:
            e = (3 * ets[-1] - ets[-2]) / 2
        elif len(ets) == 3:
            e = (23 * ets[-1] - 16 * ets[-2] + 5 * ets[-3]) / 12
        else:
            e = (55 * ets[-1] - 59 * ets[-2] + 37 * ets[-3] - 9 * ets[-4]) / 24
        a_t, a_prev = ac[t], (ac[prev_t] if prev_t >= 0 else final)
        if v_pred:
            e = np.sqrt(a_t) * e + np.sqrt(1 - a_t) * sample
        denom = a_t * np.sqrt(1 - a_prev) + np.sqrt(a_t * (1 - a_t) * a_prev)
        x_next = np.sqrt(a_prev / a_t) * sample - (a_prev - a_t) * e / denom
        tr.step(i, x, x_next)
        x = x_next
    a, lags = tr.columns(5)
    it = ts.astype(np.int64)
    p, q = _pq_vp(np.sqrt(ac[it]), np.sqrt(1.0 - ac[it]), sched.prediction_type)
    return _assemble(ts, 1.0, p, q, a, lags, of_output=True), 1.0, "output"


# --- UniPC (bh1 / bh2, predictor-corrector in x0 space) ---------------------------------------

def _unipc_grid(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    """UniPCMultistepScheduler.set_timesteps on a betas schedule: (timesteps, sigmas incl. the final one)."""
    T = sched.num_train_timesteps
    if spacing == "linspace":
        ts = np.round(np.linspace(0, T - 1, n + 1))[::-1][:-1]
    elif spacing == "leading":
        ts = np.arange(n, 0, -1) * (T // (n + 1)) + sched.steps_offset
    else:
        ts = _trailing(T, n)
    ts = _check_timesteps(ts.astype(np.float64), sched, "unipc", spacing)
    train = sched.sigmas_floored
    log_train = _log32(train)
    if opts.sigma_shape == "default":
        s = np.interp(ts, np.arange(T), train)
        last = train[0] if opts.final_sigmas_type == "sigma_min" else 0.0
    else:
        s = grids.reshape(opts.sigma_shape, train[::-1], n)
        t = grids.sigma_to_t(s, log_train)
        ts = np.round(t) if opts.sigma_shape == "karras" else t
        last = 0.0  # sigma_min with a reshaped grid repeats its last sigma (h = 0): refused in config
    return np.trunc(ts), _f32(np.append(s, last))


def _unipc_coeffs(lam: np.ndarray, k: int, order: int, bh2: bool, corrector: bool):
    """(h_phi_1, B_h, rks, D1 weights rhos) of UniP (predictor, from step k) or UniC (corrector at step k)."""
    s0 = k - 1 if corrector else k
    h = (lam[k] if corrector else lam[k + 1]) - lam[s0]
    rks = [(lam[s0 - j] - lam[s0]) / h for j in range(1, order)] + [1.0]
    hh = -h
    h_phi_1 = np.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    fact = 1
    B_h = np.expm1(hh) if bh2 else hh
    R, b = [], []
    for j in range(1, order + 1):
        R.append(np.power(rks, j - 1))
        b.append(h_phi_k * fact / B_h)
        fact *= j + 1
        h_phi_k = h_phi_k / hh - 1 / fact
    R, b = np.array(R), np.array(b)
    if corrector:
        rhos = np.array([0.5]) if order == 1 else np.linalg.solve(R, b)
    elif order == 1:
        rhos = np.zeros(0)
    else:
        rhos = np.array([0.5]) if order == 2 else np.linalg.solve(R[:-1, :-1], b[:-1])
    return h_phi_1, B_h, np.array(rks), rhos


def unipc(sched: NoiseSchedule, n: int, spacing: str, opts: SamplerOptions):
    """UniPCMultistepScheduler.step (predict_x0): the corrector rewrites x_i once D_i is known, then the predictor."""
    ts, s_all = _unipc_grid(sched, n, spacing, opts)
    n = len(ts)
    alpha_all = 1.0 / np.sqrt(s_all * s_all + 1.0)
    sig_all = s_all * alpha_all
    with np.errstate(divide="ignore"):
        lam = np.log(alpha_all) - np.log(sig_all)
    order_max, bh2 = opts.solver_order, opts.unipc_solver == "bh2"
    tr = _Trace(n)
    x, last, outs, this_order, lower = tr.x_init(), None, [], 1, 0
    for i in range(n):
        m_t = tr.h(i)
        sample = x
        if i > 0 and (i - 1) not in opts.disable_corrector and last is not None:
            phi, B_h, rks, rhos = _unipc_coeffs(lam, i, this_order, bh2, True)
            m0 = outs[-1]
            corr = sum((rhos[j] * (outs[-(j + 2)] - m0) / rks[j] for j in range(this_order - 1)), np.zeros_like(x))
            sample = (sig_all[i] / sig_all[i - 1] * last - alpha_all[i] * phi * m0
                      - alpha_all[i] * B_h * (corr + rhos[-1] * (m_t - m0)))
        outs = (outs + [m_t])[-order_max:]
        this_order = min(order_max, n - i) if opts.lower_order_final else order_max
        this_order = min(this_order, lower + 1)
        last = sample
        phi, B_h, rks, rhos = _unipc_coeffs(lam, i, this_order, bh2, False)
        m0 = outs[-1]
        pred = sum((rhos[j] * (outs[-(j + 2)] - m0) / rks[j] for j in range(this_order - 1)), np.zeros_like(x))
        x_next = sig_all[i + 1] / sig_all[i] * sample - alpha_all[i + 1] * phi * m0 - alpha_all[i + 1] * B_h * pred
        lower = min(lower + 1, order_max)
        tr.step(i, x, x_next)
        x = x_next
    a, lags = tr.columns(2 * order_max + 1)
    alpha, sigma = alpha_all[:n], sig_all[:n]
    p, q = _pq_vp(alpha, sigma, sched.prediction_type, s_all[:n])
    return _assemble(ts, 1.0, p, q, a, lags, of_output=False), 1.0, "denoised"


BUILDERS = {"pndm": pndm, "unipc": unipc}
