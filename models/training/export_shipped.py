"""Export an embedded model's diffusers folder into the shipped ONNX folder, the one way it is made.

    python models/training/export_shipped.py models/shapes-sd models/shapes-sd-onnx [NAME=CONTROLNET_DIR ...]

`onnxdiffusion export`, then the distilled tiny decoder (SRC/vae_tiny, when present) beside the VAE, then the
shipped ControlNets given as NAME=DIR (`add-controlnet`; shapes-sd ships position=models/controlnets/shapes-sd-position), then
`relayout --storage fp16`: the diffusers folders hold float16 weights, so every initializer is stored as
float16 + Cast, read back as the exact float32 values at load (onnxio/fp16_storage.py). The result replaces
OUT only once it is complete.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from onnxdiffusion.export.controlnet import add_controlnet
    from onnxdiffusion.export.pipeline import export_pipeline
    from onnxdiffusion.export.tiny_vae import add_tiny_vae
    from onnxdiffusion.families.tiny_vae import DECODER
    from onnxdiffusion.folder.relayout import store_external

    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[3:]):
        sys.exit("usage: export_shipped.py DIFFUSERS_FOLDER ONNX_FOLDER [NAME=CONTROLNET_DIR ...]")
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    nets = [a.split("=", 1) for a in sys.argv[3:]]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        exported, stored = Path(tmp) / "exported", Path(tmp) / "stored"
        export_pipeline(src, exported)
        if (src / "vae_tiny").is_dir():
            added = Path(tmp) / "added"
            add_tiny_vae(exported, src / "vae_tiny", added, names=(DECODER,))
            exported = added
        for name, net in nets:
            add_controlnet(exported, net, name)
        store_external(exported, stored, storage="fp16")
        old = Path(tmp) / "old"
        if out.exists():
            out.rename(old)
        stored.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
