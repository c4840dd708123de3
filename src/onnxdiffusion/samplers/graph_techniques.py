"""The per-step techniques' set-up before the sampling graph's loop: ControlNets (graph_control.py), the
precision schedule (graph_schedule.py), then the techniques package's Loop twins (step caching, adaptive
stopping), after the registry's table refuses what cannot combine."""

from __future__ import annotations

import onnx

from .graph_backbone import Backbone, load_backbone


def technique_prologues(b, pre: dict, bb: Backbone, form: str, whole: bool, control, residuals: list[str],
                         schedule, high_backbone, techniques,
                         cond_names: dict[str, str]) -> tuple[list, Backbone | None, list, list]:
    """The per-step techniques' set-up before the loop (ControlNets, precision schedule, caching, stopping):
    their nets, the high-precision backbone, and the initializers and functions they add. `cond_names`: each
    conditioning input's cond-half name (a cond-only net reads those)."""
    from ..techniques.registry import conflict

    on = [t.name for t in techniques] + ["controlnet"] * bool(control) + ["precision_schedule"] * (schedule is not None)
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
    high = None
    if (schedule is None) != (high_backbone is None):
        raise ValueError("a precision schedule needs its high-precision backbone, and the other way round")
    if schedule is not None:
        from .graph_schedule import schedule_prologue

        high = load_backbone(high_backbone, prefix="unet_high/")
        # in the Loop form (one copy of each branch) the weights live in the If branches: read from two
        # scopes out, ONNX Runtime did not pre-pack them and its MatMuls rounded differently from the host's
        schedule_prologue(b, pre, schedule, high, bb, local_weights=form == "loop")
        functions += high.functions
    for t in techniques:
        if t.loop_only and (form != "loop" or whole):
            raise ValueError(f"{t.name} is built for the Loop form (not unrolled, not whole)")
        t.prologue(b, bb)
        functions += t.functions()
    pre["techniques"] = list(techniques)
    return nets, high, extra_inits, functions
