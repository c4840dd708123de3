"""`fixup-trt`: a TensorRT-bound quantized backbone (NVIDIA Model Optimizer's export, or our
nvfp4/fp8 TensorRT form) made loadable, then installed as a model folder's backbone.

The steps people do by hand today, in order:
1. raise the default domain to opset 23 (the first whose Q/DQ accept FLOAT4E2M1) with ONNX's
   version converter; where the converter refuses (it rejects FP4 tensors and trt-domain ops it
   cannot type), bump the import and adapt the ops whose definitions changed on the way ourselves,
   and say which;
2. write the output types of the `trt` ops into value_info (ONNX cannot infer custom ops):
   TRT_FP4DynamicQuantize -> (FLOAT4E2M1, its scale_type), trt DequantizeLinear -> its scale's type;
3. save with every weight in one external-data file;
4. validate with the ONNX checker (full: shape and type inference);
5. install atomically: the folder's previous backbone is kept as the declared CPU fallback, the
   manifest records the new one (hashes, precision, provider, provenance).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..folder.artifacts import read_manifest, sha256_file, verify_folder
from ..errors import UserError
from ..folder.manifest import Component
from ..onnxio.files import write_external

TARGET_OPSET = 23
TRT_DOMAIN = "trt"
DATA_NAME = "model.onnx_data"
FALLBACK_SUFFIX = "_fallback"  # the previous backbone's folder: the family's backbone name + this


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _set_default_opset(model: onnx.ModelProto, version: int) -> None:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = version
            return
    model.opset_import.append(helper.make_opsetid("", version))


# --- 1. the opset upgrade --------------------------------------------------------------------

_REDUCE_OPS = ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
               "ReduceLogSumExp", "ReduceSumSquare")


def _adapt_nodes(model: onnx.ModelProto, source: int) -> list[str]:
    """Adapt the default-domain nodes whose definition changed between `source` and 23.

    Changes that only add types or optional attributes/inputs (Q/DQ 19/21/23, Cast 19/21/23,
    Reshape, Shape, Pad, Resize, Split, ...) need nothing. Returns what was done.
    """
    g = model.graph
    done: list[str] = []
    inits = {t.name: t for t in g.initializer}
    try:
        shapes = _channel_counts(onnx.shape_inference.infer_shapes(model))
    except Exception:  # noqa: BLE001 - inference may stop at custom ops; value_info already there still counts
        shapes = _channel_counts(model)
    for n in g.node:
        if n.domain not in ("", "ai.onnx"):
            continue
        if source < 18 and n.op_type in _REDUCE_OPS:  # opset 18: axes moved from attribute to input
            axes = next((a for a in n.attribute if a.name == "axes"), None)
            if axes is not None:
                name = f"{n.name or n.output[0]}_axes"
                g.initializer.append(numpy_helper.from_array(np.asarray(list(axes.ints), np.int64), name))
                n.attribute.remove(axes)
                n.input.append(name)
                done.append(f"{n.op_type} {n.name}: axes attribute -> input (opset 18)")
        if source < 20 and n.op_type == "GridSample":  # opset 20: modes renamed
            for a in n.attribute:
                if a.name == "mode" and a.s in (b"bilinear", b"bicubic"):
                    a.s = {b"bilinear": b"linear", b"bicubic": b"cubic"}[a.s]
                    done.append(f"GridSample {n.name}: mode renamed (opset 20)")
        if source < 21 and n.op_type == "GroupNormalization":  # opset 21: scale/bias per channel, not per group
            groups = next(a.i for a in n.attribute if a.name == "num_groups")
            channels = shapes.get(n.input[0])
            widened = False
            for i in (1, 2):
                t = inits.get(n.input[i])
                if t is None or channels is None:
                    raise UserError(f"GroupNormalization {n.name}: cannot widen per-group scale/bias to per-channel "
                                    f"(needs constant scale/bias and a known channel count)")
                v = numpy_helper.to_array(t)
                if v.shape[0] == groups and channels != groups:
                    t.CopyFrom(numpy_helper.from_array(np.repeat(v, channels // groups), t.name))
                    widened = True
            if widened:
                done.append(f"GroupNormalization {n.name}: per-group scale/bias widened to per-channel (opset 21)")
    return done


def _channel_counts(model: onnx.ModelProto) -> dict[str, int]:
    out = {}
    for v in [*model.graph.input, *model.graph.value_info]:
        dims = v.type.tensor_type.shape.dim
        if len(dims) >= 2 and dims[1].HasField("dim_value"):
            out[v.name] = dims[1].dim_value
    return out


def upgrade(model: onnx.ModelProto, target: int = TARGET_OPSET) -> tuple[onnx.ModelProto, dict]:
    """The default domain raised to `target`; returns the model and what was done (and by whom)."""
    source = _default_opset(model)
    info: dict = {"from": source, "to": target, "converter": None, "adapted": []}
    if source >= target:
        info["converter"] = "not needed"
        return model, info
    try:
        from onnx import version_converter

        converted = version_converter.convert_version(model, target)
        info["converter"] = "onnx.version_converter"
        # measured (onnx 1.23): the converter bumps GroupNormalization 18 -> 21 without widening
        # its per-group scale/bias to per-channel, so the same adapters run after it
        info["adapted"] = _adapt_nodes(converted, source)
        if info["adapted"]:
            info["converter_missed"] = list(info["adapted"])
        return converted, info
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the converter raises bare RuntimeErrors
        info["converter_failed"] = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    info["adapted"] = _adapt_nodes(model, source)
    _set_default_opset(model, target)
    info["converter"] = "manual (the converter refused; see converter_failed)"
    return model, info


# --- 2. output types of the trt ops ----------------------------------------------------------

def annotate_trt_types(model: onnx.ModelProto) -> int:
    """value_info element types for every trt-domain op output; returns how many were written."""
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]}
    types.update({t.name: t.data_type for t in g.initializer})
    written: dict[str, int] = {}
    for n in g.node:  # graph order: a DQ's scale is typed before the DQ reads it
        if n.domain != TRT_DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "TRT_FP4DynamicQuantize":
            out = (TensorProto.FLOAT4E2M1, int(attrs.get("scale_type", TensorProto.FLOAT8E4M3FN)))
        elif n.op_type in ("DequantizeLinear", "TRT_FP8DequantizeLinear", "TRT_INT4DequantizeLinear"):
            out = (types.get(n.input[1]) or TensorProto.FLOAT,)  # a DQ gives its scale's type
        elif n.op_type == "TRT_FP8QuantizeLinear":
            out = (TensorProto.FLOAT8E4M3FN,)
        else:
            raise UserError(f"cannot type the output of trt::{n.op_type} ({n.name}): not a TensorRT op fixup-trt knows")
        for name, elem in zip(n.output, out):
            written[name] = elem
            types[name] = elem
    keep = [v for v in g.value_info if v.name not in written]
    del g.value_info[:]
    g.value_info.extend(keep)
    for name, elem in written.items():
        g.value_info.append(helper.make_tensor_value_info(name, elem, None))
    if not any(o.domain == TRT_DOMAIN for o in model.opset_import) and written:
        model.opset_import.append(helper.make_opsetid(TRT_DOMAIN, 1))
    return len(written)


def precision_of(model: onnx.ModelProto) -> str:
    types = {t.data_type for t in model.graph.initializer}
    if TensorProto.FLOAT4E2M1 in types or any(n.op_type == "TRT_FP4DynamicQuantize" for n in model.graph.node):
        return "nvfp4"
    if TensorProto.FLOAT8E4M3FN in types:
        return "fp8"
    if TensorProto.FLOAT16 in types:
        return "fp16"
    return "fp32"


# --- 3-5. save, validate, install ------------------------------------------------------------

def fix(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """Steps 1-2 on a loaded model (no files)."""
    model, opset = upgrade(model)
    typed = annotate_trt_types(model)
    return model, {"opset": opset, "trt_outputs_typed": typed}


def _save_and_check(model: onnx.ModelProto, path: Path) -> None:
    write_external(model, path, DATA_NAME)
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:  # noqa: BLE001 - ValidationError and inference errors alike
        raise UserError(f"the fixed-up backbone does not pass the ONNX checker: {str(e).strip().splitlines()[0][:300]}") from None


def _load_input(path: Path) -> onnx.ModelProto:
    from ..runtime.session import check_external_data

    check_external_data(path)  # external data must stay beside the file it belongs to
    try:
        return onnx.load(str(path))
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot load {path}: {str(e).strip().splitlines()[0][:200]}") from None


def fixup_trt(src: Path | str, folder: Path | str, log=None) -> Component:
    """Fix `src` up and install it as `folder`'s backbone (in place, atomically); returns the manifest entry."""
    from ..folder.artifacts import derive
    from ..families import get_family

    log = log or (lambda m: None)
    src, folder = Path(src), Path(folder)
    if not src.is_file():
        raise UserError(f"input model not found: {src}")
    manifest = read_manifest(folder)
    verify_folder(folder, manifest)
    backbone = get_family(manifest.family).backbone
    old = manifest.components[backbone]
    if old.requires_provider:
        raise UserError(f"{folder}'s backbone is already a {old.precision} TensorRT backbone; install into the fp16/fp32 folder")
    log(f"loading {src}")
    model, what = fix(_load_input(src))
    log(f"opset {what['opset']['from']} -> {what['opset']['to']} ({what['opset']['converter']}); "
        f"{what['trt_outputs_typed']} trt outputs typed")
    rel = Path(old.path)
    fallback_dir = f"{backbone}{FALLBACK_SUFFIX}"
    # the backbone's other files (a config.json) stay; its graph and weights move to the fallback folder
    with derive(folder, folder, manifest, replace=(backbone,), drop_kinds=("sampling_graph",), in_place=True) as d:
        fallback = d.link_component(f"{backbone}{FALLBACK_SUFFIX}", old, fallback_dir)
        del d.components[fallback_dir]  # the fallback is part of the backbone's entry, not a component
        log("saving with one external-data file and checking")
        _save_and_check(model, d.path(rel))
        entry = {**{k: v for k, v in old.to_dict().items() if k not in ("validation", "session_options", "correction", "stored_as",
                                                             "precision_schedule")},
                 "path": rel.as_posix(), "external_data": [(rel.parent / DATA_NAME).as_posix()],
                 "precision": precision_of(model), "requires_provider": "tensorrt",
                 "bytes": d.path(rel).stat().st_size + d.path(rel.parent / DATA_NAME).stat().st_size,
                 "fallback": {"path": fallback["path"], "external_data": fallback["external_data"],
                              "precision": old.precision or "fp32", "provider": "cpu"},
                 "installed_by": {"verb": "fixup-trt", "source_name": src.name, "source_sha256": sha256_file(src),
                                  **what, "onnx": onnx.__version__}}
        d.components[backbone] = entry
    return Component.from_dict(backbone, entry)
