"""Which linears set a held-out pair's error under rotated W8A8 with per-token activations (issue 44, acceptance 1).

    python experiments/rotation/w8_pair_probe.py --pairs 73 --mode dynz-gptq --work DIR [--leave-one-float]

The MMDiT's weight linears rotated (group 64, the patch conv float) and rewritten as dynamic_token_probe.py's MODE
builds them (dynz: per-token asym codes, int8 weights to nearest; dynz-gptq: GPTQ weights, Hessians of the rotated
float inputs from quantize's 32-prompt calibration trajectories, cached in WORK). For each pair (held-out prompt i,
seed i, the model's recommended settings): the image PSNR vs fp32 of the whole rewrite, then (--leave-one-float)
the same with each linear alone left float: the linears whose float twin lifts the pair most are the ones that
set it. Prints and appends one JSON line per pair to WORK/pairs.jsonl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dynamic_token_probe import PATCH_CONV, hessians_of, weights_only  # noqa: E402  (sets the env and paths)

import onnx  # noqa: E402
from quantize_eval import generate, model_settings  # noqa: E402

from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, heldout_scenes  # noqa: E402
from onnxdiffusion.onnxio.files import load_backbone  # noqa: E402
from onnxdiffusion.quantize.dynamic_token import dynamic_token_linears  # noqa: E402
from onnxdiffusion.quantize.graphs import quantizable_nodes  # noqa: E402
from onnxdiffusion.quantize.rotation import rotate_linears  # noqa: E402

REL = "transformer/model.onnx"


def pair_images(out: Path, model: onnx.ModelProto, pair: int, settings: dict):
    """Held-out pair `pair`'s images (batch 1) with `model` as the backbone of the copied folder `out` (its manifest's
    hash of the backbone file updated to match)."""
    onnx.save(model, str(out / REL))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][REL] = hashlib.sha256((out / REL).read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    opts = EvaluateOptions(count=1, steps=settings["steps"], sampler=settings["sampler"],
                           guidance=settings["guidance"], batch=1, seed_offset=pair)
    return generate(out, heldout_scenes(opts), opts)


def build(rotated: onnx.ModelProto, linears: list[str], mode: str, hessians) -> onnx.ModelProto:
    if mode.startswith("wonly"):
        m = onnx.ModelProto()
        m.CopyFrom(rotated)
        return weights_only(m, linears, hessians)
    return dynamic_token_linears(rotated, linears, zero_point=mode.startswith("dynz"), hessians=hessians)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, nargs="+", default=[73])
    ap.add_argument("--mode", choices=("dynz", "dynz-gptq", "wonly", "wonly-gptq"), default="dynz-gptq")
    ap.add_argument("--model", default=str(ROOT / "models" / "shapes-mmdit-onnx"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--calib-count", type=int, default=32)
    ap.add_argument("--gptq-steps", type=int, default=20)
    ap.add_argument("--leave-one-float", action="store_true")
    args = ap.parse_args()
    src, settings = model_settings(args.model)
    args.work.mkdir(parents=True, exist_ok=True)
    m = load_backbone(src / REL)
    linears = [q.name for q in quantizable_nodes(m, ("MatMul", "Gemm"), (PATCH_CONV,))]
    rotated, _ = rotate_linears(m, linears, 64)
    hessians = hessians_of(rotated, linears, src, settings, args) if args.mode.endswith("-gptq") else None
    out = args.work / f"pair_{args.mode}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)

    def images_with(model: onnx.ModelProto, pair: int):
        return pair_images(out, model, pair, settings)

    for pair in args.pairs:
        t0 = time.time()
        ref = images_with(m, pair)
        whole = psnr(images_with(build(rotated, linears, args.mode, hessians), pair), ref)
        res = {"pair": pair, "mode": args.mode, "psnr": round(float(whole), 2)}
        if args.leave_one_float:
            lifted = {}
            for name in linears:
                rest = [n for n in linears if n != name]
                lifted[name] = round(float(psnr(images_with(build(rotated, rest, args.mode, hessians), pair), ref)), 2)
            res["float_one"] = dict(sorted(lifted.items(), key=lambda kv: -kv[1]))
        res["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(res), flush=True)
        with open(args.work / "pairs.jsonl", "a") as f:
            f.write(json.dumps(res) + "\n")
    shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
