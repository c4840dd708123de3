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
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample", "flow_prediction")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")


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


def _rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Shift and scale sqrt(alphas_cumprod) so its last value is 0 (Lin et al. 2023), in float32 as diffusers."""
    alphas = np.float32(1.0) - betas.astype(np.float32)
    ab_sqrt = np.sqrt(np.cumprod(alphas.astype(np.float64)).astype(np.float32))
    first, last = ab_sqrt[0], ab_sqrt[-1]
    ab_sqrt = (ab_sqrt - last) * (first / (first - last))
    ab = ab_sqrt * ab_sqrt
    alphas = np.concatenate([ab[:1], ab[1:] / ab[:-1]])
    return (np.float32(1.0) - alphas).astype(np.float32)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


class _Steps:
    """What both schedule kinds share: their dict form and the step-count check against training steps."""

    num_train_timesteps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_steps(self, num_steps: int) -> int:
        if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)):
            raise ValueError(f"num_steps must be an int, got {num_steps!r}")
        if not 1 <= num_steps <= self.num_train_timesteps:
            raise ValueError(f"num_steps must be in [1, {self.num_train_timesteps}], got {num_steps}")
        return int(num_steps)


@dataclass(frozen=True)
class NoiseSchedule(_Steps):
    num_train_timesteps: int
    beta_start: float
    beta_end: float
    beta_schedule: str
    prediction_type: str
    steps_offset: int = 0
    timestep_spacing: str = "leading"
    set_alpha_to_one: bool = False
    rescale_betas_zero_snr: bool = False
    trained_betas: tuple[float, ...] | None = None

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
        if self.trained_betas is not None and len(self.trained_betas) != self.num_train_timesteps:
            raise ValueError(f"trained_betas has {len(self.trained_betas)} values for "
                             f"num_train_timesteps={self.num_train_timesteps}")

    @classmethod
    def from_scheduler_config(cls, d: dict[str, Any]) -> "NoiseSchedule":
        """Build from a diffusers ``scheduler_config.json`` dict; missing keys take DDIMScheduler's defaults.

        Only the schedule's own keys are read: ``samplers.config`` checks every other option.
        """
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
            rescale_betas_zero_snr=bool(get("rescale_betas_zero_snr", False)),
            trained_betas=None if d.get("trained_betas") is None else tuple(float(b) for b in d["trained_betas"]),
        )

    @cached_property
    def betas(self) -> np.ndarray:
        n = self.num_train_timesteps
        if self.trained_betas is not None:
            b = np.asarray(self.trained_betas, dtype=np.float32)
        elif self.beta_schedule == "linear":
            b = _torch_linspace_f32(self.beta_start, self.beta_end, n)
        elif self.beta_schedule == "scaled_linear":
            b = _torch_linspace_f32(self.beta_start**0.5, self.beta_end**0.5, n)
            b = b * b
        else:
            b = _cosine_betas(n)
        if self.rescale_betas_zero_snr:
            b = _rescale_zero_terminal_snr(b)
        return _readonly(b.astype(np.float64))

    @cached_property
    def alphas_cumprod(self) -> np.ndarray:
        alphas = (np.float32(1.0) - self.betas.astype(np.float32)).astype(np.float64)
        return _readonly(np.cumprod(alphas).astype(np.float32).astype(np.float64))

    @cached_property
    def alphas_cumprod_floored(self) -> np.ndarray:
        """Euler/DPM-Solver keep the zero-SNR last value at 2**-24 (not 0) so the first sigma stays finite."""
        if not self.rescale_betas_zero_snr:
            return self.alphas_cumprod
        ac = self.alphas_cumprod.copy()
        ac[-1] = 2.0**-24
        return _readonly(ac)

    @cached_property
    def sigmas_floored(self) -> np.ndarray:
        """Training sigmas as Euler/DPM-Solver compute them: in float32 from the floored alphas_cumprod."""
        ac = self.alphas_cumprod_floored.astype(np.float32)
        return _readonly(np.sqrt((np.float32(1.0) - ac) / ac).astype(np.float64))

    @cached_property
    def sigmas(self) -> np.ndarray:
        """Variance-exploding sigma per training timestep: sqrt((1 - ac) / ac)."""
        ac = self.alphas_cumprod
        return _readonly(np.sqrt((1.0 - ac) / ac))



# --- flow matching ----------------------------------------------------------------------------

TIME_SHIFT_TYPES = ("exponential", "linear")


def _f32(a) -> np.ndarray:
    """Round to float32 and widen again: diffusers keeps its sigmas as float32 tensors."""
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


@dataclass(frozen=True)
class FlowSchedule(_Steps):
    """A rectified-flow schedule (x = (1 - sigma) x0 + sigma noise): no betas, sigma in (0, 1].

    Reproduces ``FlowMatchEulerDiscreteScheduler.set_timesteps``: a grid between the scheduler's
    own sigma_max and sigma_min (or caller-given base sigmas, as the Flux and Qwen-Image
    pipelines pass), then a static shift or, with ``use_dynamic_shifting``, a time shift by the
    caller's ``mu``, then the optional stretch to ``shift_terminal``.  The model's timestep input
    is ``sigma * num_train_timesteps``.
    """

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    shift_terminal: float | None = None
    time_shift_type: str = "exponential"

    def __post_init__(self) -> None:
        if isinstance(self.num_train_timesteps, bool) or not isinstance(self.num_train_timesteps, (int, np.integer)) \
                or self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be a positive int, got {self.num_train_timesteps!r}")
        if not self.shift > 0:
            raise ValueError(f"shift must be > 0, got {self.shift!r}")
        if self.time_shift_type not in TIME_SHIFT_TYPES:
            raise ValueError(f"unknown time_shift_type {self.time_shift_type!r}; expected one of {TIME_SHIFT_TYPES}")
        if self.shift_terminal is not None and not 0 < self.shift_terminal < 1:
            raise ValueError(f"shift_terminal must be in (0, 1), got {self.shift_terminal!r}")

    def mu_for(self, image_seq_len: int) -> float:
        """The SD3/Flux/Qwen-Image pipelines' ``calculate_shift``: mu linear in the image token count."""
        m = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        b = self.base_shift - m * self.base_image_seq_len
        return float(image_seq_len * m + b)

    def _static_shift(self, s: np.ndarray) -> np.ndarray:
        return self.shift * s / (1 + (self.shift - 1) * s)

    def _time_shift(self, mu: float, s: np.ndarray) -> np.ndarray:
        k = math.exp(mu) if self.time_shift_type == "exponential" else mu
        return k / (k + (1 / s - 1))

    @property
    def train_sigma_range(self) -> tuple[float, float]:
        """(sigma_max, sigma_min) of the training grid, as the scheduler's constructor computes them (float32)."""
        T = self.num_train_timesteps
        s = np.float32(np.array([T, 1], np.float32) / np.float32(T))
        if not self.use_dynamic_shifting:
            # torch computes this in float32 (the python-float shift rounded to float32 first)
            k = np.float32(self.shift)
            s = (k * s / (np.float32(1) + (k - np.float32(1)) * s)).astype(np.float32)
        return float(s[0]), float(s[1])

    def sigmas(self, num_steps: int, mu: float | None = None, base: np.ndarray | None = None) -> np.ndarray:
        """Step sigmas (num_steps,), float32 values held in float64; the terminal 0 is not included."""
        return _f32(self.shifted(num_steps, mu, base))

    def shifted(self, num_steps: int, mu: float | None = None, base: np.ndarray | None = None) -> np.ndarray:
        """The step sigmas in float64 before diffusers' float32 rounding (base sigmas rounded first, as it does)."""
        n = self.check_steps(num_steps)
        T = self.num_train_timesteps
        if base is None:
            hi, lo = self.train_sigma_range
            s = np.linspace(hi * T, lo * T, n) / T
        else:
            s = _f32(base)
            if s.shape != (n,) or not np.all((s > 0) & (s <= 1)):
                raise ValueError(f"base sigmas must be {n} values in (0, 1], got shape {s.shape}")
        if self.use_dynamic_shifting:
            if mu is None:
                raise ValueError("this flow schedule uses dynamic shifting: pass mu (or the image token count)")
            s = self._time_shift(float(mu), s)
        else:
            s = self._static_shift(s)
        if self.shift_terminal:
            one_minus = 1 - s
            if one_minus[-1] <= 0:  # diffusers divides by zero here (one step from sigma 1)
                raise ValueError(f"shift_terminal needs a last sigma below 1; {n} step(s) give {s[-1]}")
            s = 1 - one_minus / (one_minus[-1] / (1 - self.shift_terminal))
        return s

    def timesteps(self, sigmas: np.ndarray) -> np.ndarray:
        """What the backbone receives: sigma * num_train_timesteps, rounded as diffusers' float32 product."""
        return (sigmas.astype(np.float32) * np.float32(self.num_train_timesteps)).astype(np.float64)
