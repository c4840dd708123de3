"""Export one component and check it against PyTorch: validation is part of export."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ..errors import UserError
from ..families.base import ComponentSpec
from ..onnxio import release_memory
from .external_data import consolidate, external_files
from .gguf_linear import streamed_layers, write_streamed
from .streamed_float import streamed_floats
from .streamed_float import write_streamed as write_floats


def _compare(ref: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    max_abs, max_rel = 0.0, 0.0
    for r, g in zip(ref, got):
        diff = float(np.max(np.abs(r.astype(np.float64) - g.astype(np.float64))))
        scale = float(np.max(np.abs(r))) or 1.0
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / scale)
    return max_abs, max_rel


def free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise)."""
    release_memory()


def _validation_session(path: Path) -> ort.InferenceSession:
    """ONNX Runtime session for validation only, lean on memory: no weight pre-packing (a second, re-laid-out
    copy of every MatMul weight that only speeds up repeated runs), no CPU arena holding the largest
    activation set after the run. External data is memory-mapped by ONNX Runtime (page-aligned, see
    external_data.consolidate). The numerics are the default optimization level's, as at run time."""
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.enable_cpu_mem_arena = False
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


def _outputs(module: torch.nn.Module, feeds: dict, names_in: list[str]) -> list[np.ndarray]:
    with torch.no_grad():
        ref = module(*(feeds[n] for n in names_in))
    return [r.numpy() for r in (ref if isinstance(ref, tuple) else (ref,))]


def export_component(spec: ComponentSpec, module: torch.nn.Module, feed_list: list[dict], folder: Path, options,
                     release: Callable[[], None] | None = None) -> dict:
    """Export `module` to folder/model.onnx (one external-data file when > 2 GB) and validate it against PyTorch.

    PyTorch's outputs on every validation feed are computed before the export, so the torch module is not
    needed once the ONNX file is written: when `release` is given, the module is let go here and `release()`
    is called (the caller drops its own references) before ONNX Runtime loads the model, so the two copies
    of the weights are never resident together.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    names_in = [t.name for t in spec.inputs]
    names_out = [t.name for t in spec.outputs]
    refs = [_outputs(module, feeds, names_in) for feeds in feed_list] if options.validate else []
    streamed = streamed_layers(module)  # GGUF layers: their blocks are written after the export, layer by layer
    floats = streamed_floats(module)  # float layers left in the safetensors shards, written the same way
    first = feed_list[0]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            tuple(first[n] for n in names_in),
            str(path),
            input_names=names_in,
            output_names=names_out,
            dynamic_axes=spec.dynamic_axes(),
            opset_version=options.opset,
            do_constant_folding=True,
            dynamo=False,
        )
    if release is not None:
        del module
        release()
    free_memory()  # the exporter's graph and folded weight copies
    if streamed:  # GGUF blocks and streamed float weights: each writer consolidates the exporter's own external
        # files first and appends its weights page-aligned; consolidating again would copy every weight once more
        # (a 20B Q4_0 backbone: 11.5 GB more written, twice its bytes on disk at once)
        write_streamed(path, streamed)
        streamed = None
    elif floats:
        write_floats(path, floats)
        floats = None
    else:
        consolidate(path)
    info = {
        "path": f"{spec.name}/model.onnx",
        "external_data": [f"{spec.name}/{f}" for f in external_files(path)],
        "precision": "fp32",
        **spec.to_manifest(),
        "bytes": sum(p.stat().st_size for p in folder.iterdir() if p.is_file()),
    }
    onnx.checker.check_model(str(path))
    if not options.validate:
        return info
    sess = _validation_session(path)
    worst_abs, worst_rel = 0.0, 0.0
    for feeds, ref in zip(feed_list, refs):
        got = sess.run(names_out, {n: feeds[n].numpy() for n in names_in})
        for r, g in zip(ref, got):
            if r.shape != g.shape:
                raise UserError(f"{spec.name}: ONNX output shape {g.shape} != PyTorch {r.shape}")
        a, rel = _compare(ref, got)
        worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, rel)
        bound = spec.atol * max(1.0, max(float(np.max(np.abs(r))) for r in ref))
        if a > bound:
            raise UserError(
                f"{spec.name}: ONNX Runtime differs from PyTorch by {a:.3g} (max abs) > tolerance {bound:.3g}"
            )
    del sess
    free_memory()
    info["validation"] = {"max_abs_error": worst_abs, "max_rel_error": worst_rel, "atol": spec.atol}
    return info
