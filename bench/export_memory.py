"""Export peak memory vs the exported component's bytes (issue 11, acceptance 5).

Each measurement runs in a fresh process: build a full-width random-weight backbone (SD3's MMDiT at
SD3-medium width with fewer blocks, or SDXL's UNet at full channel widths with fewer transformer
layers), then export it with validation exactly as `export` does (onnxdiffusion.export.validate).
Reported: peak RSS of the process, RSS before the module was built (torch/diffusers imported),
the component's bytes on disk, and peak / bytes.

    PYTHONPATH=src python bench/export_memory.py [--family sd3|sdxl] [--layers N]
Appends to bench/results/export_memory.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(family_name: str, layers: int, out: Path) -> dict:
    import torch

    from onnxdiffusion.export.attention import fuse_attention
    from onnxdiffusion.export.dummies import dummy_feeds
    from onnxdiffusion.export.pipeline import ExportOptions
    from onnxdiffusion.export.validate import export_component
    from onnxdiffusion.families import get_family

    torch.manual_seed(0)
    base = _rss_mb()
    family = get_family(family_name)
    if family_name == "sd3":
        from diffusers import SD3Transformer2DModel

        cfg = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192)
        model = SD3Transformer2DModel(**cfg).eval()
        info = {"latent_channels": 16, "context_dim": 4096, "pooled_dim": 2048, "encoder_widths": [768, 1280]}
        dims = {"batch_size": 2, "height_latent": 32, "width_latent": 32, "sequence_length": 77 + 256}
    else:
        from diffusers import UNet2DConditionModel

        cfg = dict(sample_size=128, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280),
                   layers_per_block=2, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                   up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                   transformer_layers_per_block=(1, layers, layers), attention_head_dim=(5, 10, 20),
                   use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                   projection_class_embeddings_input_dim=2816, cross_attention_dim=2048)
        model = UNet2DConditionModel(**cfg).eval()
        info = {"latent_channels": 4, "context_dim": 2048, "pooled_dim": 1280, "encoder_widths": [768, 1280]}
        dims = {"batch_size": 2, "height_latent": 32, "width_latent": 32, "sequence_length": 77}
    fuse_attention(model)
    params = sum(p.numel() for p in model.parameters())
    built = _rss_mb()
    spec = family.backbone_spec(info)
    feeds = dummy_feeds(spec, dims, torch.Generator().manual_seed(0))
    t0 = time.time()
    entry = export_component(spec, family.wrap(spec, model), [feeds], out, ExportOptions())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"family": family_name, "layers": layers, "params": params, "config": cfg,
            "rss_before_model_mb": round(base, 1), "rss_model_built_mb": round(built, 1),
            "peak_rss_mb": round(peak, 1), "component_mb": round(entry["bytes"] / 2**20, 1),
            "external_data": entry["external_data"], "export_s": round(time.time() - t0, 1),
            "max_abs_error_vs_torch": entry["validation"]["max_abs_error"],
            "peak_over_bytes": round(peak / (entry["bytes"] / 2**20), 2),
            "peak_minus_baseline_over_bytes": round((peak - base) / (entry["bytes"] / 2**20), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="sd3", choices=("sd3", "sdxl"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "export_memory.json")
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(child(args.family, args.layers, Path(tmp) / "c")))
        return
    proc = subprocess.run([sys.executable, __file__, "--child", "--family", args.family, "--layers", str(args.layers)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = json.loads(args.out.read_text()) if args.out.is_file() else []
    rows.append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "config"}))


if __name__ == "__main__":
    main()
