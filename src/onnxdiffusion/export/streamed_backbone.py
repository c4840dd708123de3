"""Export a streamed float backbone (export/streamed_float.py) with validation that stays bounded by memory: the
numerical comparison on a cut-down copy (its first blocks, the released width, the same weights and export code) in
a scratch folder, then the whole backbone exported without ONNX Runtime paging in all its weights."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from .streamed_float import CUT_BLOCKS, STREAM_ABOVE, cut_down
from .validate import export_component, free_memory


def cut_validation(module, setting: str) -> bool:
    """Whether a backbone of GGUF blocks (export/gguf_linear.py: already streamed layer by layer) validates on a
    cut-down copy as a streamed float backbone does: stream_weights "on", or "auto" above STREAM_ABOVE of fp32
    weights. Validating the whole of a 20B backbone would page in every block under ONNX Runtime and run PyTorch
    over every layer; small ones keep their whole-model check."""
    from .gguf_linear import NBitsLinear

    layers = [m for m in module.modules() if isinstance(m, NBitsLinear)]
    if not layers or setting == "off":
        return False
    if setting == "on":
        return True
    weights = sum(m.in_features * m.out_features for m in layers) + sum(p.numel() for p in module.parameters())
    return 4 * weights > STREAM_ABOVE


def export_streamed(spec, module, wrap: Callable, feed_list: list[dict], folder: Path, options,
                    release: Callable[[], None] | None = None) -> dict:
    """export_component for a backbone whose Linear weights stay in the shards; `wrap` makes the module the
    exporter traces (the family's wrapper) and is called on the cut-down copy first, then on the module."""
    check = None
    if options.validate:
        from .llm_streamed import cut_copy, streams

        small, cut = cut_copy(module, spec.options, CUT_BLOCKS) if streams(module) else cut_down(module)
        with tempfile.TemporaryDirectory(prefix=".cutdown-", dir=folder.parent) as scratch:
            sub = export_component(spec, wrap(small), feed_list, Path(scratch) / spec.name, options)
        small = None
        free_memory()
        check = {**sub["validation"], "scope": f"cut-down copy: each block list's first {CUT_BLOCKS} blocks",
                 "blocks_cut": cut}
    entry = export_component(spec, wrap(module), feed_list, folder, replace(options, validate=False), release)
    entry["streamed_weights"] = True
    if check is not None:
        entry["validation"] = check
    return entry
