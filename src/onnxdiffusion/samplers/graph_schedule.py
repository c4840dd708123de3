"""The per-step precision schedule in the sampling graph: an ``If`` on the step's timestep runs the
high-precision backbone or the quantized one (``quantize.schedule.PrecisionSchedule``'s twin:
high when ``lo_r <= t <= hi_r`` for some range r, compared in float32 on the table's t).

Both backbones' weights are outer-scope initializers of the main graph, stored once; each branch
holds one backbone's nodes reading the step's sample, timestep and conditioning from outside.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from .graph_backbone import Backbone, inline_backbone


def schedule_prologue(b, pre: dict, schedule, high: Backbone, low: Backbone, local_weights: bool = False) -> None:
    """Constants of the schedule, and the high-precision backbone, read by every step."""
    roles = {k for k in low.io if k != "out"}
    if roles != {k for k in high.io if k != "out"}:
        raise ValueError(f"the high-precision backbone's inputs {sorted(high.io)} differ from the quantized one's {sorted(low.io)}")
    pre["schedule"] = {
        "high": high,
        "lo": b.const("sched_lo", np.asarray(schedule.lo, np.float32)),
        "hi": b.const("sched_hi", np.asarray(schedule.hi, np.float32)),
        "zero": b.const("sched_zero_f", np.array(0.0, np.float32)),
        "local_weights": local_weights,
    }


def switch_backbones(b, pre: dict, low: Backbone, remap: dict[str, str], t: str, tag: str,
                     n: Callable[[str], str]) -> str:
    """If(t in a range) -> the high-precision backbone's output, else the quantized one's; returns the output."""
    s = pre["schedule"]
    high: Backbone = s["high"]
    ge = b.op("GreaterOrEqual", [t, s["lo"]], n("sched_ge"))
    le = b.op("LessOrEqual", [t, s["hi"]], n("sched_le"))
    inside = b.op("Cast", [b.op("And", [ge, le], n("sched_in"))], n("sched_in_f"), to=TensorProto.FLOAT)
    use_high = b.op("Greater", [b.op("ReduceMax", [inside], n("sched_any"), keepdims=0), s["zero"]], n("sched_high"))
    high_remap = {high.io[role]: remap[name] for role, name in low.io.items() if name in remap}
    branches = {}
    for key, bb, binding in (("then", high, high_remap), ("else", low, remap)):
        nodes: list[onnx.NodeProto] = []
        out = inline_backbone(nodes, bb, binding, tag)
        result = n(f"{key}_backbone_out")
        nodes.append(helper.make_node("Identity", [out], [result], name=result))
        branches[key] = helper.make_graph(nodes, n(f"{key}_branch"), [],
                                          [helper.make_tensor_value_info(result, TensorProto.FLOAT, None)],
                                          initializer=bb.initializers if s.get("local_weights") else None)
    out = n("scheduled_out")
    b.nodes.append(helper.make_node("If", [use_high], [out], name=n("precision_switch"),
                                    then_branch=branches["then"], else_branch=branches["else"]))
    return out
