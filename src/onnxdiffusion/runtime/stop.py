"""Adaptive stopping: a typed spec behind ``stop_early=SPEC`` / ``--stop-early THRESHOLD[:MIN_STEPS]``, and
the host loop's test (the Loop graph's twin is samplers/graph_stop.py).

After step i (i >= 1) the change of the denoised estimate, sum|D_i - D_{i-1}| / sum|D_{i-1}| (the ratio of
means; cache_math's float32 arithmetic and summation order, so the Loop graph decides the same step), below
THRESHOLD ends sampling once at least MIN_STEPS steps ran; the result is then D_i, the x0 estimate, so an
early stop still decodes a finished picture. The last step never counts as a stop (its x is the result
anyway), and THRESHOLD 0 never stops: the image is the one without the option, bit for bit. The whole
batch stops together (one test over the batch's latents).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..samplers.cache_math import relative_change

USAGE = "THRESHOLD[:MIN_STEPS] (THRESHOLD >= 0, e.g. 0.01; MIN_STEPS an integer >= 1)"


@dataclass(frozen=True)
class StopSpec:
    threshold: float
    min_steps: int = 1

    @property
    def noop(self) -> bool:
        return self.threshold == 0.0

    def __str__(self) -> str:
        return f"{self.threshold:g}:{self.min_steps}"

    def stops(self, i: int, num_steps: int, den: np.ndarray, prev: np.ndarray | None) -> bool:
        """Whether the run ends after step i (0-based) of num_steps, D_i = den, D_{i-1} = prev."""
        if prev is None or i + 1 < self.min_steps or i + 1 >= num_steps:
            return False
        # float32 ratio, compared in float64 as the graph's Cast + Less does; NaN (0 / 0) never stops
        return float(relative_change(den, prev)) < self.threshold


def parse_stop(spec) -> StopSpec | None:
    """A StopSpec from ``THRESHOLD[:MIN_STEPS]`` or a number (None / "" / "none": no stopping); one-line UserError."""
    if spec is None or isinstance(spec, StopSpec):
        return spec
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        text = repr(float(spec))
    elif isinstance(spec, str):
        text = spec.strip()
    else:
        raise UserError(f"stop_early must be a string like '0.01:4' or a number, got {type(spec).__name__}")
    if text in ("", "none"):
        return None
    parts = text.split(":")
    if len(parts) > 2:
        raise UserError(f"stop-early {spec!r}: expected {USAGE}")
    try:
        threshold = float(parts[0])
    except ValueError:
        raise UserError(f"stop-early {spec!r}: THRESHOLD must be a number; expected {USAGE}") from None
    if not math.isfinite(threshold) or threshold < 0:
        raise UserError(f"stop-early {spec!r}: THRESHOLD must be a finite number >= 0, got {parts[0]}")
    min_steps = 1
    if len(parts) == 2:
        try:
            min_steps = int(parts[1])
        except ValueError:
            raise UserError(f"stop-early {spec!r}: MIN_STEPS must be an integer; expected {USAGE}") from None
        if min_steps < 1:
            raise UserError(f"stop-early {spec!r}: MIN_STEPS must be >= 1, got {min_steps}")
    return StopSpec(threshold, min_steps)


def check_steps(spec: StopSpec | None, steps: int) -> None:
    """MIN_STEPS beyond the steps that run is a mistake, not a silent no-op."""
    if spec is not None and spec.min_steps > steps:
        raise UserError(f"stop-early {spec}: MIN_STEPS {spec.min_steps} is more than the {steps} steps this run has")


def check_inpainting(spec: StopSpec | None, inpainting: bool) -> None:
    if inpainting and spec is not None and not spec.noop:
        raise UserError(f"stop-early {spec}: not with inpainting (the kept region is blended into x, not into "
                        "the denoised estimate an early stop returns)")


def check_form(spec: StopSpec | None, loop: str, graph_stop, cache=None) -> None:
    """Refusals, each one line, where an early stop cannot be made or would misfire; `graph_stop()` says
    whether the folder's Loop graph was compiled with the test (asked only for --loop loop)."""
    if spec is None or spec.noop:
        return
    if cache is not None and not cache.noop:
        # measured (experiments/adaptive_stop): a cached step reuses features, so its estimate barely moves
        # from the step before and the test fires right after it (shapes-mmdit first_block:0.1 + stop 0.05:
        # 6 of 20 steps, 27.7 dB, -6.2 strict points; stop 0.05 alone: 11.8 steps, 40.5 dB, no loss)
        raise UserError(f"stop-early {spec} with cache {cache}: a cached step's denoised estimate looks settled "
                        "because its features are reused; use one or the other")
    if loop == "unrolled":
        raise UserError(f"stop-early {spec}: an unrolled graph runs all its steps; use --loop loop or host")
    if loop == "loop" and not graph_stop():
        raise UserError(f"stop-early {spec}: this folder's Loop graph was compiled without the stopping test; "
                        "recompile it with `onnxdiffusion compile-loop --stop-early` or run --loop host")


def loop_feeds(spec: StopSpec | None) -> dict[str, np.ndarray]:
    """The Loop graph's stop inputs (none: its defaults, threshold 0, never stop)."""
    if spec is None or spec.noop:
        return {}
    return {"stop_threshold": np.array(spec.threshold, np.float64),
            "stop_min_steps": np.array(spec.min_steps, np.int64)}
