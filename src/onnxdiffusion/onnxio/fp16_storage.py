"""Lossless float16 storage of float32 weights whose every value is exactly a float16.

A pipeline exported from a float16 checkpoint (most published ones, and the shipped MMDiT) carries
float32 weights that hold float16 values: half of each weight's bytes are zeros. Stored as float16
with a Cast back to float32 at the head of the graph, the folder halves and computes the same
numbers: ONNX Runtime folds each Cast into a float32 constant when it builds the session, before any
fusion looks at the weight, so sessions and images are identical (tests/onnxio/test_fp16_storage.py).

Graph tools (quantize, LoRA points, compile-loop, the web page, caching's backbone cut) want float32
initializers to rewrite, so every load through `onnxio.files.load` turns the storage back into the
original graph (`expand`), byte for byte: the float16 tensor keeps its place in the initializer list
and takes back the Cast's output name, and the Casts are dropped. Only graphs carrying MARK are
touched, so a graph that casts a float16 initializer on purpose is left as it is.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import UserError

MARK = "onnxdiffusion.fp16_storage"
SUFFIX = "__fp16"
MIN_ELEMENTS = 64  # smaller tensors save too little to be worth a node each


def _exact_fp16(t: TensorProto) -> np.ndarray | None:
    if t.data_type != TensorProto.FLOAT or t.data_location == TensorProto.EXTERNAL:
        return None
    a = numpy_helper.to_array(t)
    if a.size < MIN_ELEMENTS:
        return None
    h = a.astype(np.float16)
    # bit equality: -0.0, inf and NaN payloads must come back as they were
    return h if np.array_equal(h.astype(np.float32).view(np.uint32), a.view(np.uint32)) else None


def is_stored(model: onnx.ModelProto) -> bool:
    return any(p.key == MARK for p in model.metadata_props)


def store(model: onnx.ModelProto) -> int:
    """In place: every main-graph float32 initializer that float16 holds exactly becomes float16 + Cast.
    Returns how many were stored so (0: the model is left unchanged, unmarked)."""
    if is_stored(model):
        return 0
    g = model.graph
    casts = []
    for i, t in enumerate(g.initializer):
        h = _exact_fp16(t)
        if h is None:
            continue
        name = t.name
        g.initializer[i].CopyFrom(numpy_helper.from_array(h, name + SUFFIX))
        casts.append(helper.make_node("Cast", [name + SUFFIX], [name], to=TensorProto.FLOAT,
                                      name=name + SUFFIX + "_cast"))
    if not casts:
        return 0
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(casts + nodes)
    model.metadata_props.add(key=MARK, value=str(len(casts)))
    return len(casts)


def expand(model: onnx.ModelProto, where: str = "model") -> onnx.ModelProto:
    """In place (and returned): a `store`d model back to its float32 initializers and original nodes.
    A float16 tensor whose data does not fit its dims (an untrusted file) is a UserError naming it."""
    if not is_stored(model):
        return model
    g = model.graph
    halves = {t.name: i for i, t in enumerate(g.initializer) if t.data_type == TensorProto.FLOAT16}
    kept = []
    for n in g.node:
        src = n.input[0] if n.op_type == "Cast" and len(n.input) == 1 else None
        if src in halves and src.endswith(SUFFIX) and n.output[0] == src[: -len(SUFFIX)]:
            i = halves[src]
            try:
                a = numpy_helper.to_array(g.initializer[i]).astype(np.float32)
            except (ValueError, TypeError) as e:
                raise UserError(f"{where}: tensor {src!r} does not match its shape ({type(e).__name__})") from None
            g.initializer[i].CopyFrom(numpy_helper.from_array(a, n.output[0]))
        else:
            kept.append(n)
    del g.node[:]
    g.node.extend(kept)
    props = [p for p in model.metadata_props if p.key != MARK]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    return model
