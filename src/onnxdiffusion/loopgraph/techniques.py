"""The per-step techniques' set-up before the sampling graph's loop: the registry's table refuses what cannot be
built into one graph, then each Loop twin (techniques/loop_base.LoopTechnique) adds its constants and pieces."""

from __future__ import annotations

from .backbone import Backbone
from .state import GraphState


def technique_prologues(b, pre: GraphState, bb: Backbone, form: str, whole: bool, techniques) -> tuple[list, list]:
    """Each technique's prologue, in order; the initializers and functions they add."""
    from ..techniques.registry import conflict

    on = [t.name for t in techniques]
    for k, a in enumerate(on):
        for other in on[k + 1:]:
            if (c := conflict(a, other, form, compiled=True)) is not None:
                raise ValueError(f"{a} with {other} is not built into a sampling graph: {c.reason}")
    extra_inits: list = []
    functions: list = []
    for t in techniques:
        if t.loop_only and (form != "loop" or whole):
            raise ValueError(f"{t.name} is built for the Loop form (not unrolled, not whole)")
        t.prologue(b, bb, form, pre)
        extra_inits += t.initializers()
        functions += t.functions()
    pre.techniques = list(techniques)
    return extra_inits, functions
