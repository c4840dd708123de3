"""What every step-caching method is made of (the shared runner is caching.py, its Loop twin caching_graph.py).

A method is one class deriving from ``CacheSpec`` (a frozen dataclass: its typed settings), registered by name
in cache_methods.py. It says how its text parses, what the host loop's policy decides each step
(``policy()`` -> a ``Policy``), what the Loop graph carries and decides (``graph_state`` / ``graph_step``
over a ``GraphStep``), and what compile-loop records of it (``record``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

import numpy as np

from ..errors import UserError

# TensorProto's element types (values fixed by the ONNX spec): the method modules declare their Loop state
# with these, so the host side imports no onnx
FLOAT, INT64, DOUBLE, BOOL = 1, 7, 11, 9


@dataclass(frozen=True)
class CacheSpec:
    """One cache method's settings. Subclasses set ``method`` and ``usage`` and implement the hooks below."""

    method: ClassVar[str] = ""
    usage: ClassVar[str] = ""  # METHOD:ARG[:ARG], shown in errors and --help
    max_args: ClassVar[int] = 1
    prunes_first: ClassVar[bool] = False  # host: a cached step runs the first piece cut to what it reads
    float_span: ClassVar[bool] = True  # the span's output must be float (a quantized one: only reused as is)

    # --- parsing ---------------------------------------------------------------------------------
    @classmethod
    def parse_args(cls, spec: str, args: list[str]) -> "CacheSpec":
        raise NotImplementedError

    @classmethod
    def from_dict(cls, values: dict) -> "CacheSpec":
        """The Python-object form, ``{"method": NAME, field: value, ...}``: checked as the text form is."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names - {"method"})
        if unknown:
            raise UserError(f"cache {cls.method}: unknown setting {unknown[0]!r}; it takes {', '.join(sorted(names))}")
        try:
            spec = cls(**{k: v for k, v in values.items() if k != "method"})
        except (TypeError, ValueError) as e:
            raise UserError(f"cache {cls.method}: {e}") from None
        spec.check(repr(values))
        return spec

    def check(self, spec: str) -> None:
        """Refuses settings out of range, one line naming `spec` (the text or object given)."""

    @classmethod
    def compiled_default(cls) -> "CacheSpec":
        """compile-loop's bare ``--cache METHOD``: the structure it compiles in, at its defaults."""
        return cls()

    # --- what it is --------------------------------------------------------------------------------
    @property
    def noop(self) -> bool:
        """Never skips: the uncut backbone runs (bit-identical to no cache)."""
        raise NotImplementedError

    def span_args(self) -> dict:
        """Keyword arguments to the family's ``cache_span`` beyond the method name."""
        return {}

    def bind(self, pipe, steps: int) -> "CacheSpec":
        """This spec for one run of `steps` model evaluations on `pipe` (run-time data a method reads, e.g. from
        the folder's manifest); a one-line UserError where the run cannot go ahead. Called before any model runs."""
        return self

    def split_key(self) -> tuple:
        """Specs with the same key share one cut of the backbone."""
        return (self.method, 0)

    def record(self) -> dict:
        """What a Loop graph's manifest entry records of the cache it was compiled with (the structure only)."""
        return {"method": self.method}

    def loop_feeds(self) -> dict[str, np.ndarray]:
        """The Loop graph's run-time inputs for this spec."""
        raise NotImplementedError

    def check_compiled(self, record: dict | None) -> None:
        """A Loop graph whose manifest `record` says it was compiled without this method (or with another
        BRANCH / ORDER) refuses the spec in one line."""
        if record != self.record():
            have = "without step caching" if not record else "for " + " ".join(
                v if k == "method" else f"BRANCH L{v}" if k == "layers" else f"{k.upper()} {v}" for k, v in record.items())
            raise UserError(f"cache {self}: this folder's Loop graph was compiled {have}; recompile it with "
                            f"`onnxdiffusion compile-loop --cache {self}` or run --loop host")

    def check_graph(self, form: str, graph) -> None:
        """Whether the folder's compiled graph runs this spec (`graph()`: its SamplingGraph, opened on asking)."""
        if form == "loop":
            self.check_compiled(graph().cache)

    def graph_inputs(self) -> list[tuple[str, int, list, np.ndarray]]:
        """Run-time Loop-graph inputs of its own beyond ``cache_interval`` / ``cache_threshold``: (name, element
        type, dims, the default that caches nothing), fed by ``loop_feeds``. The compiled spec's are built in."""
        return []

    # --- host loop and Loop graph ----------------------------------------------------------------
    def policy(self) -> "Policy":
        raise NotImplementedError

    def graph_state(self, b, span_type: int) -> list[tuple[str, int, str]]:
        """Adds the method's constants to the builder `b`; returns its carried state, (initial, type, name);
        `span_type` the span output's element type."""
        raise NotImplementedError

    def graph_step(self, s: "GraphStep") -> tuple[str, str]:
        """Appends one step's decision and If to ``s.b``; returns (the 'span ran' bool, the span's output)."""
        raise NotImplementedError


class Policy:
    """What a cache policy decides in the host loop; by default nothing is known before the first piece runs."""

    def skips(self, step: int) -> bool:
        return False

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        """The span's stand-in for this step, or None: the span runs."""
        raise NotImplementedError

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        """After the span ran: `out` its output, `f` the first piece's outputs."""
        raise NotImplementedError


@dataclass
class GraphStep:
    """One Loop step's view for a method's ``graph_step``: the builder, the first piece's outputs by name (`got`),
    the step index `i`, the cut (`sg`), the span's element type, and `switch`, the If between running the span
    (`compute(sub)` must call ``run_rest(sub)``) and a stand-in (`reuse(sub)`)."""

    b: Any
    got: dict
    i: str
    sg: Any
    span_type: int
    run_rest: Callable[[Any], str]
    switch: Callable[..., list[str]]  # switch(cond, compute, reuse, outs, types) -> outs


def same_shape(names: list[str], f: dict, shape) -> str:
    for n in names:
        if f[n].shape == shape:
            return n
    raise UserError(f"step caching: no hidden-state candidate of shape {shape} in this backbone's cut")


def ints(spec: str, usage: str, args: list[str]) -> list[int]:
    try:
        return [int(a) for a in args]
    except ValueError:
        raise UserError(f"cache spec {spec!r}: expected {usage} with integers") from None


def interval(spec: str, value: int) -> int:
    if value < 1:
        raise UserError(f"cache spec {spec!r}: INTERVAL must be >= 1")
    return value


def finite_threshold(spec: str, usage: str, text: str) -> float:
    try:
        value = float(text)
        if not math.isfinite(value) or value < 0:
            raise ValueError
    except ValueError:
        raise UserError(f"cache spec {spec!r}: expected {usage} with a threshold >= 0") from None
    return value
