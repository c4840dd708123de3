"""Which sampling steps set a held-out pair's flip under rotated W4A8 (issue 44, acceptance 2).

    python experiments/rotation/w4_step_probe.py --pair 101 --work DIR --variant top36:float [--gptq-steps 20]

The quantized backbone of w4_pair_probe.py's VARIANT (its fake-quantized weights and activations) runs every step
but those a row names, which run the fp32 backbone instead: the image's PSNR vs fp32 for the first k steps fp32,
the last k, and each single step, plus the latent's PSNR vs the fp32 trajectory after each step with no step fp32
(where the trajectories part). Appends one JSON line to WORK/w4_steps.jsonl.

    python experiments/rotation/w4_step_probe.py --heldout 128 --first 4 [--high w8:blocksym] --variant top36:blocksym --work DIR

--heldout N: the N held-out pairs (batch 32, quantize_eval.py's generation, fp32 images and judge) with the first
--first steps run by the fp32 backbone (or by the --high variant's): mean / worst / pooled / median PSNR, judge.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import npz_cache  # noqa: E402
from w4_pair_probe import REL, build, calibration, rotated_base, weight_sets, with_8bit  # noqa: E402

from quantize_eval import model_settings  # noqa: E402

from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, heldout_scenes  # noqa: E402
from onnxdiffusion.onnxio.files import load_backbone  # noqa: E402
from onnxdiffusion.quantize.gptq import input_hessians  # noqa: E402
from onnxdiffusion.quantize.runner import session  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402
from onnxdiffusion.runtime import backbone as rb  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=int, default=101)
    ap.add_argument("--variant", default="top36:float")
    ap.add_argument("--model", default=str(ROOT / "models" / "shapes-mmdit-onnx"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--gptq-steps", type=int, default=20)
    ap.add_argument("--heldout", type=int, default=0)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--high", default="", help="the variant the first steps run (default: fp32)")
    args = ap.parse_args()
    src, settings = model_settings(args.model)
    base, names = rotated_base(src)
    def hessians_of_calibration():
        calib = calibration(src, settings, args.work)
        return input_hessians(base, names, calib, calib.spread_steps(args.gptq_steps))

    hessians = npz_cache.arrays(args.work / f"hessians_{args.gptq_steps}.npz", hessians_of_calibration)
    sets = weight_sets(base, names, hessians, args.work, args.gptq_steps)
    wname, act = args.variant.split(":")
    quant = session(build(base, names, None if wname == "float" else with_8bit(sets, wname), act), 1)
    fp32 = session(load_backbone(src / REL), 1)
    high = session(build(base, names, with_8bit(sets, args.high.split(":")[0]), args.high.split(":")[1]), 1) if args.high else fp32
    state = {"high": set(), "step": 0, "latents": [], "high_session": fp32}
    original = rb.GuidedBackbone.__call__

    def call(self, x, t):
        state["latents"].append(np.array(x))
        b, part = self.batch, self.latent_part[1:]
        self.sample[(slice(0, b), *part)] = x
        if self.guided:
            self.sample[(slice(b, None), *part)] = x
        self.timestep.fill(t)
        sess = state["high_session"] if state["step"] in state["high"] else quant
        state["step"] += 1
        self.out[...] = sess.run([rb.OUT], {rb.SAMPLE: self.sample, rb.TIMESTEP: self.timestep, **self.conditioning})[0]
        if not self.guided:
            return self.out.copy()
        return rb.cfg_combine(self.out[:b], self.out[b:], self.guidance, rescale=self.rescale)

    rb.GuidedBackbone.__call__ = call
    pipe = Pipeline.from_folder(src, threads=1)
    opts = EvaluateOptions(count=1, steps=settings["steps"], sampler=settings["sampler"], guidance=settings["guidance"],
                           batch=1, seed_offset=args.pair)
    from onnxdiffusion.evaluate.run import generate_set

    def image(high):
        state.update(high=set(high), step=0, latents=[])
        return generate_set(pipe, heldout_scenes(opts), opts, progress=False)

    if args.heldout:
        return heldout(args, settings, src, pipe, state, high)
    n = settings["steps"]
    ref = image(range(n))
    ref_lat = state["latents"]
    whole = image(())
    lat = state["latents"]
    span = float(np.ptp(np.concatenate([v.ravel() for v in ref_lat])))
    res = {"pair": args.pair, "variant": args.variant, "gptq_steps": args.gptq_steps, "psnr": round(float(psnr(whole, ref)), 2),
           "latent_db_by_step": [round(float(10 * np.log10(span ** 2 / max(np.mean((a - b) ** 2), 1e-30))), 1)
                                 for a, b in zip(lat, ref_lat)]}
    res["first_k_fp32"] = {k: round(float(psnr(image(range(k)), ref)), 2) for k in (1, 2, 3, 4, 6, 8, 12)}
    res["last_k_fp32"] = {k: round(float(psnr(image(range(n - k, n)), ref)), 2) for k in (4, 8, 12, 16)}
    res["one_step_fp32"] = [round(float(psnr(image([s]), ref)), 2) for s in range(n)]
    rb.GuidedBackbone.__call__ = original
    print(json.dumps(res), flush=True)
    with open(args.work / "w4_steps.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    return 0


def heldout(args, settings, src, pipe, state, high) -> int:
    import time

    from quantize_eval import fp32_reference

    from onnxdiffusion.evaluate.judge import Judge
    from onnxdiffusion.evaluate.run import evaluate_images, generate_set

    opts = EvaluateOptions(count=args.heldout, steps=settings["steps"], sampler=settings["sampler"],
                           guidance=settings["guidance"], batch=32)
    scenes = heldout_scenes(opts)
    judge = Judge.from_file(threads=1)
    ref, ev0 = fp32_reference(src, scenes, opts, settings, args.work.parent / "quantize" / src.name, judge)
    t0 = time.time()
    images = []
    for i in range(0, len(scenes), opts.batch):  # the step counter restarts with each batch's trajectory
        state.update(high=set(range(args.first)), step=0, latents=[], high_session=high)
        part = EvaluateOptions(count=min(opts.batch, len(scenes) - i), steps=opts.steps, sampler=opts.sampler,
                               guidance=opts.guidance, batch=opts.batch, seed_offset=i)
        images.append(generate_set(pipe, heldout_scenes(part), part, progress=False))
    images = np.concatenate(images)
    ev = evaluate_images(images, scenes, judge)
    per = np.array([psnr(a, b) for a, b in zip(images, ref)])
    mse = ((images.astype(np.float64) - ref.astype(np.float64)) ** 2).mean()
    order = np.argsort(per)
    res = {"variant": args.variant, "first_steps": args.first, "high": args.high or "fp32", "gptq_steps": args.gptq_steps,
           "count": len(per), "mean": round(float(per[np.isfinite(per)].mean()), 2), "worst": round(float(per.min()), 2),
           "pooled": round(float(10 * np.log10(255 ** 2 / mse)), 2), "median": round(float(np.median(per)), 2),
           "under30": int((per < 30).sum()), "under35": int((per < 35).sum()),
           "worst5": [(int(i), round(float(per[i]), 2)) for i in order[:5]],
           "strict": ev["strict_accuracy"], "strict_fp32": ev0["strict_accuracy"], "seconds": round(time.time() - t0, 1)}
    print(json.dumps(res), flush=True)
    with open(args.work / "w4_heldout.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
