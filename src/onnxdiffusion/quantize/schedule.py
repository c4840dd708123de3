"""A per-step precision schedule: its quantize-time config. What a schedule is, why, and its manifest
entry: techniques/precision.py (the run-time side)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError
from ..techniques.precision import HIGH_PRECISIONS, RANGE_END, PrecisionSchedule  # noqa: F401 - re-exported


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
