"""Adaptive stopping: a typed spec behind ``stop_early=SPEC`` / ``--stop-early THRESHOLD[:MIN_STEPS]``, the host
loop's test, its Loop-graph twin (``StopLoop``) and what compile-loop records of it.

After step i (i >= 1) the change of the denoised estimate, sum|D_i - D_{i-1}| / sum|D_{i-1}| (the ratio of
means; cache_math's float32 arithmetic and summation order, so the Loop graph decides the same step), below
THRESHOLD ends sampling once at least MIN_STEPS steps ran; the result is then D_i, the x0 estimate, so an
early stop still decodes a finished picture. The last step never counts as a stop (its x is the result
anyway), and THRESHOLD 0 never stops: the image is the one without the option, bit for bit. The whole
batch stops together (one test over the batch's latents).

In the Loop graph the body's ``cond`` output is the test, op for op (graph_fold.fold_sum), cast to double and
compared with ``stop_threshold``; on the stopping step the carried x becomes D_i (a ``Where``). Graph inputs
(with defaults): ``stop_threshold`` (double, 0), ``stop_min_steps`` (int64, 1). Graph output ``steps_run``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..samplers.cache_math import relative_change
from .host_base import HostTechnique
from .loop_base import Carried, LoopTechnique

NAME = "stop"
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

    def loop_feeds(self) -> dict[str, np.ndarray]:
        return {"stop_threshold": np.array(self.threshold, np.float64),
                "stop_min_steps": np.array(self.min_steps, np.int64)}

    def check_graph(self, form: str, graph) -> None:
        """Whether this loop form, and the folder's compiled graph (`graph()`, opened on asking), runs the test."""
        check_form(self, form, lambda: graph().stop)


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


def check_form(spec: StopSpec | None, loop: str, graph_stop) -> None:
    """Where an early stop cannot be made, one line each; `graph_stop()` says whether the folder's Loop graph
    was compiled with the test (asked only for --loop loop)."""
    if spec is None or spec.noop:
        return
    if loop == "unrolled":
        raise UserError(f"stop-early {spec}: an unrolled graph runs all its steps; use --loop loop or host")
    if loop == "loop" and not graph_stop():
        raise UserError(f"stop-early {spec}: this folder's Loop graph was compiled without the stopping test; "
                        "recompile it with `onnxdiffusion compile-loop --stop-early` or run --loop host")


def loop_feeds(spec: StopSpec | None) -> dict[str, np.ndarray]:
    """The Loop graph's stop inputs (none: its defaults, threshold 0, never stop)."""
    return {} if spec is None or spec.noop else spec.loop_feeds()


def compiled_record() -> dict:
    """What compile-loop --stop-early records in the Loop graph's manifest entry."""
    return {"stop_early": True}


def read_record(entry) -> bool:
    """Whether a Loop graph's manifest entry (a manifest Component) says the test is compiled in."""
    return entry.stop_early


class StopHost(HostTechnique):
    name = NAME

    def __init__(self, spec: StopSpec):
        self.spec = spec

    def stops(self, i: int, num_steps: int, den, prev) -> bool:
        return self.spec.stops(i, num_steps, den, prev)

    def graph_feeds(self, graph, ctx) -> dict:
        return self.spec.loop_feeds()


class StopLoop(LoopTechnique):
    """The test in the Loop body; the Loop carries a step counter (output ``steps_run``)."""

    name = NAME

    def inputs(self) -> list:
        from onnx import TensorProto, helper

        return [helper.make_tensor_value_info("stop_threshold", TensorProto.DOUBLE, []),
                helper.make_tensor_value_info("stop_min_steps", TensorProto.INT64, [])]

    def prologue(self, b, bb, form: str, state) -> None:
        from .graph_fold import fold_constants

        b.const("stop_threshold", np.array(0.0, np.float64))
        b.const("stop_min_steps", np.array(1, np.int64))
        b.const("stop_zero_i64", np.array(0, np.int64))
        fold_constants(b)

    def carried(self) -> Carried:
        from onnx import TensorProto, helper

        i64 = TensorProto.INT64
        return Carried(body_in=[helper.make_tensor_value_info("stop_count_in", i64, [])],
                       body_out=[helper.make_tensor_value_info("stop_count_out", i64, [])],
                       loop_in=["stop_zero_i64"], loop_out=["steps_run"],
                       graph_out=[helper.make_tensor_value_info("steps_run", i64, [])])

    def end_of_step(self, b, i: str, x_new: str, den: str, d_prev: str) -> tuple[str, str]:
        """Appends the test to a Loop body; returns (cond_out, the x to carry). Also writes stop_count_out."""
        from onnx import TensorProto

        from .graph_fold import fold_sum

        moved = fold_sum(b, b.op("Abs", [b.op("Sub", [den, d_prev], "stop_dd")], "stop_abs_dd"), "stop_fold_dd")
        size = fold_sum(b, b.op("Abs", [d_prev], "stop_abs_prev"), "stop_fold_prev")
        ratio = b.op("Cast", [b.op("Div", [moved, size], "stop_ratio_f")], "stop_ratio", to=TensorProto.DOUBLE)
        below = b.op("Less", [ratio, "stop_threshold"], "stop_below")  # NaN (0 / 0): no stop, as on the host
        ran = b.op("Add", [i, "cache_one_i64"], "stop_count_out")
        enough = b.op("Not", [b.op("Less", [ran, "stop_min_steps"], "stop_too_few")], "stop_enough")
        inner = b.op("And", [b.op("Greater", [i, "stop_zero_i64"], "stop_has_prev"),
                             b.op("Less", [ran, "steps"], "stop_before_last")], "stop_in_range")
        stop = b.op("And", [b.op("And", [below, enough], "stop_due"), inner], "stop_now")
        cond = b.op("Not", [stop], "stop_cond")
        return cond, b.op("Where", [stop, den, x_new], "stop_x")
