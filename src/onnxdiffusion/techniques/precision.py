"""The precision schedule: the steps it names run the high-precision backbone, in the host loop
(``ScheduleHost``) and the sampling graph (``ScheduleLoop``, the host's twin). The schedule itself,
``PrecisionSchedule``, is below; quantize/schedule_select.py selects it.

A per-step precision schedule, run time's side: which steps run the high-precision backbone
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

from .host_base import HostTechnique
from .loop_base import LoopTechnique, StepIO


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


NAME = "precision_schedule"


def read_record(entry) -> PrecisionSchedule | None:
    """The precision schedule a backbone's manifest entry (a manifest Component) records, or None."""
    return PrecisionSchedule.from_dict(entry.precision_schedule) if entry.precision_schedule else None


class ScheduleHost(HostTechnique):
    name = NAME

    def __init__(self, schedule, high_session):
        self.schedule, self.high_session = schedule, high_session

    def wrap(self, model_fn, ctx):
        high_fn = ctx.guided(self.high_session)
        ctx.backbones.append(high_fn)
        return self.schedule.wrap(model_fn, high_fn)


class ScheduleLoop(LoopTechnique):
    """An ``If`` on the step's timestep runs the high-precision backbone or the quantized one (high when
    ``lo_r <= t <= hi_r`` for some range r, compared in float32 on the table's t). In the Loop form each branch
    holds its backbone's weights (read from two scopes out, ONNX Runtime did not pre-pack them and its MatMuls
    rounded differently from the host's); unrolled, both are outer-scope initializers, stored once."""

    name = NAME
    loop_only = False

    def __init__(self, schedule, high_model):
        if high_model is None:
            raise ValueError("a precision schedule needs its high-precision backbone, and the other way round")
        self.schedule, self.high_model = schedule, high_model

    def prologue(self, b, bb, form: str, state) -> None:
        import numpy as np

        from ..loopgraph.backbone import load_backbone

        self.high, self.low, self.local_weights = load_backbone(self.high_model, prefix="unet_high/"), bb, form == "loop"
        if {k for k in bb.io if k != "out"} != {k for k in self.high.io if k != "out"}:
            raise ValueError(f"the high-precision backbone's inputs {sorted(self.high.io)} differ from the quantized "
                             f"one's {sorted(bb.io)}")
        self.lo = b.const("sched_lo", np.asarray(self.schedule.lo, np.float32))
        self.hi = b.const("sched_hi", np.asarray(self.schedule.hi, np.float32))
        self.zero = b.const("sched_zero_f", np.array(0.0, np.float32))

    def functions(self) -> list:
        return list(self.high.functions)

    def models(self) -> list:
        return [self.high_model]

    def backbone_initializers(self) -> list:
        return [] if self.local_weights else self.low.initializers + self.high.initializers

    def call_backbone(self, b, bb, remap: dict[str, str], step: StepIO) -> str:
        from onnx import TensorProto, helper

        from ..loopgraph.backbone import inline_backbone

        n, high = step.n, self.high
        ge = b.op("GreaterOrEqual", [step.t, self.lo], n("sched_ge"))
        le = b.op("LessOrEqual", [step.t, self.hi], n("sched_le"))
        inside = b.op("Cast", [b.op("And", [ge, le], n("sched_in"))], n("sched_in_f"), to=TensorProto.FLOAT)
        use_high = b.op("Greater", [b.op("ReduceMax", [inside], n("sched_any"), keepdims=0), self.zero], n("sched_high"))
        high_remap = {high.io[role]: remap[name] for role, name in bb.io.items() if name in remap}
        branches = {}
        for key, net, binding in (("then", high, high_remap), ("else", bb, remap)):
            nodes: list = []
            out = inline_backbone(nodes, net, binding, step.tag)
            result = n(f"{key}_backbone_out")
            nodes.append(helper.make_node("Identity", [out], [result], name=result))
            branches[key] = helper.make_graph(nodes, n(f"{key}_branch"), [],
                                              [helper.make_tensor_value_info(result, TensorProto.FLOAT, None)],
                                              initializer=net.initializers if self.local_weights else None)
        out = n("scheduled_out")
        b.nodes.append(helper.make_node("If", [use_high], [out], name=n("precision_switch"),
                                        then_branch=branches["then"], else_branch=branches["else"]))
        return out
