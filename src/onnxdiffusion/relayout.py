"""Model folders whose large components keep their weights in external-data files.

ONNX Runtime holds an inline initializer twice for the life of a session: the graph's TensorProto
(with its raw bytes) and its own tensor. Weights in an external-data file are read (memory-mapped on
Linux) once. Measured at SD1.5 size (bench/report_sd15/README.md): the int8-static UNet is 1.50 GB
resident after loading inline vs 0.97 GB from external data, the fp32 text encoder 0.71-0.78 vs
0.40 GB, the fp32 VAE decoder 0.46-0.61 vs 0.27 GB, at the same speed. `quantize` writes its
components this way from RUNTIME_EXTERNAL_BYTES up; `store_external` rewrites an existing folder.
"""

from __future__ import annotations

from pathlib import Path

from .artifacts import confined, derive, read_manifest, verify_folder

RUNTIME_EXTERNAL_BYTES = 64 << 20  # components with this many bytes of tensors or more: weights in a file


def store_external(folder: Path | str, out: Path | str, min_bytes: int = RUNTIME_EXTERNAL_BYTES,
                   overwrite: bool = False) -> list[str]:
    """Copy `folder` to `out` (hard links where possible), every ONNX component of `min_bytes` or more of
    inline tensors re-saved with its weights in one `model.onnx_data` beside it; manifest updated
    (external_data, bytes, hashes). Returns the components rewritten. Graphs and outputs are unchanged."""

    import onnx

    from .onnxio.files import tensor_bytes

    folder, out = Path(folder), Path(out)
    manifest = read_manifest(folder)
    verify_folder(folder, manifest)
    todo = {}
    for name, info in manifest["components"].items():
        if info.get("external_data") or not str(info.get("path", "")).endswith(".onnx"):
            continue
        model = onnx.load(str(confined(folder, info["path"], name)), load_external_data=False)
        if tensor_bytes(model) >= min_bytes:
            todo[name] = model
        del model
    rewritten = sorted(todo)
    with derive(folder, out, manifest, replace=rewritten, overwrite=overwrite) as d:
        for name in rewritten:
            d.save_component(name, todo.pop(name), external_from=0)
    return rewritten
