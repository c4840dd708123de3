"""Run-time LoRA step time at SD1.5 size (issue 23, acceptance 2): a random rank-32 adapter on the attention
layers and proj_in / proj_out of an SD1.5-size UNet (what a diffusers `train_text_to_image_lora`-style LoRA and
the embedded measurement's adapter reach), one guided backbone call (batch 1 -> 2 with guidance), 1 thread,
CPU time, interleaved rounds, medians.

    PYTHONPATH=src python experiments/lora/measure_sd15.py WORK --model fp32=FOLDER [--model int8=FOLDER ...]
        [--rank 32] [--size 256] [--rounds 3]

Each FOLDER is an exported (or quantized) SD1.5-size folder; WORK receives its copy with insertion points
(`lora points`: unchanged files and external weights are linked, not copied) and the LoRA file.
Results: results_sd15.{md,json} here.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TARGETS = re.compile(r"\.(to_q|to_k|to_v|to_out\.0|proj_in|proj_out)$")


def write_lora(points: Path, out: Path, rank: int, seed: int = 32) -> Path:
    """A random peft-layout LoRA over the UNet's attention and proj layers the folder has points for."""
    from onnxdiffusion.adapters import safetensors_io
    from onnxdiffusion.adapters.points import targets_from_manifest
    from onnxdiffusion.folder.artifacts import read_manifest

    targets = targets_from_manifest(read_manifest(points)["components"]["unet"])
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, t in sorted(targets.items()):
        if not TARGETS.search(module):
            continue
        tail = (1, 1) if t.op == "conv" else ()
        tensors[f"unet.{module}.lora_A.weight"] = (rng.standard_normal((rank, t.in_features, *tail))
                                                   / np.sqrt(t.in_features)).astype(np.float32)
        tensors[f"unet.{module}.lora_B.weight"] = (rng.standard_normal((t.out_features, rank, *tail)) * 0.01).astype(np.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    safetensors_io.write(out, tensors)
    return out


def main() -> None:
    from measure import cpu

    from onnxdiffusion.adapters.folder import add_points
    from onnxdiffusion.runtime import Pipeline

    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--model", action="append", required=True, help="NAME=FOLDER (fp32=..., int8=...)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results_sd15", help="results file name (without .md/.json) here")
    args = ap.parse_args()
    models = dict(m.split("=", 1) for m in args.model)
    args.work.mkdir(parents=True, exist_ok=True)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    rows, lora_file = {}, None
    for name, folder in models.items():
        points = args.work / f"{name}_points"
        if not points.exists():
            t = time.time()
            add_points(Path(folder), points, verify=False)
            print(f"{name}: points in {time.time() - t:.0f} s", flush=True)
        lora_file = lora_file or write_lora(points, args.work / f"lora{args.rank}.safetensors", args.rank)
        plain, with_points = Pipeline.from_folder(folder, threads=1), Pipeline.from_folder(points, threads=1)
        shape = plain.latent_shape_for(1, args.size, args.size)
        adapter = with_points.lora_feeds([(lora_file, 1.0)])
        fns = {f"{name}": plain.guided_backbone(["a photo"], None, 7.5, args.size, args.size, shape),
               f"{name} points, no adapter": with_points.guided_backbone(["a photo"], None, 7.5, args.size, args.size, shape)}
        t = time.process_time()  # the first adapter: the fused session made, the merged weights computed
        fns[f"{name} points + rank-{args.rank}"] = with_points.guided_backbone(["a photo"], None, 7.5, args.size,
                                                                              args.size, shape, adapter=adapter)
        first_adapter = time.process_time() - t
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        ref = {k: fn(x, 500.0).copy() for k, fn in fns.items()}  # warm-up
        assert np.array_equal(ref[name], ref[f"{name} points, no adapter"]), "points without adapter changed the output"
        samples = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                t = time.process_time()
                fn(x, 500.0)
                samples[k].append(time.process_time() - t)
        points = samples[f"{name} points, no adapter"]
        for k, v in samples.items():  # ratios: the median of the per-round ratios
            rows[k] = {"seconds": statistics.median(v), "samples": v,
                       "vs_base": statistics.median(a / b for a, b in zip(v, samples[name])),
                       "vs_points": statistics.median(a / b for a, b in zip(v, points)) if "points" in k else None}
            print(f"{k}: {rows[k]['seconds']:.3f} s ({rows[k]['vs_base']:.3f}x)", flush=True)
        switch = []
        for _ in range(3):  # another adapter set (same file, files parsed): its A/B feeds and merged weights
            t = time.process_time()
            with_points.lora.fused.feeds(with_points.lora_feeds([(lora_file, 1.0)]))
            switch.append(time.process_time() - t)
        rows[f"{name} adapter layers"] = {"modules": len(adapter.for_component("unet")) // 2, "shape": list(shape),
                                          "merged_layers": len(with_points.lora.fused.layers),
                                          "first_adapter_s": first_adapter, "switch_s": statistics.median(switch)}
        print(rows[f"{name} adapter layers"], flush=True)
        del fns, plain, with_points, adapter
        gc.collect()  # one model's sessions at a time
    load = Path("/proc/loadavg").read_text().split()[:3]
    result = {"cpu": cpu(), "load_avg": load, "load_avg_before": load_before, "threads": 1, "rank": args.rank,
              "size": args.size, "rows": rows}
    (HERE / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Run-time LoRA step time at SD1.5 size", "",
             f"CPU: {result['cpu']}; load {' '.join(load_before)} before, {' '.join(load)} after; 1 thread; CPU time of "
             f"one guided UNet call (batch 2) at "
             f"{args.size}x{args.size}, median of {args.rounds} interleaved rounds; random weights; a random rank-{args.rank} "
             f"LoRA on to_q/to_k/to_v/to_out.0/proj_in/proj_out.", "",
             f"`PYTHONPATH=src python experiments/lora/measure_sd15.py WORK {' '.join(f'--model {n}=FOLDER' for n in models)}"
             f" --rank {args.rank} --size {args.size} --rounds {args.rounds} --out {args.out}` (FOLDER: the bench verb's SD1.5-size export "
             "and its int8-static quantization); ratios: median of the per-round ratios.", "",
             "`points`: as the pipeline runs the folder with insertion points: no adapter, the plain graph (branches "
             "taken out); an adapter, its merged weights (adapters/fused.py).", "",
             "| variant | s / call | vs plain folder | vs points, no adapter |", "|---|---|---|---|"]
    for k, v in rows.items():
        if "seconds" in v:
            vp = f"{v['vs_points']:.3f}x" if v["vs_points"] else ""
            lines.append(f"| {k} | {v['seconds']:.3f} | {v['vs_base']:.3f}x | {vp} |")
    lines += ["", "Changing the adapter set: the first adapter on a pipeline makes the fused session and computes the "
              "set's merged weights; another set computes its merged weights (CPU seconds, median of 3):", "",
              "| folder | adapter's layers | merged layers in the graph | first adapter | switch |", "|---|---|---|---|---|"]
    for k, v in rows.items():
        if "merged_layers" in v:
            lines.append(f"| {k.split()[0]} | {v['modules']} | {v['merged_layers']} | {v['first_adapter_s']:.1f} s | "
                         f"{v['switch_s']:.2f} s |")
    (HERE / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
