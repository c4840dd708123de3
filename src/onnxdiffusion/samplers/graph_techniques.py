"""The per-step techniques' set-up before the sampling graph's loop: ControlNets (graph_control.py), the
precision schedule (graph_schedule.py), step caching (graph_cache.py) and adaptive stopping (graph_stop.py)."""

from __future__ import annotations

import onnx

from .graph_backbone import Backbone, load_backbone


def technique_prologues(b, pre: dict, bb: Backbone, form: str, whole: bool, control, residuals: list[str],
                         schedule, high_backbone, cache, stop: bool,
                         cond_names: dict[str, str]) -> tuple[list, Backbone | None, list, list]:
    """The per-step techniques' set-up before the loop (ControlNets, precision schedule, caching, stopping):
    their nets, the high-precision backbone, and the initializers and functions they add. `cond_names`: each
    conditioning input's cond-half name (a cond-only net reads those)."""
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
    if cache is not None:
        if form != "loop" or schedule is not None:
            raise ValueError("step caching is built for the Loop form without a precision schedule")
        from .graph_cache import cache_prologue

        cache_prologue(b, pre, *cache)
        functions += pre["cache"]["functions"]
    if stop:
        if form != "loop" or whole:
            raise ValueError("adaptive stopping is built for the Loop form (not unrolled, not whole)")
        from .graph_stop import stop_prologue

        stop_prologue(b, pre)
    return nets, high, extra_inits, functions
