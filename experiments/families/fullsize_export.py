#!/usr/bin/env python
"""Export bounded by memory at release size (issue 43, acceptance 2): Z-Image (6B, Z-Image-Turbo's transformer
config) and FLUX.2 [klein] 4B with RANDOM weights, written straight to bf16 safetensors shards tensor by tensor (the
model is never instantiated: shapes from the meta device), then the backbone exported in a fresh process with
`--stream-weights on` and validation on (a cut-down copy, export/streamed_float.py); peak RSS (VmHWM, and RSS
sampled by a thread every 0.2 s) vs the backbone's fp32 bytes (4 x parameters).

The rest of the folder is tiny but consistent (the scene-word tokenizers of tests/helpers, a VAE of a few
channels with the release's latent channels, a text encoder of the release's width and few, narrow layers) so the
folder passes export's checks; only the backbone is exported (`components=(transformer,)`).

    python experiments/families/fullsize_export.py write zimage W/zimage-src      # ~12 GB of bf16 shards
    python experiments/families/fullsize_export.py export W/zimage-src W/zimage-onnx   # one JSON line (a child)
    python experiments/families/fullsize_export.py run zimage --work W [--keep]   # write, export, record, delete
    python experiments/families/fullsize_export.py --table                         # fullsize_export.md from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "fullsize_export.json"
TABLE = HERE / "fullsize_export.md"
GB = 1e9
GiB = 2**30
SHARD_BYTES = 2 * GiB  # bf16 bytes per shard (the releases ship ~5-10 GB shards; smaller keeps the writer lean)

# the released transformer configs (config.json values; Z-Image-Turbo's axes_lens differ from diffusers' default)
ARCHES = {
    "zimage": ("ZImageTransformer2DModel", dict(
        all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
        n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])),
    "flux2_klein": ("Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, eps=1e-6, guidance_embeds=False)),
}


def _base(arch: str, folder: Path) -> Path:
    """The tiny rest of the pipeline at the release's interface widths (text width 2560, latent channels)."""
    import torch
    from transformers import Qwen3Config

    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    tmp = folder.parent / (folder.name + ".base")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(0)
    narrow = dict(hidden_size=2560, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                  max_position_embeddings=1024, rope_theta=1000000.0)
    if arch == "zimage":
        from diffusers import AutoencoderKL
        from tiny_families import build_tiny_zimage
        from transformers import Qwen3Model

        src = build_tiny_zimage(tmp)
        vocab = json.loads((src / "text_encoder" / "config.json").read_text())["vocab_size"]
        encoder = Qwen3Model(Qwen3Config(vocab_size=vocab, num_hidden_layers=3, **narrow))
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16, 16, 16),
                            layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=4, sample_size=64,
                            use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    else:
        from diffusers import AutoencoderKLFlux2
        from tiny_flux2 import build_tiny_flux2_klein
        from transformers import Qwen3ForCausalLM

        src = build_tiny_flux2_klein(tmp)
        vocab = json.loads((src / "text_encoder" / "config.json").read_text())["vocab_size"]
        encoder = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, num_hidden_layers=28, tie_word_embeddings=True, **narrow))
        vae = AutoencoderKLFlux2(latent_channels=32, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                                 sample_size=32, down_block_types=("DownEncoderBlock2D",) * 2,
                                 up_block_types=("UpDecoderBlock2D",) * 2)
    for name, module in (("text_encoder", encoder), ("vae", vae)):
        shutil.rmtree(src / name)
        module.eval().save_pretrained(src / name, safe_serialization=True)
    shutil.rmtree(src / "transformer")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(src, folder)
    shutil.rmtree(tmp)
    return folder


def write(arch: str, folder: Path, fast: bool = False) -> dict:
    """The folder with the backbone's random bf16 shards written tensor by tensor (one shard's tensors held)."""
    import diffusers
    from accelerate import init_empty_weights

    from onnxdiffusion.bench.arch.release import write_random

    class_name, config = ARCHES[arch]
    t0 = time.time()
    _base(arch, folder)
    cls = getattr(diffusers, class_name)
    with init_empty_weights():
        meta = cls(**config)
    out = folder / "transformer"
    out.mkdir()
    meta.save_config(out)
    params = write_random(meta, out, "diffusion_pytorch_model.safetensors",
                          "diffusion_pytorch_model.safetensors.index.json", shard_bytes=SHARD_BYTES, pooled=fast)
    del meta
    shards = sorted(out.glob("*.safetensors"))
    desc = {"arch": arch, "backbone_class": class_name, "config": config, "params": params,
            "fp32_bytes": 4 * params, "bf16_shard_bytes": sum(f.stat().st_size for f in shards),
            "shards": len(shards), "write_s": round(time.time() - t0, 1),
            "random": "pooled" if fast else "per tensor"}
    (folder / "fullsize.json").write_text(json.dumps(desc, indent=1))
    return desc


class Sampler:
    """RSS sampled every `period` s by a thread (what a ps loop sees), beside the kernel's VmHWM."""

    def __init__(self, period: float = 0.2):
        from onnxdiffusion.bench.rss import current_rss_bytes

        self._cur, self.period, self.peak, self._stop = current_rss_bytes, period, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._cur() or 0)
            self._stop.wait(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def child(src: Path, out: Path) -> dict:
    import onnx
    import onnxruntime
    import torch

    sys.path.insert(0, str(HERE))
    import onnxdiffusion.export.streamed_float as streamed_mod
    import onnxdiffusion.export.validate as validate_mod
    from export_memory import Meter
    from onnxdiffusion.export import ExportOptions, export_pipeline

    meter = Meter()
    base = meter._cur()
    sampler = Sampler()
    meter.wrap(streamed_mod, "build_backbone", "build (empty init, float params read)", "wrap, dummy inputs")
    meter.wrap(validate_mod, "_outputs", "PyTorch reference (cut-down copy)", "between")
    meter.wrap(torch.onnx, "export", "torch.onnx.export (placeholders)", "release")
    meter.wrap(validate_mod, "write_floats", "weights streamed into external data", "between")
    meter.wrap(onnx.checker, "check_model", "onnx checker", "between")
    meter.wrap(onnxruntime, "InferenceSession", "ORT session create (cut-down copy)", "ORT validation runs (cut-down)")
    meter.mark("setup")
    t0 = time.time()
    manifest = export_pipeline(src, out, ExportOptions(components=("transformer",), overwrite=True,
                                                       stream_weights="on"), progress=False)
    seconds = time.time() - t0
    meter.mark("end")
    entry = manifest["components"]["transformer"]
    return {"component_bytes": entry["bytes"], "peak_rss_bytes": meter.peak, "sampled_peak_rss_bytes": sampler.stop(),
            "rss_after_imports_bytes": base, "export_s": round(seconds, 1), "validation": entry.get("validation"),
            "phases": meter.segments,
            "versions": {k: manifest["tool_versions"][k] for k in ("torch", "diffusers", "onnx", "onnxruntime")}}


def run(arch: str, work: Path, keep: bool, fast: bool = False) -> dict:
    src, out = work / f"{arch}-src", work / f"{arch}-onnx"
    desc = json.loads((src / "fullsize.json").read_text()) if (src / "fullsize.json").is_file() else write(arch, src, fast)
    proc = subprocess.run([sys.executable, __file__, "export", str(src), str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"export child failed:\n{proc.stderr[-4000:]}")
    row = {**desc, **json.loads(proc.stdout.strip().splitlines()[-1])}
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
    row["peak_over_fp32"] = round(row["peak_rss_bytes"] / row["fp32_bytes"], 4)
    row["holds"] = row["peak_over_fp32"] <= 0.5
    row["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "shared": True}
    rows = [r for r in (json.loads(RESULTS.read_text()) if RESULTS.is_file() else []) if r["arch"] != arch]
    RESULTS.write_text(json.dumps(rows + [row], indent=1) + "\n")
    TABLE.write_text(table(rows + [row]))
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "# Export bounded by memory at release size (issue 43, acceptance 2)",
        "",
        "Random bf16 weights at the released configs, written tensor by tensor (`fullsize_export.py write`); the backbone "
        "exported alone in a fresh process, `stream_weights=\"on\"`, validation on (a cut-down copy: each block list's "
        "first 2 blocks, same width and weights); peak RSS = VmHWM of the process (a 0.2 s sampling thread beside it). "
        "CPU: AMD EPYC (avx512_vnni, avx512_bf16), 2 vCPUs, 23 GiB shared with ~7 other jobs. Raw rows: "
        "`fullsize_export.json`.",
        "",
        "| backbone | params | random | fp32 bytes | exported bytes | peak RSS (VmHWM) | sampled peak | peak / fp32 | <= 0.5x "
        "| phase setting the peak | validation max abs (atol) | write s | export s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        top = max(r["phases"], key=lambda s: s["peak_rss_bytes"])
        v = r.get("validation") or {}
        lines.append(
            f"| {r['arch']} ({r['backbone_class']}) | {r['params'] / 1e9:.2f} B | {r.get('random', 'per tensor')} | "
            f"{r['fp32_bytes'] / GB:.2f} GB | "
            f"{r['component_bytes'] / GB:.2f} GB | {r['peak_rss_bytes'] / GB:.2f} GB | "
            f"{r['sampled_peak_rss_bytes'] / GB:.2f} GB | {r['peak_over_fp32']:.3f}x | {'yes' if r['holds'] else 'NO'} | "
            f"{top['phase']} | {v.get('max_abs_error', float('nan')):.2e} ({v.get('atol')}) | {r['write_s']:.0f} | "
            f"{r['export_s']:.0f} |")
    lines += [
        "",
        "Where the memory goes: the backbone is built without weights; its float parameters other than Linear "
        "weights (norms, biases, embeddings, pad tokens: < 1% of a DiT) are read into memory; the graph is traced "
        "over 16-byte placeholders; each Linear weight is then read from the shards (positioned reads, no memory "
        "map), widened to fp32, transposed and written into `model.onnx_data`, one layer at a time. The peak is set "
        "by ONNX Runtime validating the cut-down copy (its weights, file-backed, paged in: a fixed ~1.1B / ~1.0B "
        "parameters here, whatever the full depth), not by the model's size. The full graph is checked by onnx's "
        "checker; its numerics are the cut-down copy's code path (same export code, same block classes, same width). "
        "`random`: per tensor = N(0, 0.02) drawn for every tensor; pooled (`--fast`) = slices of one drawn pool of "
        "64 Mi values (drawing 4 billion normals on the shared cores outlasts the export).",
        "",
        "Not measured here: Qwen-Image at 20B (80 GB of fp32 ONNX does not fit this machine's free disk); its streamed "
        "export holds the same per-layer working set and the same cut-down validation (2 of 60 blocks).",
    ]
    lines += ["", "Peak RSS per phase (GB; VmHWM reset at each boundary):", "", "| backbone | phases |", "|---|---|"]
    for r in rows:
        lines.append(f"| {r['arch']} | " + " · ".join(f"{s['phase']} {s['peak_rss_bytes'] / GB:.2f}"
                                                    for s in r["phases"]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--table":
        TABLE.write_text(table(json.loads(RESULTS.read_text())))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("arch", choices=sorted(ARCHES))
    w.add_argument("folder", type=Path)
    e = sub.add_parser("export")
    e.add_argument("src", type=Path)
    e.add_argument("out", type=Path)
    r = sub.add_parser("run")
    r.add_argument("arch", choices=sorted(ARCHES))
    r.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fullsize")
    r.add_argument("--keep", action="store_true")
    for p in (w, r):
        p.add_argument("--fast", action="store_true", help="random values sliced from one drawn pool")
    a = ap.parse_args()
    if a.cmd == "write":
        print(json.dumps(write(a.arch, a.folder, a.fast)))
    elif a.cmd == "export":
        print(json.dumps(child(a.src, a.out)))
    else:
        print(json.dumps(run(a.arch, a.work, a.keep, a.fast)))


if __name__ == "__main__":
    main()
