"""What sets a held-out pair's error under rotated W4A8 (issue 44, acceptance 2): the weights or the activations.

    python experiments/rotation/w4_pair_probe.py --pairs 101 --work DIR --variants w4:blocksym,w4:float,w8:blocksym
    python experiments/rotation/w4_pair_probe.py --pairs 101 --work DIR --variants w4:blocksym --leave-one act

The MMDiT's backbone as `w4a8 -O algorithm=gptq-clip -O symmetric=false` builds it (Gemms as MatMuls, every
MatMul's input group-Hadamard rotated, 64), each linear's weight replaced by the dequantized values of its
quantized form and its input by what the kernel computes with (fake quantization in float, one pair at a time,
batch 1: the per-pair PSNR of the 128-pair run). A variant is WEIGHTS:ACTIVATIONS:
- WEIGHTS: float | w4 (every linear gptq-clip 4-bit, asymmetric 32-blocks, Hessians of the rotated inputs at
  --gptq-steps of the 32 calibration prompts' 20) | top36 (w4 with the 36 linears of the issue's top36-8bit row 8-bit
  asymmetric min/max blocks, as `weights_8bit` gives them) | w8 (every linear 8-bit);
- ACTIVATIONS: float | blocksym (MatMulNBits accuracy_level 4: symmetric int8 per block of 32 along the input per
  token, scale max|x| / 127; matches ORT's kernel to 3e-5) | tokasym (per-token asymmetric uint8, dynamic-token-asym's
  codes) | centred (the per-token midpoint (max + min) / 2 subtracted, then blocksym, the midpoint's share added back
  exactly) | blockcent (each 32-block's own midpoint subtracted, then blocksym).
WEIGHTS may add `+GROUP` (w4_weight_probe.py's GROUPS, or a name substring: those linears 8-bit) and `@ALPHA` (the
weight error scaled: W + ALPHA (Q - W)). --leave-one act|weight: each variant again with each linear alone given
float activations (or float weights): the linears whose float twin lifts the pair most set it. --hessian-steps
I,J,...: the GPTQ Hessians from those calibration steps only (0: the noisiest); --bias-correct all|I,J,...: each
linear's mean output error E[x] (W - Q) subtracted. Environment: BS (32) the block size of weights and
activations; ACT_ORDER=1 GPTQ in act order (w4_weight_probe.py's gptq_act). Each row gives the 4-bit share of the
linears' MatMulNBits bytes.
Prints and appends one JSON line per pair and variant to WORK/w4_pairs.jsonl.
"""

from __future__ import annotations

import argparse
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
from onnx import helper, numpy_helper  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import npz_cache  # noqa: E402
from w4_weight_probe import gptq_act  # noqa: E402  (sets its own env defaults, as this script does)
from quantize_eval import RANKED_8BIT, model_settings  # noqa: E402
from w8_pair_probe import pair_images  # noqa: E402

from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.onnxio.files import load_backbone  # noqa: E402
from onnxdiffusion.quantize.gptq import gptq_blocks, input_hessians  # noqa: E402
from onnxdiffusion.quantize.graphs import initializer_map, prepare_unet, quantizable_nodes  # noqa: E402
from onnxdiffusion.quantize.opgroups import gemms_as_matmuls  # noqa: E402
from onnxdiffusion.quantize.rotation import rotate_linears  # noqa: E402
from onnxdiffusion.quantize.static_plan import _infer  # noqa: E402

REL = "transformer/model.onnx"
BS = int(os.environ.get("BS", "32"))  # the 4-bit blocks and MatMulNBits' activation blocks
ACT_ORDER = os.environ.get("ACT_ORDER") == "1"  # GPTQ in descending diag-H order, static groups (w4_weight_probe's gptq_act)


def rotated_base(src: Path) -> tuple[onnx.ModelProto, list[str]]:
    m = prepare_unet(load_backbone(src / REL))
    m, _ = gemms_as_matmuls(m, [q.name for q in quantizable_nodes(m, ("Gemm",))])
    m = _infer(m)
    m, _ = rotate_linears(m, [q.name for q in quantizable_nodes(m, ("MatMul",))], 64)
    m = _infer(m)
    return m, [q.name for q in quantizable_nodes(m, ("MatMul",)) if q.weight_size >= BS]


def calibration(src: Path, settings: dict, work: Path):
    from onnxdiffusion.quantize.calibration import capture, load_prompts
    from onnxdiffusion.quantize.configs_base import CalibrationConfig
    from onnxdiffusion.runtime import Pipeline

    def build():
        cfg = CalibrationConfig(count=32, sampler=settings["sampler"], steps=settings["steps"], guidance=settings["guidance"])
        prompts, _ = load_prompts(cfg)
        return capture(Pipeline.from_folder(src, provider="cpu", verify=False, threads=1), prompts, cfg)

    return npz_cache.calibration(work / "calib_32.npz", build)


def dequantized(q: np.ndarray, scales: np.ndarray, zps: np.ndarray, bs: int) -> np.ndarray:
    rows = np.arange(q.shape[0]) // bs
    return ((q - zps[rows]) * scales[rows]).astype(np.float32)


def minmax8(w: np.ndarray, bs: int) -> np.ndarray:
    """8-bit asymmetric min/max blocks (ORT's default weight-only quantizer at bits=8)."""
    k = w.shape[0]
    b = np.zeros((-(-k // bs) * bs, w.shape[1]), np.float64)
    b[:k] = w
    b = b.reshape(-1, bs, w.shape[1])
    lo, hi = np.minimum(b.min(axis=1, keepdims=True), 0), np.maximum(b.max(axis=1, keepdims=True), 0)
    scale = np.where(hi - lo == 0, 1.0, (hi - lo) / 255)
    zp = np.clip(np.round(-lo / scale), 0, 255)
    return ((np.clip(np.round(b / scale) + zp, 0, 255) - zp) * scale).reshape(-1, w.shape[1])[:k].astype(np.float32)


def weight_sets(base, names, hessians, work: Path, gptq_steps: int) -> dict[str, dict[str, np.ndarray]]:
    cached = work / f"deq_w4_h{gptq_steps}_b{BS}{'_act' if ACT_ORDER else ''}.npz"
    inits = initializer_map(base)
    nodes = {n.name: n for n in base.graph.node}
    w = {n: numpy_helper.to_array(inits[nodes[n].input[1]]) for n in names}
    w4 = npz_cache.arrays(cached, lambda: (
        {n: dequantized(*gptq_blocks(w[n], hessians[nodes[n].input[0]], BS, False), BS) for n in names} if not ACT_ORDER
        else {n: gptq_act(w[n], BS, hessians[nodes[n].input[0]]) for n in names}))
    w4 = {n: v.astype(np.float32) for n, v in w4.items()}
    w8 = {n: minmax8(w[n], BS) for n in names}
    top = set(RANKED_8BIT[:36])
    return {"float": w, "w4": w4, "w8": w8, "top36": {n: (w8[n] if n in top else w4[n]) for n in names}}


def with_8bit(sets: dict, spec: str) -> dict:
    """BASE[+GROUP-or-substring...]: BASE's weights with the linears of each group (w4_weight_probe's GROUPS) or
    whose name holds the substring 8-bit."""
    from w4_weight_probe import GROUPS

    spec, _, alpha = spec.partition("@")  # @ALPHA: the weights' error scaled by ALPHA (W + ALPHA (Q - W))
    first, *more = spec.split("+")
    subs = [x for g in more for x in (GROUPS.get(g) or (g,))]
    out = {n: (sets["w8"][n] if any(x in n for x in subs) else w) for n, w in sets[first].items()}
    if alpha:
        out = {n: (sets["float"][n] + float(alpha) * (q - sets["float"][n])).astype(np.float32) for n, q in out.items()}
    return out


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32), name))


def _blocksym(x: str, p: str, bs: int) -> list[onnx.NodeProto]:
    """x fake-quantized as MatMulNBits accuracy_level 4 quantizes it: int8, symmetric, per block of bs along the
    last axis; output p + '/bq'."""
    return [
        helper.make_node("Shape", [x], [p + "/shape"]),
        helper.make_node("Constant", [], [p + "/rs"], value=numpy_helper.from_array(np.array([-1, bs], np.int64))),
        helper.make_node("Reshape", [x, p + "/rs"], [p + "/b"]),
        helper.make_node("Abs", [p + "/b"], [p + "/abs"]),
        helper.make_node("ReduceMax", [p + "/abs"], [p + "/amax"], axes=[1], keepdims=1),
        _const(p + "/k", 1.0 / 127), _const(p + "/tiny", 1e-30),
        helper.make_node("Mul", [p + "/amax", p + "/k"], [p + "/s0"]),
        helper.make_node("Max", [p + "/s0", p + "/tiny"], [p + "/s"]),
        helper.make_node("Div", [p + "/b", p + "/s"], [p + "/d"]),
        helper.make_node("Round", [p + "/d"], [p + "/r"]),
        helper.make_node("Mul", [p + "/r", p + "/s"], [p + "/dq"]),
        helper.make_node("Reshape", [p + "/dq", p + "/shape"], [p + "/bq"]),
    ]


def _midpoint(x: str, p: str) -> list[onnx.NodeProto]:
    return [helper.make_node("ReduceMax", [x], [p + "/mx"], axes=[-1], keepdims=1),
            helper.make_node("ReduceMin", [x], [p + "/mn"], axes=[-1], keepdims=1),
            helper.make_node("Add", [p + "/mx", p + "/mn"], [p + "/sum"]), _const(p + "/half", 0.5),
            helper.make_node("Mul", [p + "/sum", p + "/half"], [p + "/c"])]


def fake_act(x: str, mode: str, bs: int = BS) -> tuple[list[onnx.NodeProto], str]:
    p = x + "/fq_" + mode
    if mode == "blocksym":
        return _blocksym(x, p, bs), p + "/bq"
    if mode == "centred":
        nodes = _midpoint(x, p) + [helper.make_node("Sub", [x, p + "/c"], [p + "/xc"])] + _blocksym(p + "/xc", p + "/q", bs)
        return nodes + [helper.make_node("Add", [p + "/q/bq", p + "/c"], [p + "/out"])], p + "/out"
    if mode == "blockcent":
        nodes = [helper.make_node("Shape", [x], [p + "/shape"]),
                 helper.make_node("Constant", [], [p + "/rs"], value=numpy_helper.from_array(np.array([-1, bs], np.int64))),
                 helper.make_node("Reshape", [x, p + "/rs"], [p + "/b"])]
        nodes += _midpoint(p + "/b", p) + [helper.make_node("Sub", [p + "/b", p + "/c"], [p + "/xc"])]
        nodes += _blocksym(p + "/xc", p + "/q", bs)
        return nodes + [helper.make_node("Add", [p + "/q/bq", p + "/c"], [p + "/o2"]),
                        helper.make_node("Reshape", [p + "/o2", p + "/shape"], [p + "/out"])], p + "/out"
    if mode == "tokasym":
        nodes = [helper.make_node("ReduceMax", [x], [p + "/mx0"], axes=[-1], keepdims=1),
                 helper.make_node("ReduceMin", [x], [p + "/mn0"], axes=[-1], keepdims=1), _const(p + "/zero", 0.0),
                 helper.make_node("Max", [p + "/mx0", p + "/zero"], [p + "/mx"]),
                 helper.make_node("Min", [p + "/mn0", p + "/zero"], [p + "/mn"]),
                 helper.make_node("Sub", [p + "/mx", p + "/mn"], [p + "/rng"]), _const(p + "/k", 1.0 / 255), _const(p + "/tiny", 1e-30),
                 helper.make_node("Mul", [p + "/rng", p + "/k"], [p + "/s0"]),
                 helper.make_node("Max", [p + "/s0", p + "/tiny"], [p + "/s"]),
                 helper.make_node("Div", [p + "/mn", p + "/s"], [p + "/mns"]),
                 helper.make_node("Neg", [p + "/mns"], [p + "/zr0"]),
                 helper.make_node("Round", [p + "/zr0"], [p + "/z"]),
                 helper.make_node("Div", [x, p + "/s"], [p + "/d"]),
                 helper.make_node("Round", [p + "/d"], [p + "/r"]),
                 helper.make_node("Add", [p + "/r", p + "/z"], [p + "/rz"]), _const(p + "/lo", 0.0), _const(p + "/hi", 255.0),
                 helper.make_node("Max", [p + "/rz", p + "/lo"], [p + "/c0"]),
                 helper.make_node("Min", [p + "/c0", p + "/hi"], [p + "/c1"]),
                 helper.make_node("Sub", [p + "/c1", p + "/z"], [p + "/cz"]),
                 helper.make_node("Mul", [p + "/cz", p + "/s"], [p + "/out"])]
        return nodes, p + "/out"
    raise SystemExit(f"unknown activation mode {mode}")


def build(base: onnx.ModelProto, names: list[str], weights: dict | None, act: str, float_act=(), float_w=(),
          bias: dict | None = None) -> onnx.ModelProto:
    """`base` with `names`' weights replaced (but float_w's), their inputs fake-quantized by `act` (but float_act's)
    and, with `bias`, each quantized linear's mean output error (name -> E[x] (W - Q)) subtracted after it."""
    m = onnx.ModelProto()
    m.CopyFrom(base)
    del m.graph.value_info[:]
    nodes = {n.name: n for n in m.graph.node}
    if weights is not None:
        by_init = {nodes[n].input[1]: weights[n] for n in names if n not in set(float_w)}
        for t in m.graph.initializer:
            if t.name in by_init:
                t.CopyFrom(numpy_helper.from_array(by_init[t.name], t.name))
    done: dict[str, str] = {}
    out = []
    for n in m.graph.node:
        if act != "float" and n.name in set(names) and n.name not in set(float_act):
            x = n.input[0]
            if x not in done:
                extra, done[x] = fake_act(x, act)
                out += extra
            n.input[0] = done[x]
        out.append(n)
        if bias and n.name in bias and n.name not in set(float_w):
            y = n.output[0]
            n.output[0] = y + "/uncorrected"
            out += [_const(y + "/bc", -bias[n.name]), helper.make_node("Add", [y + "/uncorrected", y + "/bc"], [y])]
    del m.graph.node[:]
    m.graph.node.extend(out)
    return m


def input_means(base, names, calib, steps) -> dict[str, np.ndarray]:
    from onnxdiffusion.quantize.graphs import with_outputs
    from onnxdiffusion.quantize.runner import session

    nodes = {n.name: n for n in base.graph.node}
    tensors = sorted({nodes[n].input[0] for n in names})
    sess = session(with_outputs(base, tensors, only=True), 1)
    sums, count = {}, dict.fromkeys(tensors, 0)
    for _, feed in calib.feeds(steps):
        for t, x in zip(tensors, sess.run(tensors, feed)):
            x = x.reshape(-1, x.shape[-1]).astype(np.float64)
            sums[t] = sums.get(t, 0) + x.sum(0)
            count[t] += len(x)
    return {t: sums[t] / count[t] for t in tensors}


def hessians_at(base, names, calib, args) -> tuple[dict, str]:
    """The inputs' Hessians at --gptq-steps spread steps, or at the --hessian-steps listed (0 = the noisiest)."""
    steps = [int(x) for x in args.hessian_steps.split(",")] if args.hessian_steps else calib.spread_steps(args.gptq_steps)
    tag = ("s" + "_".join(map(str, steps))) if args.hessian_steps else str(args.gptq_steps)
    return npz_cache.arrays(args.work / f"hessians_{tag}.npz", lambda: input_hessians(base, names, calib, steps)), tag


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, nargs="+", default=[101])
    ap.add_argument("--variants", default="top36:blocksym,top36:float,w8:blocksym")
    ap.add_argument("--model", default=str(ROOT / "models" / "shapes-mmdit-onnx"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--gptq-steps", type=int, default=8)
    ap.add_argument("--hessian-steps", default="", help="comma-separated calibration step indices (0: the noisiest)")
    ap.add_argument("--bias-correct", default="", help="each 4-/8-bit linear's mean output error E[x] (W - Q) subtracted, "
                    "E[x] over these calibration steps ('all' or indices)")
    ap.add_argument("--leave-one", choices=("act", "weight"))
    args = ap.parse_args()
    src, settings = model_settings(args.model)
    args.work.mkdir(parents=True, exist_ok=True)
    base, names = rotated_base(src)
    calib = calibration(src, settings, args.work)
    hessians, tag = hessians_at(base, names, calib, args)
    sets = weight_sets(base, names, hessians, args.work, tag)
    out = args.work / "pair_probe_folder"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)

    def image(model: onnx.ModelProto, pair: int):
        return pair_images(out, model, pair, settings)

    def record(res: dict) -> None:
        print(json.dumps(res), flush=True)
        with open(args.work / "w4_pairs.jsonl", "a") as f:
            f.write(json.dumps(res) + "\n")

    fp32 = load_backbone(src / REL)
    inits, nodes = initializer_map(base), {n.name: n for n in base.graph.node}
    if args.bias_correct:
        bsteps = list(range(calib.num_steps)) if args.bias_correct == "all" else [int(x) for x in args.bias_correct.split(",")]
        means = input_means(base, names, calib, bsteps)
    for pair in args.pairs:
        ref = image(fp32, pair)
        for variant in args.variants.split(","):
            wname, act = variant.split(":")
            weights = None if wname == "float" else with_8bit(sets, wname)
            bias = None
            if args.bias_correct and weights is not None:
                w = {n: numpy_helper.to_array(inits[nodes[n].input[1]]) for n in names}
                bias = {n: (means[nodes[n].input[0]] @ (weights[n] - w[n])).astype(np.float32) for n in names}
            t0 = time.time()
            res = {"pair": pair, "variant": variant, "gptq_steps": args.gptq_steps, "hessian_steps": args.hessian_steps, "bs": BS, "act_order": ACT_ORDER,
                   "bias_correct": args.bias_correct,
                   "psnr": round(float(psnr(image(build(base, names, weights, act, bias=bias), pair), ref)), 2)}
            if args.leave_one:
                lifted = {}
                for n in names:
                    fa, fw = ([n], ()) if args.leave_one == "act" else ((), [n])
                    lifted[n] = round(float(psnr(image(build(base, names, weights, act, fa, fw), pair), ref)), 2)
                res["leave_one"] = args.leave_one
                res["float_one"] = dict(sorted(lifted.items(), key=lambda kv: -kv[1]))
            if weights is not None:  # the 4-bit linears' share of all the linears' MatMulNBits bytes
                from w4_weight_probe import nbits_bytes

                eight = [n for n in names if weights[n] is not None and np.array_equal(weights[n], sets["w8"][n])]
                b = {n: nbits_bytes(sets["float"][n], BS, 8 if n in eight else 4) for n in names}
                res["n8"] = len(eight)
                res["frac4_bytes"] = round(sum(v for n, v in b.items() if n not in eight) / sum(b.values()), 4)
            res["seconds"] = round(time.time() - t0, 1)
            record(res)
    shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
