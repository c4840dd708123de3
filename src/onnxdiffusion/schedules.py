"""Discrete-time noise schedules (betas / alphas_cumprod / sigmas) in plain numpy.

The values reproduce what diffusers computes *bit for bit*: diffusers builds its
betas in float32 with ``torch.linspace`` and accumulates ``torch.cumprod`` in
double before rounding to float32.  Using numpy's own float32 linspace instead
differs in the last bit for ~30% of the betas, which compounds through the
cumulative product to ~1e-5 relative error in the small sigmas -- enough to
break 1e-5 parity of sampler trajectories.  So the float32 rounding is mirrored
here and the results are widened to float64 only afterwards.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "v_prediction")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")

# Config keys that would change the schedule in ways this module does not model;
# silently ignoring them would produce a wrong (not just slightly different) sampler.
_UNSUPPORTED_IF_SET = ("trained_betas", "rescale_betas_zero_snr")


def check_spacing(spacing: str) -> str:
    if spacing not in TIMESTEP_SPACINGS:
        raise ValueError(f"unknown timestep spacing {spacing!r}; expected one of {TIMESTEP_SPACINGS}")
    return spacing


def _torch_linspace_f32(start: float, end: float, n: int) -> np.ndarray:
    """float32 linspace rounded the way torch's CPU kernel does it.

    torch fills the first half as ``start + step*i`` and the second half as
    ``end - step*(n-1-i)`` with a fused multiply-add in float32; the product of two
    float32 values is exact in float64, so one float64 FMA-emulation + one rounding
    reproduces it.
    """
    a, b = np.float32(start), np.float32(end)
    if n == 1:
        return np.array([a], dtype=np.float32)
    step = np.float64(np.float32((b - a) / np.float32(n - 1)))
    i = np.arange(n, dtype=np.float64)
    lo = np.float64(a) + step * i
    hi = np.float64(b) - step * (n - 1 - i)
    return np.where(i < n // 2, lo, hi).astype(np.float32)


def _cosine_betas(n: int, max_beta: float = 0.999) -> np.ndarray:
    """Glide/iDDPM cosine schedule, evaluated in float64 then rounded to float32 (as diffusers stores it)."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [min(1.0 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)]
    return np.asarray(betas, dtype=np.float32)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class NoiseSchedule:
    num_train_timesteps: int
    beta_start: float
    beta_end: float
    beta_schedule: str
    prediction_type: str
    steps_offset: int = 0
    timestep_spacing: str = "leading"
    set_alpha_to_one: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_train_timesteps, bool) or not isinstance(self.num_train_timesteps, (int, np.integer)) \
                or self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be a positive int, got {self.num_train_timesteps!r}")
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ValueError(f"unknown beta_schedule {self.beta_schedule!r}; expected one of {BETA_SCHEDULES}")
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"unknown prediction_type {self.prediction_type!r}; expected one of {PREDICTION_TYPES}")
        check_spacing(self.timestep_spacing)
        if isinstance(self.steps_offset, bool) or not isinstance(self.steps_offset, (int, np.integer)) \
                or self.steps_offset < 0:
            raise ValueError(f"steps_offset must be a non-negative int, got {self.steps_offset!r}")

    @classmethod
    def from_scheduler_config(cls, d: dict[str, Any]) -> "NoiseSchedule":
        """Build from a diffusers ``scheduler_config.json`` dict; missing keys take DDIMScheduler's defaults."""
        for key in _UNSUPPORTED_IF_SET:
            if d.get(key):
                raise ValueError(f"scheduler config sets {key}={d[key]!r}, which is not supported")
        # Explicit nulls fall back to defaults too (e.g. "timestep_spacing": null in some configs).
        get = lambda k, default: default if d.get(k) is None else d[k]  # noqa: E731
        return cls(
            num_train_timesteps=int(get("num_train_timesteps", 1000)),
            beta_start=float(get("beta_start", 0.0001)),
            beta_end=float(get("beta_end", 0.02)),
            beta_schedule=str(get("beta_schedule", "linear")),
            prediction_type=str(get("prediction_type", "epsilon")),
            steps_offset=int(get("steps_offset", 0)),
            timestep_spacing=str(get("timestep_spacing", "leading")),
            set_alpha_to_one=bool(get("set_alpha_to_one", True)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_steps(self, num_steps: int) -> int:
        if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)):
            raise ValueError(f"num_steps must be an int, got {num_steps!r}")
        if not 1 <= num_steps <= self.num_train_timesteps:
            raise ValueError(f"num_steps must be in [1, {self.num_train_timesteps}], got {num_steps}")
        return int(num_steps)

    @cached_property
    def betas(self) -> np.ndarray:
        n = self.num_train_timesteps
        if self.beta_schedule == "linear":
            b = _torch_linspace_f32(self.beta_start, self.beta_end, n)
        elif self.beta_schedule == "scaled_linear":
            b = _torch_linspace_f32(self.beta_start**0.5, self.beta_end**0.5, n)
            b = b * b
        else:
            b = _cosine_betas(n)
        return _readonly(b.astype(np.float64))

    @cached_property
    def alphas_cumprod(self) -> np.ndarray:
        alphas = (np.float32(1.0) - self.betas.astype(np.float32)).astype(np.float64)
        return _readonly(np.cumprod(alphas).astype(np.float32).astype(np.float64))

    @cached_property
    def sigmas(self) -> np.ndarray:
        """Variance-exploding sigma per training timestep: sqrt((1 - ac) / ac)."""
        ac = self.alphas_cumprod
        return _readonly(np.sqrt((1.0 - ac) / ac))

