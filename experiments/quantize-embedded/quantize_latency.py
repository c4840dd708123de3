"""Backbone latency of quantized folders vs fp32, measured alone (run it on a quiet machine).

    .venv/bin/python experiments/quantize-embedded/quantize_latency.py [--model models/shapes-sd-onnx] [--work runs/quantize]

Every folder under --work written by quantize_eval.py is timed against the fp32 backbone:
calls interleaved (fp32, q, fp32, q, ...) so background load hits both alike, one ONNX Runtime
thread, each session created as the pipeline creates it (including the optimizers an int8
backbone disables), median over --runs calls, at 1, 4 and 16 images (the backbone sees twice
as many rows: uncond + cond). Also the whole 20-step DDIM generation of one image (host loop
and, where compiled, the Loop form). Each call is also timed against the fp32 backbone stored as
ORT's offline-optimized graph (as the int8 folders store theirs). Writes
experiments/quantize-embedded/quantize_latency.json and a table; --only NAME... times a subset (no files written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.quantize.report import component_feed  # noqa: E402
from onnxdiffusion.quantize.runner import ort_optimized, session, time_sessions  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402


def generation_seconds(folder: Path, loop: str, runs: int = 5) -> float | None:
    pipe = Pipeline.from_folder(folder, threads=1)
    if loop != "host" and f"sampler_{loop}" not in pipe.manifest["components"]:
        return None
    kw = dict(steps=20, guidance=5.0, seed=0, loop=loop)
    pipe("a red circle on the left", **kw)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        pipe("a red circle on the left", **kw)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "shapes-sd-onnx")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "quantize")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "quantize_latency.json")
    ap.add_argument("--only", nargs="*", help="folder names to time (prints, writes nothing)")
    args = ap.parse_args(argv)
    manifest = json.loads((args.model / "manifest.json").read_text())
    fp32_path = args.model / manifest["components"]["unet"]["path"]
    folders = sorted(p for p in args.work.iterdir() if (p / "manifest.json").is_file() and not p.name.endswith("-again"))
    if args.only:
        folders = [p for p in folders if p.name in args.only]
    fp32 = session(fp32_path, 1)
    # The int8 folders store ORT's CPU-fused graph; the fp32 backbone stored the same way (ORT's
    # extended fusions applied offline) is timed too, so the gain of storing it fused is not
    # counted as quantization's.
    fp32_opt = session(ort_optimized(onnx.load(str(fp32_path)), 1), 1)
    result = {"model": str(args.model), "threads": 1, "runs": args.runs, "batches_images": [1, 4, 16], "recipes": {}}
    fp32_gen = generation_seconds(args.model, "host")
    result["fp32_generate_seconds_per_image"] = fp32_gen
    for folder in folders:
        q = session(folder / "unet" / "model.onnx", 1)
        row = {}
        for b in (1, 4, 16):
            feed = component_feed("unet", manifest, batch=b)
            sessions = {"fp32": fp32, "fp32_opt": fp32_opt, "q": q}
            t = {k: v["median_ms"] for k, v in time_sessions(sessions, feed, max(20, args.runs // b)).items()}
            row[f"images{b}"] = {"fp32_ms": round(t["fp32"], 3), "fp32_optimized_ms": round(t["fp32_opt"], 3),
                                 "ms": round(t["q"], 3), "ratio": round(t["q"] / t["fp32"], 3),
                                 "ratio_vs_fp32_optimized": round(t["q"] / t["fp32_opt"], 3)}
        row["generate_seconds_per_image"] = {"host": generation_seconds(folder, "host"),
                                              "loop": generation_seconds(folder, "loop")}
        result["recipes"][folder.name] = row
        print(folder.name, {k: v["ratio"] for k, v in row.items() if k.startswith("images")}, row["generate_seconds_per_image"],
              file=sys.stderr, flush=True)
    if args.only:
        return 0
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"backbone latency vs fp32, 1 thread, median of interleaved calls ({args.runs} at 1 image); "
             f"fp32 20-step generation {fp32_gen:.3f} s/image",
             "", "| folder | 1 image | 1 image vs fp32 stored ORT-optimized | 4 images | 16 images | 20-step image, host (s) | Loop form (s) |",
             "|---|---|---|---|---|---|---|"]
    for name, row in result["recipes"].items():
        g = row["generate_seconds_per_image"]
        loop = "-" if g["loop"] is None else f"{g['loop']:.3f}"
        lines.append(f"| {name} | {row['images1']['ratio']:.3f}x ({row['images1']['ms']:.2f} ms) | "
                     f"{row['images1']['ratio_vs_fp32_optimized']:.3f}x | {row['images4']['ratio']:.2f}x | "
                     f"{row['images16']['ratio']:.2f}x | {g['host']:.3f} | {loop} |")
    table = "\n".join(lines)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
