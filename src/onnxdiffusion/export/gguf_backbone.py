"""A GGUF backbone as a diffusers module (export MODEL.gguf; export/gguf.py is the verb): built from --base's
config without weights (accelerate's empty init), then each tensor of the file placed under diffusers' name (the
family's GgufNames): a quantized Linear weight becomes an NBitsLinear (export/gguf_linear.py: MatMulNBits in ONNX,
blocks written as they are for Q8_0 / Q4_0, re-quantized to 8-bit blocks otherwise, made from the file's memory
map one layer at a time), every other tensor a float parameter. `layout` "int8-channel" (export --gguf-layout): every
quantized Linear re-quantized to int8 with a scale per output channel instead (ChannelInt8Linear, DynamicQuantizeMatMul).
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path

from ..errors import UserError
from .gguf_blocks import BLOCK, EXACT, FLOAT_TYPES, type_name
from .gguf_file import GgufFile, GgufTensor

LAYOUTS = ("blocks", "int8-channel")  # export --gguf-layout: the GGUF's blocks (MatMulNBits) or int8 per channel


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise UserError(f"--gguf-layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def _names(family):
    if family.gguf_names is None:
        raise UserError(f"GGUF backbones of {family.name} pipelines are not read yet")
    return family.gguf_names


def check_file(gg: GgufFile, family) -> dict[str, tuple[GgufTensor, tuple[int, ...], int]]:
    """The file's tensors under diffusers' names: {name: (tensor, its row chunks in order, chunk count)}; the
    architecture label and the split tensors' row counts checked."""
    names = _names(family)
    if gg.architecture is not None and names.architectures and gg.architecture not in names.architectures:
        raise UserError(f"{gg.path}: a GGUF of a {gg.architecture!r} model; --base is a {family.name} pipeline "
                        f"(its GGUF files say {', '.join(names.architectures)})")
    mapped: dict[str, tuple[GgufTensor, tuple[int, ...], int]] = {}
    for t in gg.tensors.values():
        for name, chunks, n in names.map(t.name):
            if n > 1 and (not t.shape or t.shape[0] % n):
                rows = t.shape[0] if t.shape else 0
                raise UserError(f"{gg.path}: tensor {t.name!r} has {rows} rows, not {n} equal parts to split")
            if name in mapped:
                raise UserError(f"{gg.path}: two tensors map to {name!r}")
            mapped[name] = (t, chunks, n)
    if not mapped:
        raise UserError(f"{gg.path}: the file holds no tensors")
    return mapped


def _chunk(gg: GgufFile, t: GgufTensor, chunks: tuple[int, ...], n: int):
    """The raw bytes and shape of a tensor's row chunks `chunks` (of n equal ones), in that order: whole rows, so
    whole blocks (a copy only when they are reordered)."""
    import numpy as np

    raw = gg.raw(t)
    if n == 1:
        return raw, t.shape
    rows = t.shape[0] // n
    size = rows * (t.nbytes // t.shape[0])
    parts = [raw[i * size:(i + 1) * size] for i in chunks]
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)), (rows * len(chunks), *t.shape[1:])


def _float(gg: GgufFile, entry) -> "torch.Tensor":
    import torch

    from .gguf_blocks import dequantize, finite

    t = entry[0]
    raw, shape = _chunk(gg, *entry)
    return torch.from_numpy(finite(dequantize(raw, t.ggml_type, shape), f"tensor {t.name!r}"))


def _blocks(gg: GgufFile, entry, report: dict, channel: bool = False):
    """One layer's MatMulNBits blocks (or, `channel`, its int8 per-channel weight), made from the file's memory map
    when needed (never all held at once); the re-quantization's worst signal-to-noise kept in the report."""
    from .gguf_blocks import to_channel8, to_nbits

    t = entry[0]
    raw, shape = _chunk(gg, *entry)
    nb = (to_channel8 if channel else to_nbits)(raw, t.ggml_type, shape)
    if nb.snr_db is not None:
        low = report["requantized_min_snr_db"]
        report["requantized_min_snr_db"] = round(nb.snr_db if low is None else min(low, nb.snr_db), 2)
    return nb


def build_backbone(gg: GgufFile, family, class_name: str, config_dir: Path, layout: str = "blocks"):
    """The diffusers backbone with the file's weights: (module, report for the manifest)."""
    import torch

    from .gguf_linear import ChannelInt8Linear, NBitsLinear

    check_layout(layout)
    channel = layout == "int8-channel"
    from .streamed_float import empty_backbone, parent_of

    mapped = check_file(gg, family)
    module = empty_backbone(config_dir, class_name)
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(mapped))
    unexpected = sorted(set(mapped) - set(params))
    if missing or unexpected:
        what = (f"lacks {len(missing)} tensor(s) the {class_name} of --base has (first: {missing[0]!r})" if missing
                else f"holds {len(unexpected)} tensor(s) the {class_name} of --base has not (first: {unexpected[0]!r})")
        raise UserError(f"{gg.path}: not this backbone's weights: the file {what}")
    for name, p in params.items():
        t, chunks, n = mapped[name]
        shape = (t.shape[0] // n * len(chunks), *t.shape[1:]) if n > 1 else tuple(t.shape)
        # GGML drops size-1 dimensions (sd.cpp writes Z-Image's [1, 3840] pad tokens as [3840]): the same tensor
        if tuple(p.shape) != shape and [d for d in p.shape if d != 1] != [d for d in shape if d != 1]:
            raise UserError(f"{gg.path}: tensor {t.name!r} has shape {list(shape)}; --base's {class_name} wants "
                            f"{list(p.shape)} for {name!r} (another size of the model?)")
    types = Counter(type_name(t.ggml_type) for t in gg.tensors.values())
    report = {"file": gg.path.name, "architecture": gg.architecture, "types": dict(sorted(types.items())),
              "exact": 0, "requantized": 0, "float": 0, "requantized_min_snr_db": None}
    if channel:  # the default layout leaves the report (and the manifest) as it was
        report["layout"] = layout
    done: set[str] = set()
    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    for index, (name, lin) in enumerate(linears):
        t = mapped[f"{name}.weight"][0]
        if t.ggml_type in FLOAT_TYPES:
            continue
        if len(t.shape) != 2 or t.shape[1] % BLOCK:
            raise UserError(f"{gg.path}: {t.name!r} is a {type_name(t.ggml_type)} tensor of shape {list(t.shape)}, "
                            f"not a [N, K] matrix with K a multiple of {BLOCK}")
        bias = _float(gg, mapped[f"{name}.bias"]) if lin.bias is not None else None
        owner, leaf = parent_of(module, name)
        load = partial(_blocks, gg, mapped[f"{name}.weight"], report, channel)
        layer = ChannelInt8Linear(load, index, lin.out_features, lin.in_features, bias) if channel else \
            NBitsLinear(load, EXACT.get(t.ggml_type, 8), index, lin.out_features, lin.in_features, bias)
        setattr(owner, leaf, layer)
        done.update({f"{name}.weight", f"{name}.bias"})
        report["exact" if t.ggml_type in EXACT and not channel else "requantized"] += 1
    for name in params:
        if name in done:
            continue
        owner, leaf = parent_of(module, name)
        value = _float(gg, mapped[name]).reshape(params[name].shape)
        setattr(owner, leaf, torch.nn.Parameter(value, requires_grad=False))
        report["float"] += 1
    return module.eval(), report


def precision_label(report: dict) -> str:
    """The manifest's precision of a GGUF backbone: gguf- and its quantized types, most frequent first."""
    quantized = sorted((k for k in report["types"] if k not in ("F32", "F16", "BF16")),
                       key=lambda k: -report["types"][k])
    if not quantized:
        return "fp32"
    label = "gguf-" + "+".join(k.lower() for k in quantized)
    return f"{label}:{report['layout']}" if report.get("layout", "blocks") != "blocks" else label
