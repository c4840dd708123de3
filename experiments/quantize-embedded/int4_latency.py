"""Is int4-weights' backbone really no slower than fp32? Interleaved, order rotated, several rounds (issue 12).

    nice -n 10 .venv/bin/python experiments/quantize-embedded/int4_latency.py --model models/shapes-mmdit-onnx \
        --variants all4=runs/x/int4 tr35=runs/x/int4_tr35 --rounds 5 --out experiments/quantize-embedded/int4_latency.json

Each variant is a quantized model folder; every round times each backbone `--runs` calls per batch (1/4/16
images = 2/8/32 guided rows), the variants' order rotated round to round, wall and CPU time per call; the
ratio vs fp32 is taken per round (medians) and reported as the median over rounds with its min-max.
1 thread; the machine is shared, so only ratios of interleaved medians are meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.families import get_family  # noqa: E402
from onnxdiffusion.quantize.report import component_feed  # noqa: E402
from onnxdiffusion.quantize.runner import session  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--variants", nargs="+", required=True, help="LABEL=FOLDER")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    manifest = json.loads((args.model / "manifest.json").read_text())
    backbone = get_family(manifest.get("family")).backbone
    rel = manifest["components"][backbone]["path"]
    folders = {"fp32": args.model} | {k: Path(v) for k, v in (s.split("=", 1) for s in args.variants)}
    sessions = {k: session(f / rel, 1, "cpu") for k, f in folders.items()}
    result = {"model": args.model.name, "rounds": args.rounds, "runs_per_round": args.runs, "threads": 1,
              "variants": {k: str(f.resolve().relative_to(ROOT)) if f.resolve().is_relative_to(ROOT) else f.name for k, f in folders.items()},
              "loadavg_start": os.getloadavg(), "note": "shared 2-core machine; interleaved, order rotated per round",
              "batches": {}}
    names = list(sessions)
    for b in args.batches:
        feed = component_feed(backbone, manifest, batch=b)
        for s in sessions.values():
            for _ in range(3):
                s.run(None, feed)
        per_round = {k: [] for k in names}
        cpu_round = {k: [] for k in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            wall = {k: [] for k in names}
            cpu = {k: [] for k in names}
            for _ in range(args.runs):
                for k in order:
                    t0, c0 = time.perf_counter(), time.process_time()
                    sessions[k].run(None, feed)
                    wall[k].append(time.perf_counter() - t0)
                    cpu[k].append(time.process_time() - c0)
            for k in names:
                per_round[k].append(float(np.median(wall[k])))
                cpu_round[k].append(float(np.median(cpu[k])))
        entry = {}
        for k in names:
            ratios = [a / f for a, f in zip(per_round[k], per_round["fp32"])]
            cpu_ratios = [a / f for a, f in zip(cpu_round[k], cpu_round["fp32"])]
            entry[k] = {"median_ms": round(float(np.median(per_round[k])) * 1e3, 3),
                        "ratio_median": round(float(np.median(ratios)), 3),
                        "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                        "cpu_ratio_median": round(float(np.median(cpu_ratios)), 3),
                        "rounds_slower": sum(x > 1.0 for x in ratios)}
        result["batches"][f"{b} img"] = entry
        print(b, json.dumps(entry), flush=True)
    result["loadavg_end"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"## int4-weights backbone latency vs fp32, {result['model']} ({args.rounds} rounds x {args.runs} interleaved calls, 1 thread)",
             "", "| variant | " + " | ".join(f"{b} (ratio median [min-max], CPU ratio, rounds slower)" for b in result["batches"]) + " |",
             "|---|" + "---|" * len(result["batches"])]
    for k in names[1:]:
        cells = [f"{e[k]['ratio_median']:.3f}x [{e[k]['ratio_min']:.3f}-{e[k]['ratio_max']:.3f}], cpu {e[k]['cpu_ratio_median']:.3f}x, "
                 f"{e[k]['rounds_slower']}/{args.rounds}" for e in result["batches"].values()]
        lines.append(f"| {k} ({result['variants'][k]}) | " + " | ".join(cells) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
