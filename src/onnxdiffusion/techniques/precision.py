"""The precision schedule: the steps it names run the high-precision backbone, in the host loop
(``ScheduleHost``) and the sampling graph (``ScheduleLoop``, the host's twin). The schedule itself is
runtime/hooks/schedule.py's ``PrecisionSchedule``."""

from __future__ import annotations

from .host_base import HostTechnique
from .loop_base import LoopTechnique, StepIO

NAME = "precision_schedule"


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

        from ..samplers.graph_backbone import load_backbone

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

        from ..samplers.graph_backbone import inline_backbone

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
