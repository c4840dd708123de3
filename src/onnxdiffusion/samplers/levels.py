"""Where each row of a sampler table sits between the clean image and the noise: the sampler's own
``add_noise`` as two numbers per row, and the table cut at a start row (img2img, inpainting).

Row i's state is ``x_i = signal_i * x0 + noise_i * eps`` in that sampler's state space: variance
preserving for DDIM and DPM-Solver++ (alpha_t, sigma_t), variance exploding for Euler (1, sigma),
rectified flow for every flow sampler (1 - sigma, sigma). The levels have one row more than the
table: after the last row the state is the image itself, (1, 0), which is the blend target
diffusers' inpaint pipelines use after their last step (they add no noise then).

A sampler whose levels are not known here has ``table.levels`` None; img2img refuses it.
"""

from __future__ import annotations

import numpy as np

from .schedules import FlowSchedule, NoiseSchedule
from .options import SamplerOptions


def _vp(alpha: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    return np.stack([alpha, sigma], axis=1)


def _ddim(sched: NoiseSchedule, n, spacing, opts):
    from .discrete import _ddim_timesteps

    ts = _ddim_timesteps(sched.num_train_timesteps, n, spacing, sched.steps_offset).astype(np.int64)
    ac = sched.alphas_cumprod[ts]  # DDIMScheduler.add_noise: alphas_cumprod at the timestep
    return _vp(np.sqrt(ac), np.sqrt(1.0 - ac))


def _euler(sched: NoiseSchedule, n, spacing, opts):
    from .discrete import _euler_grid

    _, s, _, _ = _euler_grid(sched, n, spacing, "euler", opts)  # add_noise: x0 + sigma * noise
    return _vp(np.ones_like(s), s)


def _euler_a(sched: NoiseSchedule, n, spacing, opts):
    return _euler(sched, n, spacing, SamplerOptions())


def _dpm(sched: NoiseSchedule, n, spacing, opts):
    from .discrete import _dpm_grid

    ts, s_all = _dpm_grid(sched, n, spacing, opts)
    s = s_all[:len(ts)]
    alpha = 1.0 / np.sqrt(s * s + 1.0)  # DPMSolverMultistepScheduler._sigma_to_alpha_sigma_t
    return _vp(alpha, s * alpha)


DISCRETE = {"ddim": _ddim, "euler": _euler, "euler_a": _euler_a, "dpmpp_2m": _dpm}


def table_levels(sampler: str, schedule, n: int, spacing: str | None, rows64: np.ndarray,
                 opts: SamplerOptions) -> np.ndarray | None:
    """(rows + 1, 2) float64 (signal, noise) per row, then (1, 0); None when not known for this sampler."""
    if isinstance(schedule, FlowSchedule):
        # every flow row has D = x - sigma * v (p = 1, q = -sigma): the row's sigma is -q
        p, q = rows64[:, 2], rows64[:, 3]
        if not np.all(p == 1.0):
            return None
        s = -q
        body = _vp(1.0 - s, s)  # scale_noise: sigma * noise + (1 - sigma) * x0
    elif isinstance(schedule, NoiseSchedule) and sampler in DISCRETE:
        from .schedules import check_spacing

        body = DISCRETE[sampler](schedule, n, check_spacing(schedule.timestep_spacing if spacing is None else spacing),
                                 opts)
        if len(body) != len(rows64):
            return None
    else:
        return None
    return np.concatenate([body, [[1.0, 0.0]]]).astype(np.float64)


def start_row(table, start_step: int, order: int | None = None) -> int:
    """The table row a generation that skips `start_step` sampler steps begins at (diffusers:
    ``timesteps[t_start * scheduler.order:]``; Heun tables hold two rows per step but the last)."""
    rows = table.num_steps
    if order is None:
        order = 2 if table.sampler == "flow_heun" else 1
    return min(start_step * order, rows)


def cut_rows(rows64: np.ndarray, start: int) -> np.ndarray:
    """The table's rows with row `start` made to start afresh: its multistep history term (d, times
    the previous row's D, which does not exist yet) folded into its own D, so a 2nd-order
    DPM-Solver++ row becomes the 1st-order step diffusers takes first after ``set_begin_index``."""
    from .columns import COLUMNS

    out = np.array(rows64, dtype=np.float64, copy=True)
    c, d = COLUMNS.index("c"), COLUMNS.index("d")
    out[start, c] += out[start, d]
    out[start, d] = 0.0
    return out
