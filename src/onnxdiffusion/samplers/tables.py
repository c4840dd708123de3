"""Samplers as per-step coefficient tables: the contract between numpy and ONNX loops.

Row i of a table holds (t, c_in, p, q, a, c, d, e, r, k); one step is

    out = model(x * c_in, t)
    D   = p * x + q * out                          # x0 estimate (prediction type folded into p, q)
    x   = a * x + c * D + d * D_prev + e * noise_i + k * clip(D, -r, r)

D_prev is the previous row's D (0 before the first).  x starts as latents * init_scale.  Only the
last column pair is nonlinear: DDIM's clip_sample clips the x0 term alone (k = 0 elsewhere).  A row
is one model evaluation: a sampler that calls the model twice per step (Heun) has two rows per step.

The rows come from a schedule object, one kind per family of schedules: `NoiseSchedule`
(betas-derived; DDIM, Euler, Euler ancestral, DPM-Solver++) and `FlowSchedule` (rectified flow;
flow-match Euler and Heun, DPM-Solver++ with flow sigmas); see ``discrete`` and ``flow``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..schedules import FlowSchedule, NoiseSchedule, check_spacing
from . import discrete, flow
from .options import SamplerOptions

COLUMNS = ("t", "c_in", "p", "q", "a", "c", "d", "e", "r", "k")
DISCRETE_SAMPLERS = tuple(discrete.BUILDERS)
FLOW_SAMPLERS = ("flow_euler", "flow_heun", "dpmpp_2m")
SAMPLERS = DISCRETE_SAMPLERS + tuple(s for s in FLOW_SAMPLERS if s not in DISCRETE_SAMPLERS)


@dataclass(frozen=True, eq=False)
class SamplerTable:
    sampler: str
    rows: np.ndarray  # float32 (num_steps, len(COLUMNS)): what ONNX graphs consume
    init_scale: float
    needs_noise: bool
    rows64: np.ndarray | None = field(repr=False, default=None)  # same table before the float32 cast
    # (rows + 1, 2) float64: each row's state as signal * x0 + noise * eps, then (1, 0); None: unknown
    # for this sampler (levels.py; img2img and inpainting need it)
    levels: np.ndarray | None = field(repr=False, default=None)

    def __post_init__(self) -> None:
        if self.rows.ndim != 2 or self.rows.shape[1] != len(COLUMNS) or self.rows.shape[0] < 1:
            raise ValueError(f"rows must have shape (num_steps >= 1, {len(COLUMNS)}), got {self.rows.shape}")
        if self.rows64 is None:
            object.__setattr__(self, "rows64", self.rows.astype(np.float64))

    @property
    def num_steps(self) -> int:
        """Rows, i.e. model evaluations (Heun: 2 per sampler step but the last)."""
        return int(self.rows.shape[0])

    @property
    def timesteps(self) -> np.ndarray:
        return self.rows[:, 0]

    def column(self, name: str) -> np.ndarray:
        return self.rows[:, COLUMNS.index(name)]


def _discrete_rows(sampler, schedule: NoiseSchedule, n, spacing, mu, sigmas, opts):
    if mu is not None or sigmas is not None:
        raise ValueError("mu and base sigmas apply to flow-matching schedules only")
    spacing = check_spacing(schedule.timestep_spacing if spacing is None else spacing)
    return discrete.BUILDERS[sampler](schedule, n, spacing, opts)


def _flow_rows(sampler, schedule: FlowSchedule, n, spacing, mu, sigmas, opts):
    if spacing is not None:
        raise ValueError("timestep spacing does not apply to flow-matching schedules")
    return flow.BUILDERS[sampler](schedule, n, mu, sigmas, opts)


# One entry per schedule kind: its samplers and how a row table is made from it.
_KINDS = {NoiseSchedule: (discrete.BUILDERS, _discrete_rows), FlowSchedule: (flow.BUILDERS, _flow_rows)}


def samplers_for(schedule: NoiseSchedule | FlowSchedule) -> tuple[str, ...]:
    """The samplers that apply to this kind of schedule."""
    return tuple(_KINDS[type(schedule)][0])


def build_table(sampler: str, schedule: NoiseSchedule | FlowSchedule, num_steps: int, spacing: str | None = None,
                *, mu: float | None = None, sigmas: np.ndarray | None = None,
                options: SamplerOptions | None = None) -> SamplerTable:
    """The coefficient table for `num_steps` steps of `sampler` on `schedule`.

    `mu` (dynamic shifting) and `sigmas` (caller-given base sigmas, as diffusers' ``set_timesteps(sigmas=)``)
    apply to flow schedules only; `spacing` overrides a betas schedule's timestep spacing; `options`
    carry the scheduler-config options beyond the schedule (see ``config.table_from_config``).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    builders, rows_of = _KINDS[type(schedule)]
    if sampler not in builders:
        raise ValueError(f"sampler {sampler!r} does not apply to this schedule; expected one of {tuple(builders)}")
    n = schedule.check_steps(num_steps)
    rows64, init_scale = rows_of(sampler, schedule, n, spacing, mu, sigmas, options or SamplerOptions())
    rows64 = np.ascontiguousarray(rows64, dtype=np.float64)
    if not np.all(np.isfinite(rows64)) or not np.isfinite(init_scale):
        bad = sorted({COLUMNS[j] for j in np.argwhere(~np.isfinite(rows64))[:, 1]})
        raise ValueError(f"{sampler} on this schedule gives non-finite coefficients ({', '.join(bad) or 'init'}); "
                         "e.g. epsilon prediction at zero terminal SNR")
    rows = rows64.astype(np.float32)
    rows.setflags(write=False)
    rows64.setflags(write=False)
    e = rows64[:, COLUMNS.index("e")]
    from .levels import table_levels

    levels = table_levels(sampler, schedule, n, spacing, rows64, options or SamplerOptions())
    return SamplerTable(sampler=sampler, rows=rows, init_scale=float(init_scale),
                        needs_noise=bool(np.any(e != 0)), rows64=rows64, levels=levels)
