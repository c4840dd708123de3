"""ONNX graph helpers for quantization: which nodes to quantize, augmenting, sorting, merging groups.

Pure `onnx` + numpy; nothing here runs a model.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..onnxio.files import op_counts  # noqa: F401 - re-exported: the quantizer's graph tools include it
from ..onnxio.graph_order import remove_dead_nodes, sort_graph, toposort  # noqa: F401 - re-exported
from ..loopgraph.builder import rename_outer_refs

WEIGHT_OPS = ("Conv", "MatMul", "Gemm")
# Ops a quantized backbone carries; a folder whose backbone has any of them was quantized already.
QUANT_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger",
    "DynamicQuantizeLinear", "MatMulNBits", "QGemm", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
})
# The float-kept layers peers write by hand (optimum / NNCF / Model Optimizer style lists).
PEER_FLOAT_PATTERNS = {
    "time embedding": ("*time_embedding*", "*time_emb_proj*"),
    "conv_in / conv_out": ("*conv_in/*", "*conv_out/*"),
    "shortcut convs": ("*conv_shortcut*",),
    "attention softmax": ("*Softmax*",),
}


@dataclass(frozen=True)
class QNode:
    """A node with a constant weight that a recipe may quantize."""

    name: str
    op_type: str
    weight: str
    weight_size: int


def initializer_map(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def constant_outputs(model: onnx.ModelProto) -> set[str]:
    return {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every unnamed node a unique name (quantizers address nodes by name)."""
    seen: set[str] = set()
    for i, n in enumerate(model.graph.node):
        if not n.name or n.name in seen:
            n.name = f"{n.op_type}_{i}"
        seen.add(n.name)
    return model


def prepare_unet(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape information for the quantizer (ONNX's own inference: ORT's symbolic one fails on this UNet)."""
    from ..onnxio.files import infer_shapes

    model = name_nodes(model)
    try:
        return infer_shapes(model)  # a > 2 GB backbone: on its skeleton
    except Exception:  # noqa: BLE001 - quantizers still work without value_info, just less precisely
        return model


def quantizable_nodes(model: onnx.ModelProto, op_types: Iterable[str], keep_float: Iterable[str] = ()) -> list[QNode]:
    """Conv / MatMul / Gemm nodes whose weight (input 1) is an initializer, in graph order.

    A MatMul of two activations (attention scores, attention x values) is never listed: quantizing
    those is what made QDQ backbones 2-3.5x slower than float on ONNX Runtime's CPU provider.
    """
    inits = initializer_map(model)
    op_types = set(op_types)
    patterns = tuple(keep_float)
    out = []
    for n in model.graph.node:
        if n.op_type not in op_types or len(n.input) < 2 or n.input[1] not in inits:
            continue
        if any(fnmatch.fnmatchcase(n.name, p) for p in patterns):
            continue
        w = inits[n.input[1]]
        if w.data_type != TensorProto.FLOAT:
            continue
        out.append(QNode(n.name, n.op_type, w.name, int(np.prod(w.dims))))
    return out


def activation_tensors(model: onnx.ModelProto, node_names: Iterable[str]) -> list[str]:
    """The float activations (inputs and outputs, not weights) of the named nodes, in graph order."""
    wanted = set(node_names)
    inits = set(initializer_map(model)) | constant_outputs(model)
    out: dict[str, None] = {}
    for n in model.graph.node:
        if n.name in wanted:
            for x in (*n.input, *n.output):
                if x and x not in inits:
                    out[x] = None
    return list(out)


def with_outputs(model: onnx.ModelProto, names: Iterable[str], only: bool = False) -> onnx.ModelProto:
    """A copy whose graph also outputs the named intermediate tensors (`only`: outputs those alone, so the session
    can drop what comes after them)."""
    aug = onnx.ModelProto()
    aug.CopyFrom(model)
    if only:
        del aug.graph.output[:]
    have = {o.name for o in aug.graph.output}
    for x in names:
        if x not in have:
            aug.graph.output.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, None))
    return aug


def is_quantized(model: onnx.ModelProto) -> bool:
    counts = op_counts(model)
    if any(counts.get(op) for op in QUANT_OPS):
        return True
    return any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer)


def peer_float_nodes(model: onnx.ModelProto, candidates: Iterable[str]) -> dict[str, list[str]]:
    """Which of `candidates` (quantizable node names) each peer hand-list category would keep float."""
    names = list(candidates)
    out = {}
    for label, pats in PEER_FLOAT_PATTERNS.items():
        out[label] = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]
    return out


def tensor_key(t: onnx.TensorProto) -> tuple:
    data = t.raw_data or t.SerializeToString()
    return (t.data_type, tuple(t.dims), hashlib.sha256(data).hexdigest())


def model_bytes(model: onnx.ModelProto) -> int:
    return model.ByteSize()


# --- clean-ups after quantization ------------------------------------------------------------

def reroute_shape_reads(model: onnx.ModelProto) -> int:
    """Shape(DequantizeLinear(q)) -> Shape(q): same shape, and the DQ often had no other reader.

    The TorchScript exporter computes reshape targets from activations, so a quantized backbone
    dequantizes some tensors only to take their shape; ONNX Runtime runs those DQs every call.
    Returns the number of Shape nodes rerouted (dead DQs are removed, nodes left sorted).
    """
    g = model.graph
    dq_of = {n.output[0]: n for n in g.node if n.op_type == "DequantizeLinear"}
    moved = 0
    for n in g.node:
        if n.op_type == "Shape" and n.input[0] in dq_of:
            n.input[0] = dq_of[n.input[0]].input[0]
            moved += 1
    remove_dead_nodes(model)
    return moved


def compact_names(model: onnx.ModelProto, keep_node_names: bool = True) -> onnx.ModelProto:
    """Short tensor names (graph inputs and outputs keep theirs); Q/DQ nodes get short names too.

    Exported names like "/model/down_blocks.1/attentions.0/.../MatMul_output_0_QuantizeLinear_Output"
    are ~10% of an int8 backbone's file. Names of the original nodes are kept so that float-node
    lists and profiles still read.
    """
    g = model.graph
    fixed = {i.name for i in g.input} | {o.name for o in g.output}
    names: dict[str, str] = {}

    def short(x: str) -> str:
        if not x or x in fixed:
            return x
        if x not in names:
            names[x] = f"{len(names):x}"
        return names[x]

    for t in g.initializer:
        t.name = short(t.name)
    for n in g.node:
        for i, x in enumerate(n.input):
            n.input[i] = short(x)
        for i, x in enumerate(n.output):
            n.output[i] = short(x)
        n.doc_string = ""
        if not keep_node_names or n.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant"):
            n.name = ""
        rename_outer_refs(n, lambda x: names.get(x, x))
    del g.value_info[:]
    return model


def fold_matmul_bias(model: onnx.ModelProto) -> int:
    """Add(MatMulIntegerToFloat(...), bias) -> MatMulIntegerToFloat(..., bias): one kernel, not two.

    ONNX Runtime fuses a QDQ MatMul with a float output into MatMulIntegerToFloat but leaves the
    linear layer's bias as a separate broadcast Add over the whole activation, although the
    kernel takes a bias input. Applies to a CPU-fused graph (see runner.ort_optimized); returns
    the number of Adds folded.
    """
    g = model.graph
    inits = initializer_map(model)
    producer = {o: n for n in g.node for o in n.output}
    readers = Counter(x for n in g.node for x in n.input)
    readers.update(o.name for o in g.output)
    dead = []
    for add in g.node:
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
            continue
        for mm_out, bias in (tuple(add.input), tuple(add.input)[::-1]):
            mm = producer.get(mm_out)
            if mm is None or mm.op_type != "MatMulIntegerToFloat" or readers[mm_out] != 1:
                continue
            b = inits.get(bias)
            if b is None or b.data_type != TensorProto.FLOAT or len(b.dims) != 1 or (len(mm.input) > 6 and mm.input[6]):
                continue
            weight = inits.get(mm.input[1])
            if weight is None or not weight.dims or weight.dims[-1] != b.dims[0]:
                continue
            inputs = list(mm.input) + [""] * (6 - len(mm.input))
            del mm.input[:]
            mm.input.extend(inputs[:6] + [bias])
            mm.output[0] = add.output[0]
            dead.append(add)
            break
    for add in dead:
        g.node.remove(add)
    return len(dead)
