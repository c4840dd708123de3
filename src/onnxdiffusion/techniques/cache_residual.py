"""Residual cache (transformers), ``residual:INTERVAL[:ORDER]``: the other blocks' residual (their output minus
their input) cached and added to the first block's fresh output, extrapolated by a Taylor series of ORDER
(1 by default) in the step index; full steps at gaps that ramp 1, 2, 3, ... up to INTERVAL (steps 0, 1, 3,
6, 10, 15, ...): the early steps, where the layout forms, run more often. A cached step is known before
the first piece runs, so it runs the first piece cut to the image stream it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .cache_base import FLOAT, INT64, GraphStep, Policy, same_shape
from .cache_taylorseer import Taylor, TaylorSeer, taylor_predict, taylor_state, taylor_update


@dataclass(frozen=True)
class Residual(TaylorSeer):
    method: ClassVar[str] = "residual"
    usage: ClassVar[str] = "residual:INTERVAL[:ORDER]"
    prunes_first: ClassVar[bool] = True

    def policy(self) -> Policy:
        return _Policy(self)

    def graph_state(self, b, span_type: int) -> list[tuple[str, int, str]]:
        # the ramp: next full step 0, first gap 1
        return taylor_state(b, self.order) + [("cache_zero_i64", INT64, "cache_next"), ("cache_one_i64", INT64, "cache_gap")]

    def graph_step(self, s: GraphStep) -> tuple[str, str]:
        b, i, order = s.b, s.i, self.order
        hidden = s.got[s.sg.hidden_in[0]]
        factors = [f"cache_factor{k}_in" for k in range(order + 1)]
        full = b.op("GreaterOrEqual", [i, "cache_next_in"], "cache_full")
        gap = b.op("Sub", [i, "cache_last_in"], "cache_gap")

        def compute(sub) -> list[str]:
            out = s.run_rest(sub)
            new = taylor_update(sub, sub.op("Sub", [out, hidden], "cache_new_residual"), factors, gap, order)
            ramp = sub.op("Min", [sub.op("Add", ["cache_gap_in", "cache_one_i64"], "cache_gap1"), "cache_interval"],
                          "cache_gap_next")
            return [out, *new, i, sub.op("Add", [i, "cache_gap_in"], "cache_next_full"), ramp]

        def predict(sub) -> list[str]:
            span = sub.op("Add", [hidden, taylor_predict(sub, factors, gap, order)], "cache_predicted")
            return [span, *factors, "cache_count_in", "cache_last_in", "cache_next_in", "cache_gap_in"]

        outs = ["cache_span", *[f"cache_factor{k}_out" for k in range(order + 1)], "cache_count_out", "cache_last_out",
                "cache_next_out", "cache_gap_out"]
        span, *_ = s.switch(full, compute, predict, outs, [FLOAT] * (order + 2) + [INT64] * 4)
        return full, span


class _Policy(Policy):
    """The span's residual (output - hidden input) on a ramping schedule, Taylor-extrapolated over full steps
    and added to this step's first-block output: a cached step still moves with what the first block sees."""

    def __init__(self, spec: Residual):
        self.spec, self.taylor, self.hidden = spec, Taylor(spec), None
        self.next_full, self.gap = 0, 1

    def skips(self, step: int) -> bool:
        """Known before the first piece runs: a cached step (so only its image-stream output is needed)."""
        return self.hidden is not None and step < self.next_full

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        return f[self.hidden] + self.taylor.predict(step) if self.skips(step) else None

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        if self.hidden is None:
            self.hidden = same_shape(sg.hidden_in, f, out.shape)
        self.taylor.update(step, f, out - f[self.hidden], sg)
        # full steps 0, 1, 3, 6, 10, ...: the gap grows by one after each, up to INTERVAL
        self.next_full, self.gap = step + self.gap, min(self.gap + 1, self.spec.interval)
