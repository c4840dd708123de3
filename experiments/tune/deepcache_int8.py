"""DeepCache on an int8-timestep UNet folder (issue 46, branch deep46): its pictures against DeepCache on the fp32
folder and against the plain folders, on tune's 16 tuning prompts and seeds; host loop vs the Loop graph.

    PYTHONPATH=src HF_HUB_OFFLINE=1 python experiments/tune/deepcache_int8.py INT8_TIMESTEP_FOLDER OUT.json \
        [--fp32 models/shapes-sd-onnx] [--specs deepcache:3:L1,deepcache:2:L1] [--count 16]

INT8_TIMESTEP_FOLDER: `onnxdiffusion quantize models/shapes-sd-onnx F --recipe int8-timestep --no-quality
--latency-runs 3 --threads 1` (tune's own build). Each figure is the mean per-image PSNR (dB) over the prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    from onnxdiffusion.bench.machine import machine_facts
    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.tune.measure import mean_psnr, scene_set
    from onnxdiffusion.tune.run import TUNE_START

    ap = argparse.ArgumentParser()
    ap.add_argument("int8")
    ap.add_argument("out")
    ap.add_argument("--fp32", default="models/shapes-sd-onnx")
    ap.add_argument("--specs", default="deepcache:3:L1,deepcache:2:L1")
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    prompts = scene_set("tune", a.count, TUNE_START)
    seeds = [prompts.seed + i for i in range(a.count)]

    def run(pipe, cache="none", loop=None):
        from onnxdiffusion.evaluate.run import item_latents

        shape = pipe.latent_shape_for(a.count)[1:]
        kw = {"loop": loop} if loop else {}
        t0 = time.perf_counter()
        images = pipe(list(prompts.prompts), steps=a.steps, sampler="ddim", batch=a.count, seed=seeds[0],
                      latents=item_latents(shape, seeds), cache=cache, **kw).images
        return images, time.perf_counter() - t0

    fp32 = Pipeline.from_folder(a.fp32, verify=False)
    int8 = Pipeline.from_folder(a.int8, verify=False)
    ref, t_ref = run(fp32)
    plain, t_plain = run(int8)
    rows = {"int8-timestep (no cache) vs fp32": {"psnr": mean_psnr(plain, ref), "seconds": t_plain},
            "fp32 (no cache)": {"seconds": t_ref}}
    with tempfile.TemporaryDirectory(prefix="deep46-") as tmp:
        for spec in a.specs.split(","):
            fc, t_fc = run(fp32, spec)
            ic, t_ic = run(int8, spec)
            loop_dir = Path(tmp) / spec.replace(":", "_")
            compile_loop(a.int8, loop_dir, form="loop", cache=spec)
            lp = Pipeline.from_folder(loop_dir, verify=False)
            host, _ = run(lp, spec)
            looped, _ = run(lp, spec, loop="loop")
            rows[spec] = {
                "int8-timestep+cache vs fp32+cache": mean_psnr(ic, fc),
                "int8-timestep+cache vs fp32": mean_psnr(ic, ref),
                "fp32+cache vs fp32": mean_psnr(fc, ref),
                "int8-timestep+cache vs int8-timestep": mean_psnr(ic, plain),
                "loop graph == host loop (int8-timestep+cache, compiled folder)": bool(np.array_equal(host, looped)),
                "compiled folder's host loop == the plain folder's": bool(np.array_equal(host, ic)),
                "seconds": {"fp32+cache": t_fc, "int8-timestep+cache": t_ic},
            }
            print(spec, json.dumps(rows[spec]), file=sys.stderr, flush=True)
    result = {"prompts": prompts.describe(), "steps": a.steps, "sampler": "ddim", "machine": machine_facts(),
              "note": "psnr: [mean, worst] per-image dB; seconds: one batch of all prompts (shared machine)",
              "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
