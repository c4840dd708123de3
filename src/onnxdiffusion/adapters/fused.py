"""Fused at switch: the host loop's backbone runs an adapter's layers with merged weights instead of the
insertion points' low-rank branch every step.

A folder with insertion points (`lora points`) keeps its graph; from it the pipeline derives two backbone
sessions, each made on first use (LoraBackbone):
  plain  the graph with every branch taken out (the original graph, node for node): a generation without an
         adapter costs what the plain folder's does and gives its image bit for bit;
  fused  the branches of the layers this module can merge taken out and those layers' weights made
         overridable inputs (an initializer also listed as a graph input keeps its value unless fed); layers
         of other kinds keep their branch.
When an adapter set is used, W' = W + A B of each merged layer is computed once (numpy, kept on the set's
AdapterFeeds) and bound beside the sample, so a step costs the plain graph's plus what ORT loses by not
pre-packing those weights (experiments/lora/overhead.md). Quantized layers (per-channel symmetric int8:
MatMulIntegerToFloat, QLinearConv) are requantized on their own grid: q' = round(q + delta / s); a channel
whose merged weight outgrows the grid gets a scale of max |W'| / 127 (and a QLinearConv's int32 bias is
rescaled with it), so without a delta the integers are the plain ones.

Merged: float MatMul, 1x1 Conv (group 1), MatMulIntegerToFloat and 1x1 QLinearConv with int8 weights and zero
zero points. Kept as branches: Gemm / QGemm (the time embedding's: a batch-row product, where packing a fed
weight each call would cost more than the branch), k x k convs, MatMulNBits, QLinearMatMul (an int8 attention's
q/k/v projections), Q/DQ weights, float16 weights.
"""

from __future__ import annotations

import itertools
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..onnxio.files import write
from .points import A_SUFFIX, B_SUFFIX, module_path

QMAX = 127  # ORT's symmetric int8 weights: [-127, 127]
_SERIALS = itertools.count()


@dataclass(frozen=True)
class FusedLayer:
    """One merged layer's overridable inputs (graph input names)."""

    module: str
    kind: str  # matmul | conv | matmul_int8 | conv_int8
    weight: str
    scale: str = ""  # int8: the weight's scale (per output channel, or one)
    bias: str = ""  # conv_int8: the int32 bias (its scale is x_scale * w_scale)


def _branch_module(node: onnx.NodeProto) -> str | None:
    """'/lora/down_blocks.0.attn1.to_q/3/MatMul' -> 'down_blocks.0.attn1.to_q'."""
    parts = node.name.split("/")
    return parts[2] if len(parts) > 3 and parts[0] == "" and parts[1] == "lora" else None


def strip_branches(model: onnx.ModelProto, modules: set[str] | None = None) -> None:
    """Take the insertion-point branches of `modules` (None: all) out of `model` in place: the branch nodes,
    their A/B inputs and defaults; each layer's output gets its name back."""
    g = model.graph
    drop = [n for n in g.node if (m := _branch_module(n)) is not None and (modules is None or m in modules)]
    if not drop:
        return
    dropped = {id(n) for n in drop}
    restored = {o for n in drop for o in n.output if not o.startswith("/lora/")}
    keep = [n for n in g.node if id(n) not in dropped]
    for n in keep:
        n.output[:] = [o[:-len("/base")] if o.endswith("/base") and o[:-len("/base")] in restored else o
                       for o in n.output]
    names = {m + s for m in ({_branch_module(n) for n in drop}) for s in (A_SUFFIX, B_SUFFIX)}
    used = {i for n in keep for i in n.input}
    del g.node[:]
    g.node.extend(keep)
    inputs = [i for i in g.input if i.name not in names]
    del g.input[:]
    g.input.extend(inputs)
    inits = [t for t in g.initializer if t.name not in names and (not t.name.startswith("/lora/") or t.name in used)]
    del g.initializer[:]
    g.initializer.extend(inits)


def _array(t: onnx.TensorProto, base: str) -> np.ndarray:
    """A tensor's values, external data read from `base` by the project's reader (onnx's refuses the hard-linked
    data files `lora points` folders share with their source)."""
    if t.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    from ..onnxio.files import read_external_data

    holder = helper.make_model(helper.make_graph([], "tensor", [], [], initializer=[t]))
    read_external_data(holder, Path(base))
    return numpy_helper.to_array(holder.graph.initializer[0])


def _int8_zero(inits: dict, name: str, base: str) -> bool:
    if not name:
        return True
    t = inits.get(name)
    return t is not None and t.data_type == TensorProto.INT8 and not _array(t, base).any()


def _plan(node: onnx.NodeProto, inits: dict, base: str = "") -> tuple[str, list[str]] | None:
    """(kind, [weight, scale, bias]) of a layer this module merges, or None (it keeps its branch); `base`: the
    folder of the graph's external data (a zero point is read)."""
    ins = list(node.input) + [""] * 9
    op = node.op_type
    if op == "MatMul" and ins[1] in inits and inits[ins[1]].data_type == TensorProto.FLOAT and len(inits[ins[1]].dims) == 2:
        return "matmul", [ins[1]]
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    if op == "Conv" and group == 1 and ins[1] in inits and inits[ins[1]].data_type == TensorProto.FLOAT \
            and list(inits[ins[1]].dims[2:]) == [1, 1]:
        return "conv", [ins[1]]
    if op == "MatMulIntegerToFloat" and ins[1] in inits and ins[3] in inits and _int8_zero(inits, ins[5], base) \
            and inits[ins[1]].data_type == TensorProto.INT8 and len(inits[ins[1]].dims) == 2:
        return "matmul_int8", [ins[1], ins[3]]
    if op == "QLinearConv" and group == 1 and ins[3] in inits and ins[4] in inits and _int8_zero(inits, ins[5], base) \
            and inits[ins[3]].data_type == TensorProto.INT8 and list(inits[ins[3]].dims[2:]) == [1, 1] \
            and (not ins[8] or ins[8] in inits):
        return "conv_int8", [ins[3], ins[4], ins[8]]
    return None


WEIGHT_OPS = ("MatMul", "Conv", "MatMulIntegerToFloat", "QLinearConv", "Gemm", "QGemm", "MatMulNBits")


def _layer_nodes(model: onnx.ModelProto, modules: set[str], mergeable_only: bool,
                 base: str = "") -> dict[str, onnx.NodeProto]:
    """module -> its one weight-carrying node (a module with several, e.g. called twice, is left out); with
    `mergeable_only`, only layers of a kind this module merges."""
    found: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        if n.op_type in WEIGHT_OPS and (m := module_path(n.name)) in modules:
            found.setdefault(m, []).append(n)
    inits = {t.name: t for t in model.graph.initializer} if mergeable_only else {}
    return {m: ns[0] for m, ns in found.items() if len(ns) == 1 and (not mergeable_only or _plan(ns[0], inits, base))}


def expose(model: onnx.ModelProto, modules: set[str], base: str = "") -> dict[str, FusedLayer]:
    """Make the weights of `modules`' mergeable layers overridable inputs of `model` (in place, branches of
    those modules already stripped); a tensor another node also reads gets a private copy first."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    layers = {}
    for module, node in _layer_nodes(model, modules, True, base).items():
        kind, names = _plan(node, inits, base)
        exposed = []
        for role, name in zip(("weight", "scale", "bias"), names):
            if name and readers[name] > 1:  # shared (a zero point or scale the quantizer deduplicated): copy
                copy = numpy_helper.from_array(_array(inits[name], base), f"{module}.fused_{role}")
                g.initializer.append(copy)
                inits[copy.name] = copy
                node.input[list(node.input).index(name)] = copy.name
                name = copy.name
            exposed.append(name)
        for name in filter(None, exposed):
            t = inits[name]
            g.input.append(helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
        layers[module] = FusedLayer(module, kind, *exposed)
    return layers


def _delta(kind: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The low-rank product in the layer's weight layout: [in, out] for a MatMul, [out, in, 1, 1] for a conv."""
    if kind.startswith("matmul"):
        return a @ b
    return (b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1))[:, :, None, None]


def _requantize(q: np.ndarray, scale: np.ndarray, delta: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 weight q (scale per channel along `axis`, or one) + float delta -> (q', scale') on q's grid."""
    shape = [1] * q.ndim
    shape[axis] = -1
    s = scale.astype(np.float64).reshape(shape) if scale.ndim else np.float64(scale)
    merged = q.astype(np.float64) * s + delta.astype(np.float64)
    other = tuple(i for i in range(q.ndim) if i != axis) if scale.ndim else None
    need = np.abs(merged).max(axis=other) / QMAX
    new = np.maximum(scale.astype(np.float64), need).astype(np.float32)
    safe = np.where(new > 0, new, 1).astype(np.float64)  # an all-zero channel with no delta stays zero
    s_new = safe.reshape(shape) if scale.ndim else np.float64(safe)
    # a channel whose scale is unchanged: q + delta / s exactly, rounded once
    q_new = np.clip(np.rint(merged / s_new), -QMAX, QMAX).astype(np.int8)
    return q_new, new.reshape(scale.shape)


def merged_feeds(layers: dict[str, FusedLayer], bases: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> dict:
    """An adapter's A/B feeds of one component -> the merged layers' weights (and, for layers kept as branches,
    their A/B feeds as they are)."""
    out = {}
    for name, arr in feeds.items():
        module = name[:-len(A_SUFFIX)] if name.endswith(A_SUFFIX) else name[:-len(B_SUFFIX)]
        if module not in layers:
            out[name] = arr
    for module, layer in layers.items():
        a, b = feeds.get(module + A_SUFFIX), feeds.get(module + B_SUFFIX)
        if a is None or b is None:
            continue
        delta = _delta(layer.kind, a, b)
        w = bases[layer.weight]
        if layer.kind in ("matmul", "conv"):
            out[layer.weight] = np.ascontiguousarray(w + delta, np.float32)
            continue
        scale = bases[layer.scale]
        q, s = _requantize(w, scale, delta, axis=1 if layer.kind == "matmul_int8" else 0)
        out[layer.weight], out[layer.scale] = q, s
        if layer.bias:
            bias = bases[layer.bias]
            ratio = scale.astype(np.float64) / s.astype(np.float64)
            out[layer.bias] = np.where(ratio == 1.0, bias, np.rint(bias * ratio)).astype(np.int32)
    return out


def _drop_dead_queries(model: onnx.ModelProto) -> None:
    """runtime.dead_queries' rewrite, where the backbone's session makes it (attention, weights in the file)."""
    if any(n.op_type == "MultiHeadAttention" for n in model.graph.node) and not any(
            t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer):
        from ..runtime.dead_queries import without_dead_queries

        without_dead_queries(model)


def _copy(t: onnx.TensorProto) -> onnx.TensorProto:
    """A tensor of its own (a sub-message would keep the whole graph, weights included, alive)."""
    out = onnx.TensorProto()
    out.CopyFrom(t)
    return out


def _external_files(model: onnx.ModelProto) -> set[str]:
    return {e.value for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL
            for e in t.external_data if e.key == "location"}


def session_of(model: onnx.ModelProto, folder: Path, make):
    """make(path, external_files=...) over `model` written to a temporary folder; its external-data files (in
    `folder`, the component's) handed to ORT as read-only memory maps, so the weights are read from where they
    are (ORT copies what it needs while making the session); the folder is gone afterwards."""
    files = {location: np.memmap(folder / location, dtype=np.uint8, mode="r") for location in _external_files(model)}
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-lora-") as tmp:
        path = Path(tmp) / "model.onnx"
        write(model, path)
        return make(path, external_files=files)


class LoraBackbone:
    """The plain and fused sessions of a points folder's backbone, and the merged weights of adapter sets."""

    def __init__(self, path: Path, component: str, make):
        self.path, self.component, self._make = Path(path), component, make
        self._serial = next(_SERIALS)  # keys this backbone's merged weights on an AdapterFeeds (never reused, unlike id())
        self._lock = threading.Lock()
        self._fused = None
        self.layers: dict[str, FusedLayer] = {}
        self.bases: dict[str, np.ndarray] = {}  # merged layers' weights (and scales, biases) an adapter reached
        self._tensors: dict[str, onnx.TensorProto] = {}
        self._inputs: set[str] = set()

    def _graph(self) -> onnx.ModelProto:
        return onnx.load(str(self.path), load_external_data=False)

    def plain(self):
        model = self._graph()
        strip_branches(model)
        return session_of(model, self.path.parent, self._make)

    def fused(self):
        with self._lock:
            if self._fused is None:
                model = self._graph()
                modules = {_branch_module(n) for n in model.graph.node} - {None}
                base = str(self.path.parent)
                candidates = set(_layer_nodes(model, modules, True, base))
                strip_branches(model, candidates)
                _drop_dead_queries(model)  # before exposing: what the backbone's session would drop is not an input
                layers = expose(model, candidates, base)
                self._inputs = {i.name for i in model.graph.input}
                inits = {t.name: t for t in model.graph.initializer}
                # the merged layers' tensors, read into `bases` when an adapter first reaches the layer (a
                # full-size folder's external weights stay on disk until then)
                self._tensors = {n: _copy(inits[n]) for layer in layers.values()
                                 for n in (layer.weight, layer.scale, layer.bias) if n}
                self.layers = layers
                self._fused = session_of(model, self.path.parent, self._make)
            return self._fused

    def feeds(self, adapter) -> dict[str, np.ndarray]:
        """The arrays to bind for `adapter` (an AdapterFeeds) on the fused session; computed once per set."""
        self.fused()
        cache = adapter.merged
        key = (self._serial, self.component)
        if key not in cache:
            feeds = adapter.for_component(self.component)
            with self._lock:
                for module, layer in self.layers.items():
                    if module + A_SUFFIX in feeds:
                        for n in filter(None, (layer.weight, layer.scale, layer.bias)):
                            if n not in self.bases:
                                self.bases[n] = _array(self._tensors[n], str(self.path.parent))
            merged = merged_feeds(self.layers, self.bases, feeds)
            # a layer the graph no longer computes (dropped as dead, e.g. an MMDiT's last text queries): no effect
            cache[key] = {name: arr for name, arr in merged.items() if name in self._inputs}
        return cache[key]
