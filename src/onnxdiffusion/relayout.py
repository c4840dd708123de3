"""Model folders whose large components keep their weights in external-data files.

ONNX Runtime holds an inline initializer twice for the life of a session: the graph's TensorProto
(with its raw bytes) and its own tensor. Weights in an external-data file are read (memory-mapped on
Linux) once. Measured at SD1.5 size (bench/report_sd15/README.md): the int8-static UNet is 1.50 GB
resident after loading inline vs 0.97 GB from external data, the fp32 text encoder 0.71-0.78 vs
0.40 GB, the fp32 VAE decoder 0.46-0.61 vs 0.27 GB, at the same speed. `quantize` writes its
components this way from RUNTIME_EXTERNAL_BYTES up; `store_external` rewrites an existing folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from .artifacts import MANIFEST, atomic_dir, confined, hash_tree, link_files, read_manifest, verify_folder, write_json

RUNTIME_EXTERNAL_BYTES = 64 << 20  # components with this many bytes of tensors or more: weights in a file


def store_external(folder: Path | str, out: Path | str, min_bytes: int = RUNTIME_EXTERNAL_BYTES,
                   overwrite: bool = False) -> list[str]:
    """Copy `folder` to `out` (hard links where possible), every ONNX component of `min_bytes` or more of
    inline tensors re-saved with its weights in one `model.onnx_data` beside it; manifest updated
    (external_data, bytes, hashes). Returns the components rewritten. Graphs and outputs are unchanged."""

    import onnx

    from .quantize.files import save, tensor_bytes

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
    with atomic_dir(out, overwrite=overwrite, inputs=(folder,)) as tmp:
        rewritten = {manifest["components"][n]["path"] for n in todo}
        link_files(folder, tmp, [rel for rel in manifest["files"] if rel not in rewritten])
        new = json.loads(json.dumps(manifest))
        for name in list(todo):
            info = new["components"][name]
            rel = Path(info["path"])
            data = save(todo.pop(name), tmp / rel, keep=False, external_from=0)
            info["external_data"] = [str(rel.parent / f) for f in data]
            info["bytes"] = sum((tmp / rel.parent / f).stat().st_size for f in [rel.name, *data])
        new["files"] = hash_tree(tmp)
        write_json(tmp / MANIFEST, new)
    return sorted(n for n in manifest["components"] if manifest["components"][n]["path"] in rewritten)
