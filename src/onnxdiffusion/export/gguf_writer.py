"""Float tensors -> a GGUF file, the way ComfyUI-GGUF writes a diffusion backbone: the 2-D `.weight`s whose rows
split into 32-blocks quantized to the file's type, everything else F32. The one writer the tests' tiny GGUF files
(tests/helpers/gguf_files.py) and the memory experiment's full-width ones (experiments/families/gguf_memory.py)
share; export reads GGUF (gguf_file.py) and never imports this, nor does the run time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np


def quantized(name: str, a: np.ndarray, qtype) -> bool:
    """Whether tensor `name` is stored as `qtype` (a gguf.GGMLQuantizationType): a 2-D `.weight` whose rows split
    into 32-blocks; parameters such as Z-Image's pad tokens stay F32 (diffusers reads them as plain tensors)."""
    import gguf

    return (qtype != gguf.GGMLQuantizationType.F32 and name.endswith(".weight") and a.ndim == 2
            and a.shape[1] % 32 == 0)


def write_gguf(path: Path | str, tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]], qtype: str,
               arch: str, use_temp_file: bool = False) -> Path:
    """`tensors` (name -> float array, or (name, array) pairs read one at a time) as a GGUF file of architecture
    `arch`; `use_temp_file`: the writer spools tensor data to a temporary file instead of holding it all."""
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), arch, use_temp_file=use_temp_file)
    for name, a in tensors.items() if isinstance(tensors, Mapping) else tensors:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if quantized(name, a, q):
            writer.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def safetensors_tensors(files: Iterable[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every tensor in `files`, in order, one tensor in memory at a time."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), "np") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def backbone_as_gguf(src: Path | str, qtype: str, out: Path | str) -> Path:
    """The backbone of the diffusers folder `src` (its safetensors, tensor by tensor) as a GGUF file of its family's
    GGUF architecture."""
    import json

    from ..errors import UserError
    from ..families import family_for_pipeline

    src = Path(src)
    family = family_for_pipeline(json.loads((src / "model_index.json").read_text())["_class_name"])
    if family.gguf_names is None:
        raise UserError(f"{src}: a {family.name} backbone has no GGUF layout here")
    files = sorted((src / family.backbone).glob("*.safetensors"))
    return write_gguf(out, safetensors_tensors(files), qtype, family.gguf_names.architectures[0], use_temp_file=True)
