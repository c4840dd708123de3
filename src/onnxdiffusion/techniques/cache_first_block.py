"""First-block cache (transformers), ``first_block:THRESHOLD``: run the first block; if its residual changed by
less than THRESHOLD (mean |r - r_prev| / mean |r_prev|, as diffusers' FirstBlockCacheConfig) reuse the other
blocks' residual. The ratio is cache_math's float32 arithmetic in its fixed summation order, twinned op for op
in the Loop graph, so both forms decide the same steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..samplers.cache_math import relative_change
from .cache_base import DOUBLE, FLOAT, CacheSpec, GraphStep, Policy, finite_threshold, same_shape


@dataclass(frozen=True)
class FirstBlock(CacheSpec):
    threshold: float = 0.0

    method: ClassVar[str] = "first_block"
    usage: ClassVar[str] = "first_block:THRESHOLD"

    @classmethod
    def parse_args(cls, spec: str, args: list[str]) -> "FirstBlock":
        return cls(finite_threshold(spec, cls.usage, args[0]))

    def check(self, spec: str) -> None:
        finite_threshold(spec, self.usage, str(self.threshold))

    @property
    def noop(self) -> bool:
        return self.threshold == 0.0

    def __str__(self) -> str:
        return f"first_block:{self.threshold:g}"

    def loop_feeds(self) -> dict[str, np.ndarray]:
        return {"cache_threshold": np.array(self.threshold, np.float64)}

    def policy(self) -> "_Policy":
        return _Policy(self)

    def graph_state(self, b, span_type: int) -> list[tuple[str, int, str]]:
        return [("cache_zero_f", FLOAT, "cache_prev"), ("cache_zero_f", FLOAT, "cache_residual")]

    def graph_step(self, s: GraphStep) -> tuple[str, str]:
        from .graph_fold import fold_sum

        b, sg, i = s.b, s.sg, s.i
        hidden, probe = s.got[sg.hidden_in[0]], s.got[sg.probe[0]]
        r = b.op("Sub", [hidden, probe], "cache_r")
        moved = fold_sum(b, b.op("Abs", [b.op("Sub", [r, "cache_prev_in"], "cache_dr")], "cache_abs_dr"), "cache_fold_dr")
        size = fold_sum(b, b.op("Abs", ["cache_prev_in"], "cache_abs_prev"), "cache_fold_prev")
        ratio = b.op("Cast", [b.op("Div", [moved, size], "cache_ratio_f")], "cache_ratio", to=DOUBLE)
        first = b.op("Equal", [i, "cache_zero_i64"], "cache_first_step")
        changed = b.op("Greater", [ratio, "cache_threshold"], "cache_changed")
        off = b.op("Not", [b.op("Greater", ["cache_threshold", "cache_zero_d"], "cache_on")], "cache_off")
        full = b.op("Or", [b.op("Or", [first, changed], "cache_first_or_changed"), off], "cache_full")

        def compute(sub) -> list[str]:
            out = s.run_rest(sub)
            return [out, sub.op("Sub", [out, hidden], "cache_new_residual"), r]

        def reuse(sub) -> list[str]:
            return [sub.op("Add", [hidden, "cache_residual_in"], "cache_reused"), "cache_residual_in", "cache_prev_in"]

        span, _, _ = s.switch(full, compute, reuse, ["cache_span", "cache_residual_out", "cache_prev_out"],
                              [FLOAT, FLOAT, FLOAT])
        return full, span


class _Policy(Policy):
    def __init__(self, spec: FirstBlock):
        self.threshold, self.prev, self.residual = spec.threshold, None, None
        self.hidden = self.probe = None

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        if self.hidden is None:
            return None  # the first call computes; update() settles which tensors are the stream
        r = f[self.hidden] - f[self.probe]
        if self.prev is not None:
            # diffusers' ratio of float32 means, summed in the order the Loop graph sums (cache_math)
            if not float(relative_change(r, self.prev)) > self.threshold:
                return f[self.hidden] + self.residual
        self.prev = r
        return None

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        if self.hidden is None:
            self.hidden = same_shape(sg.hidden_in, f, out.shape)
            self.probe = same_shape(sg.probe, f, out.shape)
            self.prev = f[self.hidden] - f[self.probe]
        self.residual = out - f[self.hidden]
