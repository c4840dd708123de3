"""The per-step techniques' set-up before the sampling graph's loop: ControlNets (graph_control.py), then the
techniques package's Loop twins, after the registry's table refuses what cannot combine."""

from __future__ import annotations

import onnx

from .graph_backbone import Backbone
from .graph_state import GraphState


def technique_prologues(b, pre: GraphState, bb: Backbone, form: str, whole: bool, control, residuals: list[str],
                         techniques, cond_names: dict[str, str]) -> tuple[list, list, list]:
    """The per-step techniques' set-up before the loop (ControlNets, then `techniques` in order): the nets, and
    the initializers and functions they add. `cond_names`: each conditioning input's cond-half name (a cond-only
    net reads those)."""
    from ..techniques.registry import conflict

    on = [t.name for t in techniques] + ["controlnet"] * bool(control)
    for k, a in enumerate(on):
        for other in on[k + 1:]:
            if (c := conflict(a, other, form, compiled=True)) is not None:
                raise ValueError(f"{a} with {other} is not built into a sampling graph: {c.reason}")
    extra_inits: list[onnx.TensorProto] = []
    functions: list = []
    nets = []
    if control:
        from .graph_control import control_prologue, load_net

        nets = [load_net(m, residuals, k) for k, m in enumerate(control[0])]
        control_prologue(b, pre, nets, residuals, control[2] if len(control) > 2 else None,
                         cond_names)
        extra_inits += [t for net in nets for t in net.initializers]
        functions += [f for net in nets for f in net.functions]
    for t in techniques:
        if t.loop_only and (form != "loop" or whole):
            raise ValueError(f"{t.name} is built for the Loop form (not unrolled, not whole)")
        t.prologue(b, bb, form)
        functions += t.functions()
    pre.techniques = list(techniques)
    return nets, extra_inits, functions
