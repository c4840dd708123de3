"""CPU time of the Loop graph with step caching vs without, 1 ORT thread, both embedded models.

    PYTHONPATH=src python experiments/loop_cache/speed.py [OUT_DIR] [--steps 20] [--rounds 5] [--only CACHE ...]

Compiles each embedded model's Loop graph with and without --cache into OUT_DIR (default: a temp folder),
then times whole generations (text encoding, the Loop, VAE decoding) in interleaved rounds; prints the
median process CPU time of each and the plain Loop's time over it (the speed-up).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.runtime import Pipeline

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"shapes-sd-onnx": ("deepcache", ["deepcache:2", "deepcache:3"]),
        "shapes-mmdit-onnx": ("taylorseer", ["taylorseer:2", "taylorseer:3"]),
        "shapes-mmdit-onnx ": ("first_block", ["first_block:0.25", "first_block:0.5"]),
        "shapes-sd-onnx ": ("deepcache:3:L1", ["deepcache:3:L1", "deepcache:4:L1"])}  # layer branch: compiled in


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="+", default=None, metavar="CACHE", help="only the runs compiled with these --cache")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="loop-cache-"))
    out.mkdir(parents=True, exist_ok=True)
    for name, (method, specs) in RUNS.items():
        if args.only and method not in args.only:
            continue
        model = ROOT / "models" / name.strip()
        folders = {}
        for key, cache in (("plain", None), ("cached", method)):
            folders[key] = out / f"{name.strip()}-{cache or 'plain'}".replace(":", "_")
            if not folders[key].exists():
                compile_loop(model, folders[key], cache=cache)
        pipes = {k: Pipeline.from_folder(f, threads=1) for k, f in folders.items()}
        kw = dict(steps=args.steps, seed=0)
        runs = {"plain Loop (compiled without --cache)": (pipes["plain"], None, "loop"),
                "cached Loop, no --cache": (pipes["cached"], None, "loop"),
                **{f"cached Loop, --cache {s}": (pipes["cached"], s, "loop") for s in specs},
                **{f"host loop, --cache {s}": (pipes["cached"], s, "host") for s in specs[:1]}}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for pipe, spec, loop in runs.values():
            pipe("warm up", cache=spec, loop=loop, **kw)
        for _ in range(args.rounds):
            for label, (pipe, spec, loop) in runs.items():
                t = time.process_time()
                pipe("a red circle above a blue square", cache=spec, loop=loop, **kw)
                times[label].append(time.process_time() - t)
        base = statistics.median(times["plain Loop (compiled without --cache)"])
        for label, ts in times.items():
            m = statistics.median(ts)
            print(f"{name.strip():18s} {label:40s} {m * 1000:7.1f} ms CPU  {base / m:4.2f}x", flush=True)

if __name__ == "__main__":
    main()
