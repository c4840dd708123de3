"""Joint (MMDiT) attention exported as one ONNX Runtime MultiHeadAttention node vs the plain export.

An SD3 transformer at SD3-medium width (24 heads x 64 = 1536) with a few blocks, random weights,
at 512x512 (1024 image tokens + 77 + 256 text tokens), guided batch 2: exported fused and unfused,
checked against PyTorch, then timed on the CPU provider as interleaved repeats (medians).

    PYTHONPATH=src python experiments/families/joint_attention.py [--layers 2] [--size 512] [--repeats 5] [--threads 2]
Writes experiments/families/joint_attention.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "joint_attention.json")
    args = ap.parse_args()

    import numpy as np
    import onnxruntime as ort
    import torch
    from diffusers import SD3Transformer2DModel

    from onnxdiffusion.export.attention import fuse_attention
    from onnxdiffusion.export import family_export
    from onnxdiffusion.export.dummies import dummy_feeds
    from onnxdiffusion.export.pipeline import ExportOptions
    from onnxdiffusion.export.validate import export_component
    from onnxdiffusion.families import get_family

    torch.manual_seed(0)
    cfg = dict(sample_size=args.size // 8, patch_size=2, in_channels=16, num_layers=args.layers, attention_head_dim=64,
               num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
               pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192)
    family = get_family("sd3")
    info = {"latent_channels": 16, "context_dim": 4096, "pooled_dim": 2048, "encoder_widths": [768, 1280]}
    spec = family.backbone_spec(info)
    lat = args.size // 8
    dims = {"batch_size": 2, "height_latent": lat, "width_latent": lat, "sequence_length": 77 + 256}
    feeds = dummy_feeds(spec, dims, torch.Generator().manual_seed(0))
    np_feeds = {k: v.numpy() for k, v in feeds.items()}
    result = {"config": cfg, "tokens": {"image": (lat // 2) ** 2, "text": 333}, "batch": 2, "threads": args.threads,
              "machine": platform.machine(), "onnxruntime": ort.__version__, "variants": {}}
    sessions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fused in (False, True):
            model = SD3Transformer2DModel(**cfg).eval()
            n = fuse_attention(model) if fused else 0
            name = "fused" if fused else "plain"
            t0 = time.time()
            entry = export_component(spec, family_export.wrap(family, spec, model), [feeds], Path(tmp) / name, ExportOptions())
            result["variants"][name] = {"fused_blocks": n, "export_s": round(time.time() - t0, 1),
                                        "max_abs_error_vs_torch": entry["validation"]["max_abs_error"]}
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = args.threads
            sessions[name] = ort.InferenceSession(str(Path(tmp) / name / "model.onnx"), opts,
                                                  providers=["CPUExecutionProvider"])
            del model
        times = {k: [] for k in sessions}
        for s in sessions.values():  # warm-up
            s.run(None, np_feeds)
        for _ in range(args.repeats):
            for k, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, np_feeds)
                times[k].append(time.perf_counter() - t0)
    for k, ts in times.items():
        result["variants"][k]["median_ms"] = round(1000 * statistics.median(ts), 1)
        result["variants"][k]["runs_ms"] = [round(1000 * t, 1) for t in ts]
    result["speedup_fused"] = round(result["variants"]["plain"]["median_ms"] / result["variants"]["fused"]["median_ms"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {kk: v[kk] for kk in ("median_ms", "max_abs_error_vs_torch")} for k, v in result["variants"].items()}),
          "speedup", result["speedup_fused"])


if __name__ == "__main__":
    main()
