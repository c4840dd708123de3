"""Model folders whose large components keep their weights in external-data files.

ONNX Runtime holds an inline initializer twice for the life of a session: the graph's TensorProto
(with its raw bytes) and its own tensor. Weights in an external-data file are read (memory-mapped on
Linux) once. Measured at SD1.5 size (bench/report_sd15/README.md): the int8-static UNet is 1.50 GB
resident after loading inline vs 0.97 GB from external data, the fp32 text encoder 0.71-0.78 vs
0.40 GB, the fp32 VAE decoder 0.46-0.61 vs 0.27 GB, at the same speed. `quantize` writes its
components this way from RUNTIME_EXTERNAL_BYTES up; `store_external` rewrites an existing folder, and with
`storage="fp16"` also stores the float32 weights that float16 holds exactly as float16 + Cast (onnxio.fp16_storage:
the same numbers in half the bytes for folders exported from float16 checkpoints); `storage="fp32"` undoes that,
for tools that read the weights of the ONNX files themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .artifacts import confined, derive, read_manifest, verify_folder
from ..errors import UserError
from ..fields import option

STORAGE = ("keep", "fp16", "fp32")
RUNTIME_EXTERNAL_BYTES = 64 << 20  # components with this many bytes of tensors or more: weights in a file


@dataclass(frozen=True)
class RelayoutOptions:
    """The relayout verb's options: `store_external(model, out, min_bytes=o.min_bytes, overwrite=..., storage=...)`."""
    min_mb: float = option(64.0, "components with at least this many MB of weights get an external-data file")
    storage: str = option("keep", "keep | fp16: float32 weights that are exactly float16 values stored as float16 + "
                                  "Cast (same numbers, half the bytes: folders exported from float16 checkpoints) | "
                                  "fp32: such weights back to float32")
    overwrite: bool = option(False, "replace an existing output folder written by this tool")

    @property
    def min_bytes(self) -> int:
        return int(self.min_mb * (1 << 20))


def store_external(folder: Path | str, out: Path | str, min_bytes: int = RUNTIME_EXTERNAL_BYTES,
                   overwrite: bool = False, storage: str = "keep") -> list[str]:
    """Copy `folder` to `out` (hard links where possible), every ONNX component of `min_bytes` or more of
    inline tensors re-saved with its weights in one `model.onnx_data` beside it; manifest updated
    (external_data, bytes, hashes). `storage`: keep, fp16 (inline float32 weights that are exactly
    float16 values stored as float16 + Cast) or fp32 (such weights back to float32). Returns the components
    rewritten. Outputs are unchanged."""

    import onnx

    from ..onnxio import fp16_storage
    from ..onnxio.files import tensor_bytes

    if storage not in STORAGE:
        raise UserError(f"storage must be one of {', '.join(STORAGE)}, not {storage!r}")
    folder, out = Path(folder), Path(out)
    manifest = read_manifest(folder)
    verify_folder(folder, manifest)
    todo = {}
    for name, entry in manifest.components.items():
        if entry.external_data or not entry.path.endswith(".onnx"):
            continue
        model = onnx.load(str(confined(folder, entry.path, name)), load_external_data=False)
        if storage == "fp16":
            changed = fp16_storage.store(model) > 0
        elif storage == "fp32":
            changed = fp16_storage.is_stored(model)
            fp16_storage.expand(model)
        else:
            changed = False
        if changed or tensor_bytes(model) >= min_bytes:
            todo[name] = model
        del model
    rewritten = sorted(todo)
    with derive(folder, out, manifest, replace=rewritten, overwrite=overwrite) as d:
        for name in rewritten:
            model = todo.pop(name)
            d.save_component(name, model, external_from=0 if tensor_bytes(model) >= min_bytes else None)
    return rewritten
