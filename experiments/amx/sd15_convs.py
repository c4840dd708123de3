#!/usr/bin/env python
"""Every convolution of the full-size SD1.5 UNet at the bench shape, as today's QLinearConv and laid out for AMX.

For each Conv of the fp32 UNet graph (shapes from ORT's symbolic shape inference at batch 2, 256x256 ->
32x32 latents; the weights' own shapes), one single-node QLinearConv graph with random int8 weights is
timed at 1 thread both ways: constant input zero point (ORT's symmetric conv kernel: what int8-static
stores today) and run-time zero point (im2col + QGEMM, what -O kernels=amx writes). Interleaved rounds,
process CPU time, median per conv; the sums are the convolution part of one backbone call at full size.

    python experiments/amx/sd15_convs.py $WORK/onnx256/unet/model.onnx --out experiments/amx/results/sd15_convs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.bench.machine import machine_facts  # noqa: E402


def conv_shapes(path: Path, batch: int, latent: int) -> list[dict]:
    from onnx.external_data_helper import uses_external_data
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model = onnx.load(str(path), load_external_data=False)
    for t in [t for t in model.graph.initializer if uses_external_data(t)]:  # shapes only, never values
        model.graph.initializer.remove(t)
        model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    fixed = {"sample": [batch, 4, latent, latent], "timestep": [batch], "encoder_hidden_states": [batch, 77, 768]}
    for inp in model.graph.input:
        if inp.name in fixed:
            for d, v in zip(inp.type.tensor_type.shape.dim, fixed[inp.name]):
                d.Clear()
                d.dim_value = v
    inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=False)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in list(inferred.graph.value_info) + list(inferred.graph.input)}
    inits = {t.name: list(t.dims) for t in inferred.graph.initializer}
    out = []
    for node in inferred.graph.node:
        if node.op_type != "Conv":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        w = shapes.get(node.input[1]) or inits.get(node.input[1])
        out.append({"name": node.name, "x": shapes[node.input[0]], "w": w, "pads": list(attrs.get("pads", [0, 0, 0, 0])),
                    "strides": list(attrs.get("strides", [1, 1])), "group": int(attrs.get("group", 1))})
    return out


def qconv_model(c: dict, runtime_zp: bool) -> bytes:
    rng = np.random.default_rng(0)
    o, ci, kh, kw = c["w"]
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (np.float32(0.02), "xs"), (rng.integers(-127, 128, c["w"], dtype=np.int8), "w"), (np.full(o, 0.01, np.float32), "ws"),
        (np.zeros(o, np.int8), "wzp"), (np.float32(0.05), "ys"), (np.uint8(128), "yzp"),
        (rng.integers(-999, 999, o).astype(np.int32), "b")]]
    nodes = []
    if runtime_zp:  # the lowering's chain: Shape of the symbolic batch dim, * 0 + zp, as uint8
        inits += [numpy_helper.from_array(np.array([0], np.int64), "c0"), numpy_helper.from_array(np.array([128], np.int64), "zp64")]
        nodes += [helper.make_node("Shape", ["x"], ["s"], start=0, end=1), helper.make_node("Mul", ["s", "c0"], ["z"]),
                  helper.make_node("Add", ["z", "zp64"], ["zi"]), helper.make_node("Cast", ["zi"], ["xzp"], to=TP.UINT8)]
    else:
        inits.append(numpy_helper.from_array(np.uint8(128), "xzp"))
    nodes.append(helper.make_node("QLinearConv", ["x", "xs", "xzp", "w", "ws", "wzp", "ys", "yzp", "b"], ["y"],
                                  kernel_shape=[kh, kw], pads=c["pads"], strides=c["strides"], group=c["group"]))
    g = helper.make_graph(nodes, "c", [helper.make_tensor_value_info("x", TP.UINT8, ["N", *c["x"][1:]])],
                          [helper.make_tensor_value_info("y", TP.UINT8, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("unet", type=Path, help="the fp32 UNet graph (its external data is not read)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--latent", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    convs = conv_shapes(args.unet, args.batch, args.latent)
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.inter_op_num_threads = 1
    o.log_severity_level = 3
    sessions = [{k: ort.InferenceSession(qconv_model(c, k == "gemm"), o, providers=["CPUExecutionProvider"])
                 for k in ("sym", "gemm")} for c in convs]
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.integers(0, 256, c["x"], dtype=np.uint8)} for c in convs]
    times = [{"sym": [], "gemm": []} for _ in convs]
    for s, f in zip(sessions, feeds):
        for k in s:
            s[k].run(None, f)
    for r in range(args.rounds):
        for i, (s, f) in enumerate(zip(sessions, feeds)):
            for k in (("sym", "gemm") if r % 2 == 0 else ("gemm", "sym")):
                c0 = time.process_time()
                s[k].run(None, f)
                times[i][k].append(time.process_time() - c0)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    rows = []
    for c, t in zip(convs, times):
        n, ci, h, w = c["x"]
        o_, _, kh, kw = c["w"]
        oh = (h + c["pads"][0] + c["pads"][2] - kh) // c["strides"][0] + 1
        ow = (w + c["pads"][1] + c["pads"][3] - kw) // c["strides"][1] + 1
        gop = 2 * n * oh * ow * o_ * (ci // c["group"]) * kh * kw / 1e9
        sym, gemm = statistics.median(t["sym"]), statistics.median(t["gemm"])
        rows.append({**c, "gop": gop, "sym_s": sym, "gemm_s": gemm})
    tot = {k: sum(r[f"{k}_s"] for r in rows) for k in ("sym", "gemm")}
    gop = sum(r["gop"] for r in rows)
    res = {"machine": machine_facts(), "batch": args.batch, "latent": args.latent, "rounds": args.rounds, "convs": len(rows),
           "gop": gop, "sym_total_s": tot["sym"], "gemm_total_s": tot["gemm"], "speedup": tot["sym"] / tot["gemm"],
           "sym_gops": gop / tot["sym"], "gemm_gops": gop / tot["gemm"], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{len(rows)} convs, {gop:.1f} GOP: today's QLinearConv {tot['sym']:.3f} s ({gop / tot['sym']:.0f} GOP/s), "
          f"laid out for AMX {tot['gemm']:.3f} s ({gop / tot['gemm']:.0f} GOP/s): {tot['sym'] / tot['gemm']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
