"""Is FP8 activation saturation behind the MMDiT's fp8 shortfall? Held-out activation ranges vs the calibrated ones,
and held-out image PSNR with the calibrated FP8 scales widened by a headroom factor (E4M3 is floating point: a wider
scale costs almost no precision, so if clipping hurt, headroom would show it).

    .venv/bin/python experiments/lowbit/lowbit_fp8_headroom.py [--model models/shapes-mmdit-onnx] [--count 48]

Calibration as the fp8 recipe's (32 calib-split prompts, seeds 10000+, the model's recommended settings); images
from fp8 QDQ graphs on ONNX Runtime's CPU provider; prints the result (quoted in experiments/lowbit/lowbit.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("lowbit_sensitivity", HERE / "lowbit_sensitivity.py")
ls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ls)  # its imports (paths, environment) and helpers

from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, generate_set, heldout_scenes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ls.ROOT / "models" / "shapes-mmdit-onnx")
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--headroom", type=float, nargs="+", default=[1.0, 4.0])
    args = ap.parse_args(argv)
    man = ls.read_manifest(args.model)
    rec = man.get("recommended") or {}
    sampler, steps, guidance = rec.get("sampler", "ddim"), int(rec.get("steps", 20)), float(rec.get("guidance", 4.0))
    backbone = ls.get_family(man.get("family")).backbone
    cfg = ls.CalibrationConfig(count=32, steps=steps, sampler=sampler, guidance=guidance)
    pipe = ls.Pipeline.from_folder(args.model, threads=1)
    calib = ls.capture(pipe, ls.load_prompts(cfg)[0], cfg)
    model = ls.prepare_unet(onnx.load(str(args.model / man["components"][backbone]["path"])))
    recipe = ls.recipe_class("fp8").with_options({})
    nodes = [q.name for q in ls.quantizable_nodes(model, recipe.op_types, recipe.keep_float)]
    by = {n.name: n for n in model.graph.node}
    tensors = list(dict.fromkeys(by[n].input[0] for n in nodes))
    ranges = ls.step_ranges(model, tensors, calib, 1).aggregate(None, "max")
    opts = EvaluateOptions(count=args.count, steps=steps, sampler=sampler, guidance=guidance, batch=args.count)
    scenes = heldout_scenes(opts)
    ref = generate_set(pipe, scenes, opts, progress=False)
    held = ls.capture(pipe, [s.caption for s in scenes[:16]], ls.CalibrationConfig(count=16, steps=steps, sampler=sampler,
                                                                                    guidance=guidance))
    hr = ls.step_ranges(model, tensors, held, 1).aggregate(None, "max")

    def amax(r, t):
        return max(abs(r[t][0]), abs(r[t][1]))

    over = sorted(((amax(hr, t) / amax(ranges, t), t) for t in tensors), reverse=True)[:5]
    print("held-out amax / calibrated amax, largest:", [(round(a, 3), t) for a, t in over], flush=True)
    for h in args.headroom:
        wide = {t: (lo * h, hi * h) for t, (lo, hi) in ranges.items()}
        pipe.backbone = ls.session(ls.fp8_graph(model, nodes, wide, recipe.opset), 1)
        v = [psnr(a, b) for a, b in zip(generate_set(pipe, scenes, opts, progress=False), ref)]
        finite = [x for x in v if math.isfinite(x)]
        print(f"headroom {h}: mean {np.mean(finite):.2f} dB, median {np.median(v):.2f}, worst {np.min(v):.2f}, "
              f"lowest six {[round(x, 1) for x in sorted(v)[:6]]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
