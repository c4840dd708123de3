"""Calibration statistics reduced inside the graph: a calibration run returns a few numbers per tensor.

Making every calibrated activation a graph output keeps all of them alive until the call returns
(at SD1.5 size and a calibration batch of 8 that is several GB per call, on top of the weights).
Here each calibrated tensor instead feeds small reduction nodes (ReduceMin/ReduceMax, or a
fixed-range histogram by ScatterElements-add), so ONNX Runtime frees the activation as it would in
the plain backbone; what comes back per call is two scalars or `bins` counts per tensor, which the
caller accumulates batch by batch. Pure `onnx` graph building plus the accumulation; sessions come
from runner.session (skeletons of > 2 GB backbones included).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import files

PREFIX = "calib_stat"


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def minmax_model(model: onnx.ModelProto, tensors: Sequence[str]) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of `model` (a skeleton stays one) whose outputs are each tensor's min and max, in that
    order per tensor: [min t0, max t0, min t1, ...]."""
    work = files.copy(model)
    nodes, outs = [], []
    for i, t in enumerate(tensors):
        chain = []
        for op in ("ReduceMin", "ReduceMax"):
            name = f"{PREFIX}/{i}/{op}"
            chain.append(helper.make_node(op, [t], [name], name=name, keepdims=0))
            outs.append(name)
        nodes.append((t, chain))
    replace_outputs(work, nodes, outs)
    return work, outs


def histogram_model(model: onnx.ModelProto, tensors: Sequence[str], bounds: Sequence[tuple[float, float]],
                    bins: int, absolute: bool = False) -> tuple[onnx.ModelProto, list[str]]:
    """A copy whose outputs are one fixed-range histogram per tensor (`bins` float32 counts over
    [lo, hi]; values outside are counted in the end bins, NaN is not counted), of |x| if `absolute`.

    Bin edges are np.linspace(lo, hi, bins + 1), as np.histogram's with range=(lo, hi)."""
    if default_opset(model) < 16:
        raise ValueError(f"in-graph histograms need opset >= 16 (ScatterElements reduction), model has {default_opset(model)}")
    work = files.copy(model)
    g = work.graph
    nodes, outs = [], []
    g.initializer.extend([
        numpy_helper.from_array(np.zeros((bins,), np.float32), f"{PREFIX}/zeros"),
        numpy_helper.from_array(np.array([-1], np.int64), f"{PREFIX}/flat"),
        numpy_helper.from_array(np.array(0.0, np.float32), f"{PREFIX}/first"),
        numpy_helper.from_array(np.array(float(bins - 1), np.float32), f"{PREFIX}/last"),
    ])
    for i, (t, (lo, hi)) in enumerate(zip(tensors, bounds)):
        width = max(float(hi) - float(lo), 1e-30)
        p = f"{PREFIX}/{i}"
        g.initializer.extend([numpy_helper.from_array(np.array(-lo, np.float32), f"{p}/offset"),
                              numpy_helper.from_array(np.array(bins / width, np.float32), f"{p}/scale")])
        x, chain = t, []
        if absolute:
            chain.append(helper.make_node("Abs", [t], [f"{p}/abs"], name=f"{p}/abs"))
            x = f"{p}/abs"
        # NaN compares unequal to itself: its index is forced to 0 and its weight to 0.
        # ":name" is local to this tensor's nodes; anything else is used as given.
        steps = [("Reshape", [x, f"{PREFIX}/flat"], "flat"), ("Equal", [":flat", ":flat"], "ok"),
                 ("Add", [":flat", f"{p}/offset"], "shifted"), ("Mul", [":shifted", f"{p}/scale"], "scaled"),
                 ("Floor", [":scaled"], "floor"), ("Clip", [":floor", f"{PREFIX}/first", f"{PREFIX}/last"], "clipped"),
                 ("Where", [":ok", ":clipped", f"{PREFIX}/first"], "bin")]
        for op, ins, out in steps:
            args = [f"{p}/{a[1:]}" if a.startswith(":") else a for a in ins]
            chain.append(helper.make_node(op, args, [f"{p}/{out}"], name=f"{p}/{out}"))
        chain.append(helper.make_node("Cast", [f"{p}/bin"], [f"{p}/idx"], name=f"{p}/idx", to=TensorProto.INT64))
        chain.append(helper.make_node("Cast", [f"{p}/ok"], [f"{p}/w"], name=f"{p}/w", to=TensorProto.FLOAT))
        chain.append(helper.make_node("ScatterElements", [f"{PREFIX}/zeros", f"{p}/idx", f"{p}/w"], [f"{p}/hist"],
                                      name=f"{p}/hist", axis=0, reduction="add"))
        nodes.append((t, chain))
        outs.append(f"{p}/hist")
    replace_outputs(work, nodes, outs)
    return work, outs


def replace_outputs(model: onnx.ModelProto, nodes: list[tuple[str, list]], outs: list[str]) -> None:
    """The stat nodes go right after the producer of the tensor they read (in their own order); with
    ORT's priority-based execution order (runner.session(..., stats=True)) they then run right after
    it, so the activation is freed as soon as the backbone itself is done with it. ORT's default order
    runs them after everything else (measured on the embedded UNet: a median of 630 nodes later), which
    holds every calibrated activation of the call, as graph outputs would."""
    g = model.graph
    produced = {o for n in g.node for o in n.output}
    after: dict[str | None, list] = {}
    for tensor, chain in nodes:  # (the tensor a chain reads, its nodes in order)
        after.setdefault(tensor if tensor in produced else None, []).extend(chain)
    ordered = list(after.pop(None, []))  # graph inputs: first
    for n in g.node:
        ordered.append(n)
        for o in n.output:
            ordered.extend(after.pop(o, []))
    for rest in after.values():
        ordered.extend(rest)
    del g.node[:]
    g.node.extend(ordered)
    del g.output[:]
    g.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs)


def collect_minmax(sess, outs: list[str], feeds: Iterable[tuple[int, dict]], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-step (steps, tensors) min and max over every (step, feed) batch."""
    n = len(outs) // 2
    lo = np.full((steps, n), np.inf, np.float32)
    hi = np.full((steps, n), -np.inf, np.float32)
    for s, feed in feeds:
        v = np.asarray([float(a) for a in sess.run(outs, feed)], np.float32).reshape(n, 2)
        lo[s] = np.minimum(lo[s], v[:, 0])
        hi[s] = np.maximum(hi[s], v[:, 1])
    return lo, hi


def collect_histograms(sess, outs: list[str], feeds: Iterable[dict]) -> np.ndarray:
    """(tensors, bins) counts summed over every batch (float64: exact far past float32's 2^24)."""
    total = None
    for feed in feeds:
        got = np.stack([np.asarray(a, np.float64) for a in sess.run(outs, feed)])
        total = got if total is None else total + got
    return total
