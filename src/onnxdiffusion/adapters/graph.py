"""LoRA in the Loop / unrolled sampling graphs: the backbone's insertion points become inputs of the whole graph.

The sampling graph inlines the backbone under a prefix ("unet/..."), its rank-0 A/B defaults among the
outer-scope initializers the Loop body reads. Listing those initializers as graph inputs makes them
overridable, so one compiled graph runs with or without adapters (same defaults: the plain image).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .points import A_SUFFIX, B_SUFFIX


def expose_lora_inputs(model: onnx.ModelProto, backbone_entry: dict) -> dict | None:
    """Add the inlined backbone's insertion points as graph inputs; returns the component's `lora` record."""
    targets = (backbone_entry.get("lora") or {}).get("targets") or {}
    if not targets:
        return None
    g = model.graph
    have = {i.name for i in g.input}
    module = next(iter(targets))
    prefix = None
    added = 0
    for t in g.initializer:
        if not t.name.endswith((A_SUFFIX, B_SUFFIX)) or t.name in have:
            continue
        if prefix is None and t.name.endswith(module + A_SUFFIX):
            prefix = t.name[:-len(module + A_SUFFIX)]
        dims = [d if d else f"lora_rank_{added // 2}" for d in t.dims]
        g.input.append(helper.make_tensor_value_info(t.name, TensorProto.FLOAT, dims))
        added += 1
    if prefix is None:  # the weights live elsewhere (a precision schedule's If branches): no adapter inputs
        return None
    return {"prefix": prefix, "inputs": added}


def graph_feeds(info: dict, feeds: dict) -> dict:
    """The backbone's adapter feeds under the sampling graph's names."""
    prefix = (info.get("lora") or {}).get("prefix")
    return {prefix + k: v for k, v in feeds.items()} if prefix is not None else {}
