"""Sampler options a diffusers scheduler config can set beyond the schedule itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

SIGMA_SHAPES = ("default", "karras", "exponential", "beta", "lu")
FINAL_SIGMAS = ("zero", "sigma_min")
INTERPOLATIONS = ("linear", "log_linear")
TIMESTEP_TYPES = ("discrete", "continuous")
SOLVER_TYPES = ("midpoint", "heun")


@dataclass(frozen=True)
class SamplerOptions:
    """Everything but the schedule that changes a sampler's rows (defaults: the diffusers defaults)."""

    sigma_shape: str = "default"  # use_karras_sigmas / use_exponential_sigmas / use_beta_sigmas / use_lu_lambdas
    sigma_min: float | None = None  # bounds of a reshaped grid (Euler's sigma_min / sigma_max)
    sigma_max: float | None = None
    final_sigmas_type: str = "zero"
    interpolation_type: str = "linear"  # Euler
    timestep_type: str = "discrete"  # Euler: "continuous" feeds 0.25 log(sigma) to v-prediction models
    lambda_min_clipped: float = -math.inf  # DPM-Solver
    solver_order: int = 2
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    sde: bool = False  # DPM-Solver algorithm_type sde-dpmsolver++
    flow_grid: str = "flowmatch"  # "dpm": DPMSolverMultistepScheduler's use_flow_sigmas grid
    clip_sample_range: float | None = None  # DDIM clip_sample
    stochastic: bool = False  # FlowMatchEuler stochastic_sampling
    skip_prk_steps: bool = True  # PNDM (the Runge-Kutta warm-up is refused)
    unipc_solver: str = "bh2"  # UniPC solver_type
    disable_corrector: tuple[int, ...] = ()  # UniPC: steps whose corrector is skipped
    original_steps: int = 50  # LCM / TCD original_inference_steps
    timestep_scaling: float = 10.0  # LCM boundary-condition scaling
    eta: float = 0.3  # TCD gamma (the stochastic share of each step); TCDScheduler.step's default

    def __post_init__(self) -> None:
        for name, value, allowed in (("sigma_shape", self.sigma_shape, SIGMA_SHAPES),
                                     ("final_sigmas_type", self.final_sigmas_type, FINAL_SIGMAS),
                                     ("interpolation_type", self.interpolation_type, INTERPOLATIONS),
                                     ("timestep_type", self.timestep_type, TIMESTEP_TYPES),
                                     ("solver_type", self.solver_type, SOLVER_TYPES),
                                     ("flow_grid", self.flow_grid, ("flowmatch", "dpm"))):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")
        if self.solver_order not in (1, 2, 3):
            raise ValueError(f"solver_order={self.solver_order!r} is not reproduced; use 1, 2 or 3")
        if self.unipc_solver not in ("bh1", "bh2"):
            raise ValueError(f"unknown UniPC solver_type {self.unipc_solver!r}; expected 'bh1' or 'bh2'")
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"TCD eta (gamma) must be in [0, 1], got {self.eta!r}")
        if self.clip_sample_range is not None and not self.clip_sample_range > 0:
            raise ValueError(f"clip_sample_range must be > 0, got {self.clip_sample_range!r}")
