"""Export peak memory of full-width Flux / Qwen-Image transformers (acceptance 5 of issue 11).

Random weights at the real widths (Flux: 3072 wide, 24 heads, T5 4096 / CLIP 768 inputs; Qwen-Image:
3072 wide, 24 heads, 3584-wide text) with few blocks, so the component fits this 24 GB machine.
Each measurement is a fresh child process that builds and saves the model (safetensors), then a
second fresh process loads it and runs the project's export of that one component (TorchScript
export, external data, ONNX Runtime validation at two shapes). Its peak RSS (VmHWM) is compared
with the exported component's bytes.

    python bench/export_memory_flow.py flux 1 1      # family, double blocks, single blocks
    python bench/export_memory_flow.py qwenimage 2
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def build(family: str, folder: Path, layers: int, single: int) -> None:
    import torch
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

    torch.manual_seed(0)
    if family == "flux":
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=layers, num_single_layers=single,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                       pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    else:
        model = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=layers,
                                            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                            axes_dims_rope=(16, 56, 56))
    model.save_pretrained(folder, safe_serialization=True)


def export(family: str, folder: Path, out: Path) -> dict:
    import torch
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

    from onnxdiffusion.bench.memory import current_rss_bytes, peak_rss_bytes
    from onnxdiffusion.export.pipeline import ExportOptions
    from onnxdiffusion.export.validate import export_component
    from onnxdiffusion.families import get_family

    base = current_rss_bytes()
    fam = get_family(family)
    cls = FluxTransformer2DModel if family == "flux" else QwenImageTransformer2DModel
    model = cls.from_pretrained(folder).eval()
    cfg = dict(model.config)
    info = {"latent_channels": 16, "out_channels": 16, "context_dim": cfg["joint_attention_dim"],
            "pooled_dim": cfg.get("pooled_projection_dim", 0), "guidance_embeds": cfg.get("guidance_embeds", False),
            "vae_scale_factor": 8, "max_lengths": {"text_encoder_2": 16}, "model_max_length": 16}
    spec = fam.component_specs(info, {"transformer"})["transformer"]
    gen = torch.Generator().manual_seed(0)
    feeds = [fam.export_feeds(spec, d, gen, 0) for d in fam.export_dims(spec, info)]
    entry = export_component(spec, fam.wrap(spec, model).eval(), feeds, out, ExportOptions())
    return {"family": family, "config": {k: cfg[k] for k in ("num_layers", "attention_head_dim", "num_attention_heads",
                                                                 "joint_attention_dim") if k in cfg}
            | {"num_single_layers": cfg.get("num_single_layers")},
            "params": sum(p.numel() for p in model.parameters()), "component_bytes": entry["bytes"],
            "peak_rss_bytes": peak_rss_bytes(), "rss_after_imports_bytes": base,
            "validation": entry.get("validation")}


def main() -> None:
    if sys.argv[1] == "--build":
        build(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    if sys.argv[1] == "--export":
        print(json.dumps(export(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))))
        return
    family, layers = sys.argv[1], int(sys.argv[2])
    single = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-expmem-") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        subprocess.run([sys.executable, __file__, "--build", family, str(src), str(layers), str(single)], check=True)
        res = subprocess.run([sys.executable, __file__, "--export", family, str(src), str(out)], check=True,
                             capture_output=True, text=True)
    row = json.loads(res.stdout.strip().splitlines()[-1])
    row["peak_over_component"] = round(row["peak_rss_bytes"] / row["component_bytes"], 2)
    row["peak_minus_imports_over_component"] = round(
        (row["peak_rss_bytes"] - row["rss_after_imports_bytes"]) / row["component_bytes"], 2)
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
