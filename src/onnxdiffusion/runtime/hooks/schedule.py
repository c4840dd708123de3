"""A per-step precision schedule, run time's side: which steps run the high-precision backbone
(a per-step wrapper of the model function). Selected at quantize time: quantize/schedule_select.py.

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

from dataclasses import dataclass, field

import numpy as np

HIGH_PRECISIONS = ("fp32", "fp16")
# the open ends of the first and last steps' ranges (finite: JSON has no infinity)
RANGE_END = 1.0e9


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
