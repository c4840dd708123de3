"""TaylorSeer (transformers), ``taylorseer:INTERVAL[:ORDER]``: the other blocks' output predicted by a Taylor
series in the step index (finite differences over full steps), a full step every INTERVAL steps after 3
warm-up steps, ORDER 1 by default: what diffusers' TaylorSeerCacheConfig does with those blocks as
cache_identifiers (factors kept in float32 here). The Loop graph carries one factor per order, their count
and the last full step. The series (host ``Taylor``, graph ``taylor_update`` / ``taylor_predict``) is shared
with the residual cache (cache_residual.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import UserError
from ..samplers.cache_math import taylor_coefficient
from .cache_base import DOUBLE, FLOAT, INT64, CacheSpec, GraphStep, Policy, interval, ints


@dataclass(frozen=True)
class TaylorSeer(CacheSpec):
    interval: int = 1
    order: int = 1
    warmup: int = 3  # full steps before the first prediction (diffusers' default)

    method: ClassVar[str] = "taylorseer"
    usage: ClassVar[str] = "taylorseer:INTERVAL[:ORDER]"
    max_args: ClassVar[int] = 2

    @classmethod
    def parse_args(cls, spec: str, args: list[str]):
        nums = ints(spec, cls.usage, args)
        made = cls(interval=nums[0], order=nums[1] if len(nums) > 1 else 1)
        made.check(spec)
        return made

    def check(self, spec: str) -> None:
        interval(spec, self.interval)
        if not 0 <= self.order <= 4:
            raise UserError(f"cache spec {spec!r}: ORDER must be in [0, 4]")

    @property
    def noop(self) -> bool:
        return self.interval == 1

    def __str__(self) -> str:
        return f"{self.method}:{self.interval}:{self.order}"

    def record(self) -> dict:
        return {"method": self.method, "order": self.order}

    def loop_feeds(self) -> dict[str, np.ndarray]:
        return {"cache_interval": np.array(self.interval, np.int64)}

    def policy(self) -> Policy:
        return Taylor(self)

    def graph_state(self, b, span_type: int) -> list[tuple[str, int, str]]:
        b.const("cache_warmup_i64", np.array(self.warmup, np.int64))
        return taylor_state(b, self.order)

    def graph_step(self, s: GraphStep) -> tuple[str, str]:
        b, i, order = s.b, s.i, self.order
        factors = [f"cache_factor{k}_in" for k in range(order + 1)]
        warm = b.op("Less", [i, "cache_warmup_i64"], "cache_warm")
        since = b.op("Sub", [b.op("Sub", [i, "cache_warmup_i64"], "cache_after_warmup"), "cache_one_i64"], "cache_since")
        due = b.op("Equal", [b.op("Mod", [since, "cache_interval"], "cache_phase"), "cache_zero_i64"], "cache_due")
        empty = b.op("Equal", ["cache_count_in", "cache_zero_i64"], "cache_empty")
        full = b.op("Or", [b.op("Or", [warm, due], "cache_warm_or_due"), empty], "cache_full")
        gap = b.op("Sub", [i, "cache_last_in"], "cache_gap")

        def compute(sub) -> list[str]:
            out = s.run_rest(sub)
            return [out, *taylor_update(sub, out, factors, gap, order), i]

        def predict(sub) -> list[str]:
            return [taylor_predict(sub, factors, gap, order), *factors, "cache_count_in", "cache_last_in"]

        outs = ["cache_span", *[f"cache_factor{k}_out" for k in range(order + 1)], "cache_count_out", "cache_last_out"]
        span, *_ = s.switch(full, compute, predict, outs, [FLOAT] * (order + 2) + [INT64, INT64])
        return full, span


class Taylor(Policy):
    """TaylorSeer on a tensor: finite differences over full steps, extrapolated in the step index."""

    def __init__(self, spec: TaylorSeer):
        self.spec, self.factors, self.last_full = spec, [], None

    def _full(self, step: int) -> bool:
        s = self.spec
        return step < s.warmup or (step - s.warmup - 1) % s.interval == 0 or not self.factors

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        return None if self._full(step) else self.predict(step)

    def predict(self, step: int) -> np.ndarray:
        d = step - self.last_full
        pred = self.factors[0]
        for k, fk in enumerate(self.factors[1:], 1):
            pred = pred + fk * taylor_coefficient(d, k)
        return pred

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        new = [out.astype(np.float32)]
        if self.last_full is not None:
            gap = step - self.last_full
            for k in range(self.spec.order):
                if k >= len(self.factors):
                    break
                new.append((new[k] - self.factors[k]) / np.float32(gap))
        self.factors, self.last_full = new[: self.spec.order + 1], step


def taylor_state(b, order: int) -> list[tuple[str, int, str]]:
    """The series' carried state (one factor per order, their count, the last full step) and its constants."""
    b.const("cache_cap_i64", np.array(order + 1, np.int64))
    state = [("cache_zero_f", FLOAT, f"cache_factor{k}") for k in range(order + 1)]
    state += [("cache_zero_i64", INT64, "cache_count"), ("cache_minus_one_i64", INT64, "cache_last")]
    for k in range(1, order + 1):
        b.const(f"cache_k{k}", np.array(k, np.int64))
        b.const(f"cache_fact{k}", np.array(math.factorial(k), np.float64))
    b.const("cache_k0", np.array(0, np.int64))
    return state


def taylor_update(s, value: str, factors: list[str], gap: str, order: int) -> list[str]:
    """Taylor.update's twin: the new factors (finite differences over full steps) and their count."""
    new = [value]
    gap_f = s.op("Cast", [gap], "cache_gap_f", to=FLOAT)
    for k in range(order):
        diff = s.op("Div", [s.op("Sub", [new[k], factors[k]], f"cache_delta{k}"), gap_f], f"cache_diff{k}")
        have = s.op("Less", [f"cache_k{k}", "cache_count_in"], f"cache_have{k}")
        new.append(s.op("Where", [have, diff, factors[k + 1]], f"cache_new{k + 1}"))
    count = s.op("Min", [s.op("Add", ["cache_count_in", "cache_one_i64"], "cache_count1"), "cache_cap_i64"],
                 "cache_count_next")
    return [*new, count]


def taylor_predict(s, factors: list[str], gap: str, order: int) -> str:
    """Taylor.predict's twin: the factors' series at `gap` steps past the last full step."""
    gap_d = s.op("Cast", [gap], "cache_gap_d", to=DOUBLE)
    pred, power = factors[0], None
    for k in range(1, order + 1):
        power = gap_d if power is None else s.op("Mul", [power, gap_d], f"cache_pow{k}")
        coef = s.op("Cast", [s.op("Div", [power, f"cache_fact{k}"], f"cache_coef{k}_d")], f"cache_coef{k}", to=FLOAT)
        term = s.op("Add", [pred, s.op("Mul", [factors[k], coef], f"cache_term{k}")], f"cache_sum{k}")
        have = s.op("Less", [f"cache_k{k}", "cache_count_in"], f"cache_use{k}")
        pred = s.op("Where", [have, term, pred], f"cache_pred{k}")
    return pred
