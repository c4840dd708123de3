"""DeepCache (UNets), ``deepcache:INTERVAL[:BRANCH]``: the deep path's feature reused; a full step every INTERVAL
steps; BRANCH shallow down/up block pairs always run (default 1), or BRANCH ``L<N>`` at DeepCache's layer
granularity: conv_in, the next N - 1 down layers and the last N up resnets always run (L1 the cheapest).
The feature is reused as it is, so a quantized span (int8-static UNet) caches too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import UserError
from .cache_base import FLOAT, CacheSpec, GraphStep, Policy, interval, ints


@dataclass(frozen=True)
class DeepCache(CacheSpec):
    interval: int = 1
    branch: int = 1  # shallow down/up block pairs
    layers: int = 0  # > 0: the shallow part in skip layers instead (BRANCH "L<layers>")

    method: ClassVar[str] = "deepcache"
    usage: ClassVar[str] = "deepcache:INTERVAL[:BRANCH|L<N>]"
    max_args: ClassVar[int] = 2
    float_span: ClassVar[bool] = False

    @classmethod
    def parse_args(cls, spec: str, args: list[str]):
        layers = 0
        if len(args) == 2 and args[1][:1] in ("L", "l"):
            text = args[1][1:]
            if not text.isdigit() or int(text) < 1:
                raise UserError(f"cache spec {spec!r}: a layer branch is L<N> with N >= 1 (e.g. deepcache:4:L1)")
            args, layers = args[:1], int(text)
        nums = ints(spec, cls.usage, args)
        made = cls(interval=nums[0], branch=nums[1] if len(nums) > 1 else 1, layers=layers)
        made.check(spec)
        return made

    def check(self, spec: str) -> None:
        interval(spec, self.interval)
        if self.branch < 1:
            raise UserError(f"cache spec {spec!r}: BRANCH must be >= 1")
        if self.layers < 0:
            raise UserError(f"cache spec {spec!r}: a layer branch is L<N> with N >= 1 (e.g. deepcache:4:L1)")

    @property
    def noop(self) -> bool:
        return self.interval == 1

    @property
    def branch_text(self) -> str:
        return f"L{self.layers}" if self.layers else str(self.branch)

    def __str__(self) -> str:
        return f"deepcache:{self.interval}:{self.branch_text}"

    def span_args(self) -> dict:
        return {"branch": self.branch, **({"layers": self.layers} if self.layers else {})}

    def split_key(self) -> tuple:
        return (self.method, self.branch_text)

    def record(self) -> dict:
        return {"method": self.method, **({"layers": self.layers} if self.layers else {"branch": self.branch})}

    def loop_feeds(self) -> dict[str, np.ndarray]:
        return {"cache_interval": np.array(self.interval, np.int64)}

    def policy(self) -> Policy:
        return _Policy(self)

    def graph_state(self, b, span_type: int) -> list[tuple[str, int, str]]:
        zero = "cache_zero_f"
        if span_type != FLOAT:  # an int8-static UNet: the quantized tensor the next block reads
            from onnx import helper

            zero = b.const("cache_zero_span", np.array(0, helper.tensor_dtype_to_np_dtype(span_type)))
        return [(zero, span_type, "cache_feature")]

    def graph_step(self, s: GraphStep) -> tuple[str, str]:
        b = s.b
        full = b.op("Equal", [b.op("Mod", [s.i, "cache_interval"], "cache_phase"), "cache_zero_i64"], "cache_full")
        span, = s.switch(full, lambda sub: [s.run_rest(sub)], lambda sub: ["cache_feature_in"], ["cache_span"],
                         [s.span_type])
        b.op("Identity", [span], "cache_feature_out")
        return full, span


class _Policy(Policy):
    def __init__(self, spec: DeepCache):
        self.interval, self.feature = spec.interval, None

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        return None if step % self.interval == 0 or self.feature is None else self.feature

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        self.feature = out
