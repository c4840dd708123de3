"""Per-token dynamic activations vs the weights' share of the error, on the 128 held-out pairs (issue 44).

    python experiments/rotation/dynamic_token_probe.py LABEL --mode dyn|dynz|wonly|wonly-gptq|dynz-gptq [--rotate 64|0] --work DIR

No calibration: the fp32 MMDiT's backbone, every weight MatMul / Gemm (the patch-embedding conv float),
optionally Hadamard-rotated (group 64), then
- dyn: per-token dynamic int8 activations, int8 per-channel weights (what `-O activations=dynamic-token`
  builds, quantize/dynamic_token.py; the recipe's own row is quantize_eval.py's);
- dynz: the same with a per-token zero point (uint8 codes);
- wonly: the int8 per-channel weights alone (dequantized into float), activations float: the weight side's
  share of the error, which no activation scheme can remove;
- aonly-asym: dynz's per-token activation codes alone (dequantized in float), weights float;
- wonly-gptq / dynz-gptq / dyn-gptq: wonly / dynz / dyn with the int8 weights rounded by GPTQ (what `-O weights=gptq`
  builds: quantize/gptq.py's int8_channels, Hessians of the rotated float inputs at all 20 steps (--gptq-steps) of
  --calib-count calibration prompts' fp32 trajectories, captured as `quantize` does, seeds 10000 + i).
Images vs the fp32 folder's at its recommended settings (quantize_eval.py's generate / fp32 cache /
PSNR / judge); appends one line to WORK/results.jsonl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "experiments" / "quantize-embedded"))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from quantize_eval import fp32_reference, generate, model_settings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import npz_cache  # noqa: E402

from onnxdiffusion.evaluate.judge import Judge  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_images, heldout_scenes  # noqa: E402
from onnxdiffusion.onnxio.files import load_backbone  # noqa: E402
from onnxdiffusion.quantize.dynamic_token import dynamic_token_linears, weight_quantize  # noqa: E402
from onnxdiffusion.quantize.gptq import input_hessians, int8_channels  # noqa: E402
from onnxdiffusion.quantize.graphs import initializer_map, quantizable_nodes  # noqa: E402
from onnxdiffusion.quantize.rotation import rotate_linears  # noqa: E402

PATCH_CONV = "/model/pos_embed/proj/Conv"


def weights_only(m: onnx.ModelProto, linears: list[str], hessians: dict | None = None) -> onnx.ModelProto:
    inits = initializer_map(m)
    for n in m.graph.node:
        if n.name in set(linears):
            t = inits[n.input[1]]
            w = numpy_helper.to_array(t)
            trans = n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute)
            w = w.T if trans else w
            q, s = weight_quantize(w) if hessians is None else int8_channels(w, hessians[n.input[0]])
            wd = q.astype(np.float32) * s  # a Gemm's alpha is 1 in the MMDiT's graph
            t.CopyFrom(numpy_helper.from_array((wd.T if trans else wd).astype(np.float32), t.name))
    return m


def activations_only(m: onnx.ModelProto, linears: list[str]) -> onnx.ModelProto:
    """Each linear's input fake-quantized per token with a zero point (dynamic-token-asym's codes, dequantized
    in float), the float weights kept: the activation side's share of the error."""
    from onnx import helper

    from onnxdiffusion.quantize.dynamic_token import _token_nodes_asym

    done: dict[str, str] = {}
    nodes = []
    for n in m.graph.node:
        if n.name in set(linears) and n.input[0] not in done:
            x = n.input[0]
            q_nodes, codes, scale, zp = _token_nodes_asym(x)
            p = x + "/fake"
            nodes += q_nodes + [
                helper.make_node("Cast", [codes], [p + "/codesf"], to=onnx.TensorProto.FLOAT),
                helper.make_node("Sub", [p + "/codesf", zp], [p + "/centred"]),
                helper.make_node("Mul", [p + "/centred", scale], [p + "/deq"])]
            done[x] = p + "/deq"
        if n.name in set(linears):
            n.input[0] = done[n.input[0]]
        nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def hessians_of(m: onnx.ModelProto, linears: list[str], src: Path, settings: dict, args) -> dict:
    """quantize's calibration trajectories (cached in WORK) through the (rotated) float graph: each input's E[x^T x]."""
    from onnxdiffusion.quantize.calibration import capture, load_prompts
    from onnxdiffusion.quantize.configs_base import CalibrationConfig
    from onnxdiffusion.runtime import Pipeline

    cfg = CalibrationConfig(count=args.calib_count, sampler=settings["sampler"], steps=settings["steps"],
                            guidance=settings["guidance"])
    calib = npz_cache.calibration(args.work / f"calib_{args.calib_count}.npz", lambda: capture(
        Pipeline.from_folder(src, provider="cpu", verify=False, threads=1), load_prompts(cfg)[0], cfg))
    return input_hessians(m, linears, calib, calib.spread_steps(args.gptq_steps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label")
    ap.add_argument("--mode", choices=("dyn", "dynz", "wonly", "aonly-asym", "wonly-gptq", "dynz-gptq", "dyn-gptq"), default="dyn")
    ap.add_argument("--calib-count", type=int, default=32, help="calibration prompts for the GPTQ Hessians")
    ap.add_argument("--gptq-steps", type=int, default=20)
    ap.add_argument("--rotate", type=int, default=64, help="Hadamard group (0: none)")
    ap.add_argument("--model", default=str(ROOT / "models" / "shapes-mmdit-onnx"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--count", type=int, default=128)
    args = ap.parse_args()
    src, settings = model_settings(args.model)
    out = args.work / args.label
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    rel = "transformer/model.onnx"
    m = load_backbone(src / rel)
    linears = [q.name for q in quantizable_nodes(m, ("MatMul", "Gemm"), (PATCH_CONV,))]
    if args.rotate:
        m, _ = rotate_linears(m, linears, args.rotate)
    hessians = hessians_of(m, linears, src, settings, args) if args.mode.endswith("-gptq") else None
    mode = args.mode.removesuffix("-gptq")
    if mode == "wonly":
        m = weights_only(m, linears, hessians)
    elif mode == "aonly-asym":
        m = activations_only(m, linears)
    else:
        m, _ = dynamic_token_linears(m, linears, zero_point=mode == "dynz", hessians=hessians)
    onnx.save(m, str(out / rel))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][rel] = hashlib.sha256((out / rel).read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    opts = EvaluateOptions(count=args.count, steps=settings["steps"], sampler=settings["sampler"],
                           guidance=settings["guidance"], batch=32)
    scenes = heldout_scenes(opts)
    judge = Judge.from_file(threads=1)
    t0 = time.time()
    ref, ev0 = fp32_reference(src, scenes, opts, settings, args.work, judge)
    images = generate(out, scenes, opts)
    ev = evaluate_images(images, scenes, judge)
    per = np.array([psnr(a, b) for a, b in zip(images, ref)])
    order = np.argsort(per)
    res = {"label": args.label, "mode": args.mode, "rotate": args.rotate, "mean": float(np.mean(per[np.isfinite(per)])),
           "worst": float(per.min()), "median": float(np.median(per)), "under35": int((per < 35).sum()),
           "worst5": [(int(i), round(float(per[i]), 2)) for i in order[:5]], "strict": ev["strict_accuracy"],
           "strict_fp32": ev0["strict_accuracy"], "seconds": round(time.time() - t0, 1)}
    if hessians is not None:
        res.update(gptq_steps=args.gptq_steps, calib_count=args.calib_count)
    print(json.dumps(res))
    with open(args.work / "results.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
