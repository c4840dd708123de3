"""Same-process A/B of backbone step times (the run-time LoRA overhead work, experiments/lora/overhead.md):
every variant's guided backbone call in one process, interleaved rounds, CPU time, 1 thread; each ratio is the
median of the per-round ratios to the first variant (a shared machine's load drifts out of it).

    PYTHONPATH=src python experiments/lora/ab_step.py NAME=FOLDER[:LORA[:run]] ... [--rounds 60] [--calls 3]

`:run` feeds the adapter's arrays through session.run() every step (the step before the IO-binding change)
instead of the bound FedBackbone. A folder with points runs as the pipeline runs it: no adapter, the plain graph;
an adapter, its merged weights (adapters/fused.py); measure.py also times the points graph's branches. FOLDER: a model folder (plain, or with `lora points`, from this tree's code
or an older one: its graph is what runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def bound_or_run(pipe, step, mode: str):
    if mode != "run":
        return step
    from onnxdiffusion.families.base import OUT, SAMPLE, TIMESTEP
    from onnxdiffusion.samplers import cfg_combine

    feeds = {SAMPLE: step.sample, TIMESTEP: step.timestep, **step.conditioning, **step.adapter}
    b = step.batch

    def call(x, t):
        step.sample[:b], step.sample[b:] = x, x
        step.timestep.fill(t)
        out = step.session.run([OUT], feeds)[0]
        return cfg_combine(out[:b], out[b:], step.guidance, rescale=step.rescale)
    return call


def main() -> None:
    from onnxdiffusion.runtime import Pipeline

    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    pipes, fns = {}, {}
    for spec in args.variants:
        name, _, rest = spec.partition("=")
        folder, _, rest = rest.partition(":")
        lora, _, mode = rest.partition(":")
        pipe = pipes.setdefault(folder, Pipeline.from_folder(folder, threads=1))
        shape = pipe.latent_shape_for(1)
        step = pipe.guided_backbone(["a red circle"], None, 4.0, 64, 64, shape,
                                    adapter=pipe.lora_feeds([(lora, 1.0)] if lora else None))
        fns[name] = bound_or_run(pipe, step, mode)
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    for fn in fns.values():
        fn(x, 500.0)
    samples = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            t = time.process_time()
            for _ in range(args.calls):
                fn(x, 500.0)
            samples[k].append((time.process_time() - t) / args.calls)
    first = next(iter(samples))
    print(f"load {' '.join(open('/proc/loadavg').read().split()[:3])}; {args.rounds} rounds x {args.calls}")
    print(f"| variant | ms / call (median) | vs {first} (median of per-round ratios) |\n|---|---|---|")
    for k, v in samples.items():
        ratio = statistics.median(a / b for a, b in zip(v, samples[first]))
        print(f"| {k} | {statistics.median(v) * 1e3:.2f} | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
