"""Samplers as per-step coefficient tables: the contract between numpy and ONNX loops.

Row i of a table holds (t, c_in, p, q, a, c, d, e, r, k); one step is

    out = model(x * c_in, t)
    D   = p * x + q * out                          # x0 estimate (prediction type folded into p, q)
    x   = a * x + c * D + d * D_prev + e * noise_i + k * clip(D, -r, r)

D_prev is the previous row's D (0 before the first).

Multistep methods with a longer memory (PNDM's linear multistep, UniPC's predictor-corrector) add
history columns d2, d3, ... after k: ``x += d2 * H_2 + d3 * H_3 + ...`` where H_j is the history
value j rows back (H_1 = D_prev, and ``d`` multiplies it).  The history value is D, or for
``history="output"`` tables the raw model output (PNDM combines past eps predictions, which are
not a function of past D alone); then ``d`` multiplies the previous row's output too.  Such tables
run in the host loop only: the loop graphs carry one D_prev and refuse them (``host_only``).  x starts as latents * init_scale.  Only the
last column pair is nonlinear: DDIM's clip_sample clips the x0 term alone (k = 0 elsewhere).  A row
is one model evaluation: a sampler that calls the model twice per step (Heun) has two rows per step.

The rows come from a schedule object, one kind per family of schedules: `NoiseSchedule`
(betas-derived; DDIM, Euler, Euler ancestral, DPM-Solver++) and `FlowSchedule` (rectified flow;
flow-match Euler and Heun, DPM-Solver++ with flow sigmas); see ``discrete`` and ``flow``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .schedules import FlowSchedule, NoiseSchedule, check_spacing
from . import consistency, discrete, flow, multistep
from .options import SamplerOptions

from .columns import COLUMNS  # noqa: E402 (re-exported: the table layout is public)
HISTORIES = ("denoised", "output")
DISCRETE_SAMPLERS = tuple(discrete.BUILDERS)
# betas-schedule samplers added for the folders real checkpoints ship (PNDM, UniPC) and the few-step
# distilled ones (LCM, TCD); PNDM and UniPC tables are host-only (see the module docstring)
MORE_SAMPLERS = tuple(multistep.BUILDERS) + tuple(consistency.BUILDERS)
FLOW_SAMPLERS = ("flow_euler", "flow_heun", "dpmpp_2m")
SAMPLERS = DISCRETE_SAMPLERS + MORE_SAMPLERS + tuple(s for s in FLOW_SAMPLERS if s not in DISCRETE_SAMPLERS)
_DISCRETE_BUILDERS = {**discrete.BUILDERS, **multistep.BUILDERS, **consistency.BUILDERS}


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
    history: str = "denoised"  # what d, d2, d3... multiply: past D, or past raw model outputs

    def __post_init__(self) -> None:
        if self.rows.ndim != 2 or self.rows.shape[1] < len(COLUMNS) or self.rows.shape[0] < 1:
            raise ValueError(f"rows must have shape (num_steps >= 1, >= {len(COLUMNS)}), got {self.rows.shape}")
        if self.history not in HISTORIES:
            raise ValueError(f"unknown table history {self.history!r}; expected one of {HISTORIES}")
        if self.rows64 is None:
            object.__setattr__(self, "rows64", self.rows.astype(np.float64))

    @property
    def num_steps(self) -> int:
        """Rows, i.e. model evaluations (Heun: 2 per sampler step but the last)."""
        return int(self.rows.shape[0])

    @property
    def timesteps(self) -> np.ndarray:
        return self.rows[:, 0]

    @property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS + tuple(f"d{j}" for j in range(2, self.rows.shape[1] - len(COLUMNS) + 2))

    @property
    def host_only(self) -> bool:
        """A longer memory than D_prev (or an output history): only the host loop runs this table."""
        return self.rows.shape[1] > len(COLUMNS) or self.history != "denoised"

    def column(self, name: str) -> np.ndarray:
        return self.rows[:, self.columns.index(name)]


def _discrete_rows(sampler, schedule: NoiseSchedule, n, spacing, mu, sigmas, opts):
    if mu is not None or sigmas is not None:
        raise ValueError("mu and base sigmas apply to flow-matching schedules only")
    spacing = check_spacing(schedule.timestep_spacing if spacing is None else spacing)
    return _DISCRETE_BUILDERS[sampler](schedule, n, spacing, opts)


def _flow_rows(sampler, schedule: FlowSchedule, n, spacing, mu, sigmas, opts):
    if spacing is not None:
        raise ValueError("timestep spacing does not apply to flow-matching schedules")
    return flow.BUILDERS[sampler](schedule, n, mu, sigmas, opts)


# One entry per schedule kind: its samplers and how a row table is made from it.
_KINDS = {NoiseSchedule: (_DISCRETE_BUILDERS, _discrete_rows), FlowSchedule: (flow.BUILDERS, _flow_rows)}


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
    built = rows_of(sampler, schedule, n, spacing, mu, sigmas, options or SamplerOptions())
    rows64, init_scale = built[:2]
    history = built[2] if len(built) > 2 else "denoised"  # multistep builders name their history
    rows64 = np.ascontiguousarray(rows64, dtype=np.float64)
    names = COLUMNS + tuple(f"d{j}" for j in range(2, rows64.shape[1] - len(COLUMNS) + 2))
    if not np.all(np.isfinite(rows64)) or not np.isfinite(init_scale):
        bad = sorted({names[j] for j in np.argwhere(~np.isfinite(rows64))[:, 1]})
        raise ValueError(f"{sampler} on this schedule gives non-finite coefficients ({', '.join(bad) or 'init'}); "
                         "e.g. epsilon prediction at zero terminal SNR")
    rows = rows64.astype(np.float32)
    rows.setflags(write=False)
    rows64.setflags(write=False)
    e = rows64[:, COLUMNS.index("e")]
    from .levels import table_levels

    levels = table_levels(sampler, schedule, n, spacing, rows64, options or SamplerOptions())
    return SamplerTable(sampler=sampler, rows=rows, init_scale=float(init_scale),
                        needs_noise=bool(np.any(e != 0)), rows64=rows64, levels=levels, history=history)
