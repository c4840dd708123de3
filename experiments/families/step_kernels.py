#!/usr/bin/env python
"""Which int8 (or 4-bit) weight layout runs FLUX.2 [klein]'s denoising step fastest on this CPU (issue 43,
acceptance 3; the write-up is step_kernels.md).

The backbone is klein's at the release width (inner dim 3072, 24 heads of 128, MLP ratio 3, joint dim 7680:
bench/arch/release.py) at reduced depth (1 double + 2 single blocks of the released 5 + 20), random bf16 weights;
every layout is made the product's way from the same folder:

    W=SCRATCH/kern43
    python -m onnxdiffusion.bench.arch.fullwidth build flux2_klein $W/diffusers --depth 1,2 --encoder-layers 28
    python experiments/families/step_kernels.py prepare $W     # GGUF files, exports, quantized folders (skips done)
    python experiments/families/step_kernels.py measure $W --rounds 3 > $W/step_kernels.json

Layouts (folder under W: how it is made):
  fp32            export W/diffusers W/fp32 --skip vae_encoder                      the yardstick
  q8_0            export q8_0.gguf --base W/fp32                  MatMulNBits 8-bit, blocks of 32, accuracy_level 4
  q4_0            export q4_0.gguf --base W/fp32                  MatMulNBits 4-bit, blocks of 32, accuracy_level 4
  q8_0-channel    export q8_0.gguf --base W/fp32 --gguf-layout int8-channel   DynamicQuantizeMatMul, s8 per channel
  dyn-u8          quantize W/fp32 --recipe int8-dynamic (its defaults: uint8 weights, one scale per tensor)
  dyn-s8-channel  quantize W/fp32 --recipe int8-dynamic -O weight_type=int8 -O per_channel=true
  nbits8-b128/256 quantize W/fp32 --recipe weights-only -O components=transformer -O bits=8 -O block_size=B
                  -O accuracy_level=4                             MatMulNBits 8-bit with larger blocks
The GGUF files carry the release's tensor names (sd.cpp's and city96's: bench/arch/sdcpp_files) and are written by
the product's GGUF writer (export/gguf_writer.py, what the tests use).

`measure`: one backbone call at 512x512 (1024 image tokens, 512 text tokens, batch 1), 2 intra-op threads; in each
round every layout in turn gets a fresh session, one warm-up call and one timed call (CPU seconds of this process,
user+sys, and wall); rounds interleaved. Then one profiled call per layout (ORT's profiler, node time summed by
op type) and the output's signal-to-noise against fp32's and against q8_0's (today's path).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = ("fp32", "q8_0", "q4_0", "q8_0-channel", "dyn-u8", "dyn-s8-channel", "nbits8-b128", "nbits8-b256")
BASELINE = "q8_0"
GROUPS = {"MatMulNBits": "MatMulNBits", "DynamicQuantizeMatMul": "int8 GEMM", "MatMulIntegerToFloat": "int8 GEMM",
          "MatMulInteger": "int8 GEMM", "DynamicQuantizeLinear": "int8 GEMM", "MultiHeadAttention": "attention",
          "Attention": "attention", "MatMul": "float MatMul", "Gemm": "float MatMul", "FusedMatMul": "float MatMul"}


def _cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "onnxdiffusion.cli", *args]
    print("+", " ".join(args), flush=True)
    t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"  {time.time() - t0:.0f} s wall, {r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime:.0f} CPU s",
          flush=True)


def _gguf(w: Path, qtype: str) -> Path:
    from safetensors import safe_open

    from onnxdiffusion.bench.arch import sdcpp_files
    from onnxdiffusion.export.gguf_writer import write_gguf

    def tensors(f: Path):  # bf16 shards: numpy has no bfloat16, so through torch, one tensor at a time
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name).float().numpy()

    path = w / f"{qtype.lower()}.gguf"
    if not path.exists():
        named = w / "release-names.safetensors"
        if not named.exists():
            sdcpp_files.write(sdcpp_files.backbone_plan("flux2", w / "diffusers" / "transformer"), named)
        write_gguf(path, tensors(named), qtype, "flux2", use_temp_file=True)
    return path


def prepare(w: Path) -> None:
    if not (w / "fp32").exists():
        _cli("export", str(w / "diffusers"), str(w / "fp32"), "--skip", "vae_encoder")
    for qtype in ("Q8_0", "Q4_0"):
        folder = w / qtype.lower()
        if not folder.exists():
            _cli("export", str(_gguf(w, qtype)), str(folder), "--base", str(w / "fp32"))
    if not (w / "q8_0-channel").exists():
        _cli("export", str(_gguf(w, "Q8_0")), str(w / "q8_0-channel"), "--base", str(w / "fp32"),
             "--gguf-layout", "int8-channel")
    recipes = {"dyn-u8": ["--recipe", "int8-dynamic"],
               "dyn-s8-channel": ["--recipe", "int8-dynamic", "-O", "weight_type=int8", "-O", "per_channel=true"]}
    for block in (128, 256):
        recipes[f"nbits8-b{block}"] = ["--recipe", "weights-only", "-O", "components=transformer", "-O", "bits=8",
                                       "-O", f"block_size={block}", "-O", "accuracy_level=4"]
    for name, args in recipes.items():
        if not (w / name).exists():
            _cli("quantize", str(w / "fp32"), str(w / name), *args, "--no-quality", "--latency", "off")


def feeds(w: Path) -> dict:
    """One 512x512 call's inputs (batch 1, 1024 image tokens, 512 text tokens, no reference image)."""
    import numpy as np
    import torch

    from onnxdiffusion.export import family_export
    from onnxdiffusion.export.pipeline import source_info

    family, info = source_info(w / "diffusers")
    spec = family.component_specs(info, {family.backbone})[family.backbone]
    dims = dict(family.export_dims(spec, info)[0])
    dims.update(batch_size=1, rows=32, cols=32, image_sequence_length=1024, sequence_length=512, height_latent=64,
                width_latent=64, height=512, width=512, reference_grids=[[1, 1]], reference_sequence_length=1)
    made = family_export.export_feeds(family, spec, dims, torch.Generator().manual_seed(0), 0)
    out = {t.name: made[t.name].numpy() for t in spec.inputs}
    for name in ("reference_latents", "reference_ids"):  # text-to-image: no reference tokens
        if name in out:
            out[name] = np.zeros((1, 0, out[name].shape[-1]), np.float32)
    return out


def _session(path: Path, profile: str | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    if profile:
        so.enable_profiling, so.profile_file_prefix = True, profile
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _split(profile: str) -> dict[str, float]:
    events = json.loads(Path(profile).read_text())
    out: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            group = GROUPS.get(e["args"].get("op_name", ""), "rest")
            out[group] = out.get(group, 0.0) + e["dur"] / 1e6
    os.remove(profile)
    return {k: round(v, 3) for k, v in sorted(out.items())}


def _snr(ref, got) -> float:
    import numpy as np

    err = np.mean((ref.astype(np.float64) - got) ** 2)
    return round(float(10 * np.log10(np.mean(ref.astype(np.float64) ** 2) / err)), 2) if err else float("inf")


def measure(w: Path, rounds: int, layouts: list[str]) -> dict:
    import numpy as np

    run = feeds(w)
    paths = {k: w / k / "transformer" / "model.onnx" for k in layouts}
    cpu: dict[str, list[float]] = {k: [] for k in layouts}
    wall: dict[str, list[float]] = {k: [] for k in layouts}
    outs: dict[str, np.ndarray] = {}
    for r in range(rounds):
        for k in layouts:
            sess = _session(paths[k])
            outs[k] = sess.run(None, run)[0]
            c0, t0 = _cpu(), time.perf_counter()
            sess.run(None, run)
            cpu[k].append(round(_cpu() - c0, 3))
            wall[k].append(round(time.perf_counter() - t0, 3))
            del sess
            print(f"round {r} {k}: {cpu[k][-1]} CPU s, {wall[k][-1]} s wall", file=sys.stderr, flush=True)
    split = {}
    for k in layouts:
        sess = _session(paths[k], str(w / f"profile-{k}"))
        sess.run(None, run)
        split[k] = _split(sess.end_profiling())
        del sess
    base = float(np.median(cpu[BASELINE])) if BASELINE in cpu else None
    table = {}
    for k in layouts:
        med = float(np.median(cpu[k]))
        table[k] = {"cpu_s": cpu[k], "cpu_s_median": round(med, 3), "wall_s": wall[k],
                    "speed_vs_q8_0": round(base / med, 3) if base else None,
                    "snr_db_vs_fp32": _snr(outs["fp32"], outs[k]) if "fp32" in outs else None,
                    "snr_db_vs_q8_0": _snr(outs[BASELINE], outs[k]) if BASELINE in outs else None,
                    "profile_s": split[k],
                    "bytes": sum(p.stat().st_size for p in paths[k].parent.iterdir() if p.is_file())}
    import platform

    return {"cpu": _cpu_name(), "threads": 2, "rounds": rounds, "tokens": {"image": 1024, "text": 512},
            "loadavg": open("/proc/loadavg").read().split()[:3], "python": platform.python_version(),
            "onnxruntime": __import__("onnxruntime").__version__, "layouts": table}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("verb", choices=("prepare", "measure"))
    ap.add_argument("work", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    if args.verb == "prepare":
        prepare(args.work)
    else:
        print(json.dumps(measure(args.work, args.rounds, args.layouts.split(",")), indent=1))


if __name__ == "__main__":
    main()
