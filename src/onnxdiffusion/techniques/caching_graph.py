"""Step caching in the Loop graph: the method's policy as loop-carried state and an ``If``.

The backbone comes cut in three (caching.cut: first -> rest -> tail); each step runs `first`, the method
decides (its ``graph_step``, the host policy's twin op for op), and an ``If`` runs `rest` (the span a cached
step skips) or stands in for it with the carried tensors, then `tail`.

Graph inputs, each with a default that caches nothing (every step runs the span: the plain Loop's image bit
for bit): ``cache_interval`` (int64), ``cache_threshold`` (double). The interval and the threshold are
run-time choices; the method and its structure (deepcache's BRANCH, taylorseer's ORDER) are the compiled
graph's. Output ``cache_computed`` (bool, one per step): whether the span ran.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ..loopgraph.backbone import BACKBONE_IO, inline_backbone, load_component
from .cache_base import CacheSpec, GraphStep
from .caching import NAME
from .graph_fold import fold_constants
from .loop_base import Carried, LoopTechnique, StepIO

PIECES = ("cache_first/", "cache_rest/", "cache_tail/")
F, I64, F64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.DOUBLE, TensorProto.BOOL


def _piece(model, prefix: str):
    g = model.graph
    ins, outs = [i.name for i in g.input], [o.name for o in g.output]
    return load_component(model, {"out": outs[0], **{f"in:{k}": v for k, v in enumerate(ins)}}, prefix), ins, outs


class CacheLoop(LoopTechnique):
    """Step caching's Loop twin for one compiled method: `spec` its typed spec, `sg` the backbone's SplitGraphs."""

    name = NAME

    def __init__(self, spec: CacheSpec, sg):
        self.spec, self.sg = spec, sg
        self.pieces = [_piece(m, p) for m, p in zip((sg.first, sg.rest, sg.tail), PIECES)]
        # the span's output: float, or (DeepCache on an int8-static UNet) the quantized tensor the next block reads
        self.span_type = sg.rest.graph.output[0].type.tensor_type.elem_type or F
        self.state: list[tuple[str, int, str]] = []

    def inputs(self) -> list:
        return [helper.make_tensor_value_info("cache_interval", I64, []),
                helper.make_tensor_value_info("cache_threshold", F64, []),
                *(helper.make_tensor_value_info(n, t, dims) for n, t, dims, _ in self.spec.graph_inputs())]

    def prologue(self, b, bb, form: str, state) -> None:
        b.const("cache_interval", np.array(1, np.int64))
        b.const("cache_threshold", np.array(0.0, np.float64))
        fold_constants(b)
        b.const("cache_zero_i64", np.array(0, np.int64))
        b.const("cache_minus_one_i64", np.array(-1, np.int64))
        b.const("cache_zero_f", np.array(0.0, np.float32))  # every float state starts as this broadcast zero
        b.const("cache_zero_d", np.array(0.0, np.float64))
        for name, _, _, default in self.spec.graph_inputs():  # a method's own inputs, defaults caching nothing
            b.const(name, default)
        self.state = self.spec.graph_state(b, self.span_type)

    def functions(self) -> list:
        return [f for p in self.pieces for f in p[0].functions]

    def backbone_initializers(self) -> list:
        # the rest's weights live in the If's compute branch (ORT pre-packs them there)
        return self.pieces[0][0].initializers + self.pieces[2][0].initializers

    def carried(self) -> Carried:
        st = self.state
        return Carried(body_in=[helper.make_tensor_value_info(f"{s}_in", t, None) for _, t, s in st],
                       body_out=[helper.make_tensor_value_info(f"{s}_out", t, None) for _, t, s in st],
                       loop_in=[init for init, _, _ in st],
                       loop_out=[f"{s}_final" for _, _, s in st],
                       scan_body=[helper.make_tensor_value_info("cache_computed_step", BOOL, [])],
                       scan_out=["cache_computed"],
                       graph_out=[helper.make_tensor_value_info("cache_computed", BOOL, ["steps_run"])])

    def call_backbone(self, b, bb, remap: dict[str, str], step: StepIO) -> str:
        """first -> If(full: rest | carried stand-in) -> tail inlined in a Loop body; returns the backbone output."""
        (first, f_in, f_out), (rest, r_in, _), (tail, t_in, _) = self.pieces
        i = step.i
        feed = {BACKBONE_IO[role] if role in ("sample", "timestep") else role.split(":", 1)[1]: remap[name]
                for role, name in bb.io.items() if name in remap}
        inline_backbone(b.nodes, first, {PIECES[0] + n: feed[n] for n in f_in}, "")
        got = {n: feed[n] if n in f_in else PIECES[0] + n for n in f_out}  # a graph input passes straight through

        def run_rest(sub) -> str:
            return inline_backbone(sub.nodes, rest, {PIECES[1] + n: got[n] for n in r_in}, "")

        def switch(cond: str, compute, reuse, outs: list[str], types: list[int]) -> list[str]:
            then = _branch(b, "cache_compute", compute, types, rest.initializers)  # weights local: ORT pre-packs them
            other = _branch(b, "cache_reuse", reuse, types)
            b.nodes.append(helper.make_node("If", [cond], outs, name="cache_switch", then_branch=then,
                                            else_branch=other))
            return outs

        full, span = self.spec.graph_step(GraphStep(b, got, i, self.sg, self.span_type, run_rest, switch))
        b.op("Identity", [full], "cache_computed_step")
        binding = {PIECES[2] + n: span if n == self.sg.span_outputs[0] else got[n] if n in got else feed[n]
                   for n in t_in}
        return inline_backbone(b.nodes, tail, binding, "")


def _branch(b, name: str, build, types: list[int], inits=None):
    """An If branch: `build(sub)` appends nodes to a fresh builder and returns its outputs' names."""
    sub = type(b)()
    outs = build(sub)
    names = [sub.op("Identity", [t], f"{name}_o{k}") for k, t in enumerate(outs)]
    return helper.make_graph(sub.nodes, name, [], [helper.make_tensor_value_info(n, ty, None)
                                                   for n, ty in zip(names, types)], initializer=inits)
