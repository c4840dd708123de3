"""A per-step precision schedule (numpy only: the run-time side imports this).

The quantized backbone's error does not hurt every sampling step alike: a few steps decide most of
the final image's deviation from fp32. The schedule runs a higher-precision copy of the backbone
(fp32 or fp16, a second component of the folder) at those steps and the quantized one elsewhere.
The steps are chosen at quantize time from a measured per-step sensitivity on calibration prompts
(``schedule_select``); they are stored as timestep ranges, so the host loop and the sampling graph
decide alike (``lo <= t <= hi`` in float32 on the table's t) and a run at another step count or
sampler uses the high-precision backbone over the same stretch of the trajectory.

Manifest (the quantized backbone's entry)::

    "precision_schedule": {"component": "unet_high", "precision": "fp32",
                           "ranges": [[lo, hi], ...],      # ascending, disjoint, lo <= hi
                           "selected": {...}}              # provenance: steps, sampler, high_steps, ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError

HIGH_PRECISIONS = ("fp32", "fp16")
# the open ends of the first and last steps' ranges (finite: JSON has no infinity)
RANGE_END = 1.0e9


@dataclass(frozen=True)
class ScheduleConfig:
    """`quantize --precision-schedule`: how the steps that run the high-precision backbone are chosen.

    steps       0: the fewest steps (by measured sensitivity) whose schedule closes `target` of the
                quantized backbone's image MSE on the calibration prompts, within `max_latency`;
                K > 0: exactly the K most sensitive steps
    target      fraction of the quantized model's image MSE (vs fp32, pooled) to close on calibration
    max_latency the schedule's backbone time over the quantized backbone's, per image, at most
                (estimated from measured call times; caps the number of high-precision steps)
    precision   the high-precision backbone: fp32 (the source's) or fp16
    prompts     calibration prompts the selection generates (the first of the calibration set)
    """

    steps: int = 0
    target: float = 0.75
    max_latency: float = 1.3
    precision: str = "fp32"
    prompts: int = 32

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise UserError(msg)

        what = "precision schedule"
        check(isinstance(self.steps, int) and 0 <= self.steps <= 1000,
              f"{what} steps must be in [0, 1000], got {self.steps!r}")
        check(_finite(self.target) and 0 < self.target <= 1, f"{what} target must be in (0, 1], got {self.target!r}")
        check(_finite(self.max_latency) and self.max_latency >= 1,
              f"{what} max_latency must be >= 1, got {self.max_latency!r}")
        check(self.precision in HIGH_PRECISIONS,
              f"{what} precision must be one of {', '.join(HIGH_PRECISIONS)}; got {self.precision!r}")
        check(isinstance(self.prompts, int) and 2 <= self.prompts <= 4096,
              f"{what} prompts must be in [2, 4096], got {self.prompts!r}")

    def to_dict(self) -> dict:
        return {"steps": self.steps, "target": self.target, "max_latency": self.max_latency,
                "precision": self.precision, "prompts": self.prompts}

    @classmethod
    def from_dict(cls, d: dict) -> ScheduleConfig:
        unknown = sorted(set(d) - {"steps", "target", "max_latency", "precision", "prompts"})
        if unknown:
            raise UserError(f"unknown precision schedule field(s) {', '.join(unknown)}")
        return cls(**d)

    @classmethod
    def parse(cls, spec: str) -> ScheduleConfig:
        """CLI form: `auto`, `K` (steps), or `key=value,...` (e.g. `target=0.8,max_latency=1.2`)."""
        spec = spec.strip()
        if spec == "auto":
            return cls()
        if spec.isdigit():
            return cls(steps=int(spec))
        values: dict = {}
        types = {"steps": int, "target": float, "max_latency": float, "precision": str, "prompts": int}
        for item in spec.split(","):
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in types:
                raise UserError(f"--precision-schedule expects auto, K or KEY=VALUE[,...] with keys "
                                f"{', '.join(types)}; got {item.strip()!r}")
            try:
                values[key] = types[key](raw.strip())
            except ValueError:
                raise UserError(f"--precision-schedule {key}={raw.strip()!r} is not a valid {types[key].__name__}") from None
        return cls(**values)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class PrecisionSchedule:
    component: str  # the high-precision backbone's component name
    precision: str
    lo: np.ndarray  # (R,) float32, ascending
    hi: np.ndarray  # (R,) float32
    selected: dict = field(default_factory=dict)  # provenance

    def __post_init__(self) -> None:
        lo, hi = np.asarray(self.lo, np.float32).reshape(-1), np.asarray(self.hi, np.float32).reshape(-1)
        if len(lo) < 1 or lo.shape != hi.shape or not np.all(np.isfinite(lo)) or not np.all(np.isfinite(hi)):
            raise ValueError("precision schedule ranges must be a non-empty list of finite [lo, hi] pairs")
        if np.any(lo > hi) or np.any(lo[1:] <= hi[:-1]):
            raise ValueError("precision schedule ranges must have lo <= hi and be ascending and disjoint")
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "hi", hi)

    def use_high(self, t: float) -> bool:
        """Whether the step at timestep t runs the high-precision backbone (float32, as the graph compares)."""
        tt = np.float32(t)
        return bool(np.any((tt >= self.lo) & (tt <= self.hi)))

    def high_steps(self, timesteps) -> list[int]:
        return [i for i, t in enumerate(np.asarray(timesteps, np.float32)) if self.use_high(t)]

    def wrap(self, low_fn, high_fn):
        """model_fn(x, t) for the host loop: the high-precision backbone where the schedule says."""

        def scheduled(x, t):
            return high_fn(x, t) if self.use_high(t) else low_fn(x, t)

        return scheduled

    @classmethod
    def from_steps(cls, timesteps, high_steps, component: str, precision: str, selected: dict | None = None) -> PrecisionSchedule:
        """Ranges around the chosen steps' timesteps, bounded half-way to the neighbouring timesteps
        (open beyond the trajectory's ends), merged where they touch."""
        ts = np.asarray(timesteps, np.float64)
        if not len(high_steps):
            raise ValueError("a precision schedule needs at least one high-precision step")
        values = np.unique(ts)  # ascending
        ranges = []
        for i in sorted(set(int(s) for s in high_steps)):
            k = int(np.searchsorted(values, ts[i]))
            lo = -RANGE_END if k == 0 else (values[k - 1] + values[k]) / 2
            hi = RANGE_END if k == len(values) - 1 else (values[k] + values[k + 1]) / 2
            ranges.append((lo, hi))
        ranges.sort()
        merged: list[list[float]] = []
        for lo, hi in ranges:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        lo = np.array([r[0] for r in merged], np.float32)
        hi = np.array([r[1] for r in merged], np.float32)
        # a midpoint rounded to float32 must not swallow the neighbour: nudge it inward
        for j in range(len(lo)):
            while np.any(np.float32(ts) == lo[j]) and not np.isin(lo[j], np.float32(ts[list(high_steps)])):
                lo[j] = np.nextafter(lo[j], np.float32(np.inf))
            while np.any(np.float32(ts) == hi[j]) and not np.isin(hi[j], np.float32(ts[list(high_steps)])):
                hi[j] = np.nextafter(hi[j], np.float32(-np.inf))
        return cls(component, precision, lo, hi, dict(selected or {}))

    def to_dict(self) -> dict:
        return {"component": self.component, "precision": self.precision,
                "ranges": [[float(a), float(b)] for a, b in zip(self.lo, self.hi)], "selected": self.selected}

    @classmethod
    def from_dict(cls, d: dict) -> PrecisionSchedule:
        """From a manifest entry already checked by ``manifest.check_precision_schedule``."""
        ranges = np.asarray(d["ranges"], np.float64).reshape(-1, 2)
        return cls(d["component"], d["precision"], ranges[:, 0], ranges[:, 1], dict(d.get("selected") or {}))
