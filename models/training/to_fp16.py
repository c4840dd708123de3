"""Store a diffusers folder's weights in float16 (in place); diffusers and transformers load them as float32.

The tracked tree must stay under 60 MiB with both models and their ONNX copies: the ONNX folders keep
float32 (exported before this step), the diffusers folders keep float16. Each file is written to a
temporary name and renamed. Usage: python models/training/to_fp16.py models/shapes-sd
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def to_fp16(folder: Path) -> int:
    import torch

    saved = 0
    for path in sorted(folder.rglob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if all(t.dtype != torch.float32 for t in tensors.values()):
            continue
        before = path.stat().st_size
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: t.half() if t.dtype == torch.float32 else t for k, t in tensors.items()}, tmp, metadata=meta)
        tmp.replace(path)
        saved += before - path.stat().st_size
    return saved


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: {to_fp16(Path(arg)) / 1e6:.1f} MB saved")
