"""Keep big models in one external-data file inside the component folder."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from ..onnxio.aligned import AlignedData
from ..onnxio.files import write


def _external_tensors(model: onnx.ModelProto):
    for init in model.graph.initializer:
        if uses_external_data(init):
            yield init
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.HasField("t") and uses_external_data(attr.t):
                yield attr.t


def consolidate(model_path: Path, data_name: str = "model.onnx_data") -> None:
    """Rewrite `model_path` so that every external tensor lives in one file beside it.

    The TorchScript exporter writes one file per weight when a model passes 2 GB and the
    dynamo exporter may use other names; tensors are copied one at a time so the model is
    never held twice in memory.
    """
    model_path = Path(model_path)
    folder = model_path.parent
    if not any(p.is_file() and p != model_path for p in folder.iterdir()):
        return  # no file beside the model: nothing external (and a < 2 GB model is not parsed a second time)
    model = onnx.load(str(model_path), load_external_data=False)
    tensors = list(_external_tensors(model))
    if not tensors:
        return
    target = folder / data_name
    tmp = folder / (data_name + ".tmp")
    old_files: set[Path] = set()
    with open(tmp, "wb") as out:
        aligned = AlignedData(out, data_name)
        for t in tensors:
            info = ExternalDataInfo(t)
            src = (folder / info.location).resolve()
            if folder.resolve() not in src.parents:
                raise ValueError(f"external data {info.location!r} points outside {folder}")
            old_files.add(src)
            with open(src, "rb") as f:
                if info.offset:
                    f.seek(info.offset)
                aligned.put(t, f.read(info.length) if info.length else f.read())
    model_tmp = folder / (model_path.name + ".tmp")
    write(model, model_tmp)
    for f in old_files:
        if f != target.resolve() and f.exists():
            f.unlink()
    os.replace(tmp, target)
    os.replace(model_tmp, model_path)


def external_files(model_path: Path) -> list[str]:
    model = onnx.load(str(model_path), load_external_data=False)
    return sorted({ExternalDataInfo(t).location for t in _external_tensors(model)})
