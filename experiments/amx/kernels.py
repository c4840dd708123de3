#!/usr/bin/env python
"""Which ONNX Runtime CPU kernels reach the matrix units: int8/fp32/bf16 ops at SD1.5-UNet shapes, 1 thread.

Every case is a one-op (or short-chain) ONNX graph timed in this process with ONE intra-op thread; the
figure is process CPU time (steady on a shared machine), best of the repeats, as GOP/s = 2*M*N*K / s.
A rate well past what the AVX-512 VNNI units can do at one core (roughly 0.7-0.9 TOP/s here) means
MLAS ran its AMX kernel (QgemmU8S8KernelAmx); the source reading is in README.md.

  conv cases  (batch 2, SD1.5 at 256x256: 32x32 latents) 3x3 and 1x1 convolutions
      fp32-conv              Conv float (ORT_ENABLE_ALL: NCHWc)
      qlinearconv            QLinearConv, constant zero points (MLAS's symmetric conv: VNNI, no AMX)
      qlinearconv-runtime-zp QLinearConv whose input zero point is computed at run time: ORT skips the
                             symmetric packing and runs im2col + MlasGemm (QGEMM)
      convinteger            ConvInteger + Cast + Mul (float out)
      im2col-graph           Pad + 9 Slice + Concat (NHWC u8) + MatMulIntegerToFloat: im2col as ONNX ops
      shifted-9              9 shifted slices, 9 MatMulInteger, int32 Sum
  gemm cases  (A [M,K] activations, B [K,N] constant weights; also the im2col shape of the 3x3 conv)
      fp32-matmul, matmulinteger, matmulintegertofloat, qlinearmatmul, qgemm (u8 out), dynamicquantizematmul,
      bf16-matmul (whether ORT CPU has a bf16 MatMul at all)
  attention core  QK^T and AV, [16 heads, 1024, 40]: fp32 MatMul vs MatMulInteger on two activations

    python experiments/amx/kernels.py --out experiments/amx/results/kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from onnxdiffusion.bench.machine import machine_facts  # noqa: E402

U8, S8, F, I32 = TP.UINT8, TP.INT8, TP.FLOAT, TP.INT32
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits, ms=False):
    g = helper.make_graph(nodes, "k", inputs, outputs, inits)
    ops = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = 8
    return m.SerializeToString()


def _vi(name, t, shape):
    return helper.make_tensor_value_info(name, t, shape)


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _session(model: bytes):
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.inter_op_num_threads = 1
    o.log_severity_level = 3
    return ort.InferenceSession(model, o, providers=["CPUExecutionProvider"])


def _time(sess, feed, min_s=0.4, max_reps=12):
    sess.run(None, feed)
    best, total, reps = float("inf"), 0.0, 0
    while reps < 3 or (total < min_s and reps < max_reps):
        c = time.process_time()
        sess.run(None, feed)
        d = time.process_time() - c
        best, total, reps = min(best, d), total + d, reps + 1
    return best


# --- conv cases -------------------------------------------------------------------------------------------
def conv_models(n, c, h, w, o, k):
    x_zp, pad = 128, k // 2
    wq = RNG.integers(-127, 128, (o, c, k, k), dtype=np.int8)
    ws = np.full(o, 0.01, np.float32)
    bias = RNG.integers(-1000, 1000, o).astype(np.int32)
    common = [_init("xs", np.float32(0.02)), _init("w", wq), _init("ws", ws), _init("wzp", np.zeros(o, np.int8)),
              _init("ys", np.float32(0.05)), _init("yzp", np.uint8(128)), _init("b", bias)]
    xin, yout = _vi("x", U8, ["N", c, h, w]), _vi("y", U8, None)
    attrs = dict(kernel_shape=[k, k], pads=[pad] * 4)
    models = {}
    models["fp32-conv"] = _model([helper.make_node("Conv", ["xf", "wf", "bf"], ["y"], **attrs)],
                                 [_vi("xf", F, ["N", c, h, w])], [_vi("y", F, None)],
                                 [_init("wf", wq.astype(np.float32) * 0.01), _init("bf", bias.astype(np.float32))])
    models["qlinearconv"] = _model(
        [helper.make_node("QLinearConv", ["x", "xs", "xzp", "w", "ws", "wzp", "ys", "yzp", "b"], ["y"], **attrs)],
        [xin], [yout], common + [_init("xzp", np.uint8(x_zp))])
    # the input zero point from Shape(x)[0] * 0 + zp: not a constant initializer, so ORT's PrePack cannot take
    # the symmetric-conv path and the kernel runs im2col + MlasGemm
    zp_nodes = [helper.make_node("Shape", ["x"], ["shp"], start=0, end=1),
                helper.make_node("Mul", ["shp", "zero64"], ["z0"]),
                helper.make_node("Add", ["z0", "zp64"], ["z1"]),
                helper.make_node("Cast", ["z1"], ["xzp_rt"], to=U8)]
    zp_inits = [_init("zero64", np.array([0], np.int64)), _init("zp64", np.array([x_zp], np.int64))]
    models["qlinearconv-runtime-zp"] = _model(
        zp_nodes + [helper.make_node("QLinearConv", ["x", "xs", "xzp_rt", "w", "ws", "wzp", "ys", "yzp", "b"], ["y"], **attrs)],
        [xin], [yout], common + zp_inits)
    models["convinteger"] = _model(
        [helper.make_node("ConvInteger", ["x", "w", "xzp"], ["acc"], **attrs),
         helper.make_node("Cast", ["acc"], ["accf"], to=F), helper.make_node("Mul", ["accf", "sc"], ["y"])],
        [xin], [_vi("y", F, None)], [_init("w", wq), _init("xzp", np.uint8(x_zp)),
                                     _init("sc", (ws * 0.02).reshape(1, o, 1, 1))])
    # im2col as ONNX ops on an NHWC activation, then one integer GEMM with K = k*k*C
    b2 = wq.transpose(2, 3, 1, 0).reshape(k * k * c, o)  # (kh, kw, c) x o, matching the concat order
    if k == 1:
        col_nodes, col = [], "xn"
    else:
        col_nodes = [helper.make_node("Pad", ["xn", "pads", "padv"], ["xp"])]
        slices = []
        for dy in range(k):
            for dx in range(k):
                nm = f"s{dy}{dx}"
                col_nodes.append(helper.make_node("Slice", ["xp", f"st{dy}{dx}", f"en{dy}{dx}", "ax"], [nm]))
                slices.append(nm)
        col_nodes.append(helper.make_node("Concat", slices, ["col"], axis=3))
        col = "col"
    col_inits = [_init("pads", np.array([0, pad, pad, 0, 0, pad, pad, 0], np.int64)), _init("padv", np.uint8(x_zp)),
                 _init("ax", np.array([1, 2], np.int64))]
    col_inits += [_init(f"st{dy}{dx}", np.array([dy, dx], np.int64)) for dy in range(k) for dx in range(k)]
    col_inits += [_init(f"en{dy}{dx}", np.array([dy + h, dx + w], np.int64)) for dy in range(k) for dx in range(k)]
    models["im2col-graph"] = _model(
        col_nodes + [helper.make_node("MatMulIntegerToFloat", [col, "b2", "xs", "bsc", "xzp"], ["y"], domain="com.microsoft")],
        [_vi("xn", U8, ["N", h, w, c])], [_vi("y", F, None)],
        col_inits + [_init("b2", b2), _init("xs", np.float32(0.02)), _init("bsc", ws), _init("xzp", np.uint8(x_zp))], ms=True)
    if k == 3:
        nodes, outs = [helper.make_node("Pad", ["xn", "pads", "padv"], ["xp"])], []
        for dy in range(3):
            for dx in range(3):
                nodes.append(helper.make_node("Slice", ["xp", f"st{dy}{dx}", f"en{dy}{dx}", "ax"], [f"s{dy}{dx}"]))
                nodes.append(helper.make_node("MatMulInteger", [f"s{dy}{dx}", f"b{dy}{dx}", "xzp"], [f"p{dy}{dx}"]))
                outs.append(f"p{dy}{dx}")
        acc = outs[0]  # Sum has no int32 kernel: a chain of Adds
        for i, o in enumerate(outs[1:]):
            nodes.append(helper.make_node("Add", [acc, o], ["y" if i == len(outs) - 2 else f"acc{i}"]))
            acc = f"acc{i}"
        inits = col_inits + [_init("xzp", np.uint8(x_zp))]
        inits += [_init(f"b{dy}{dx}", np.ascontiguousarray(wq[:, :, dy, dx].T)) for dy in range(3) for dx in range(3)]
        models["shifted-9"] = _model(nodes, [_vi("xn", U8, ["N", h, w, c])], [_vi("y", I32, None)], inits)
    x = RNG.integers(0, 256, (n, c, h, w), dtype=np.uint8)
    feeds = {"fp32-conv": {"xf": (x.astype(np.float32) - x_zp) * 0.02}, "im2col-graph": {"xn": x.transpose(0, 2, 3, 1).copy()},
             "shifted-9": {"xn": x.transpose(0, 2, 3, 1).copy()}}
    return models, {name: feeds.get(name, {"x": x}) for name in models}


# --- GEMM cases ---------------------------------------------------------------------------------------------
def gemm_models(m, k, n):
    a = RNG.integers(0, 256, (m, k), dtype=np.uint8)
    b = RNG.integers(-127, 128, (k, n), dtype=np.int8)
    af = (a.astype(np.float32) - 128) * 0.02
    bs = np.full(n, 0.01, np.float32)
    ain, aout = _vi("a", U8, ["M", k]), None
    base = [_init("b", b), _init("azp", np.uint8(128))]
    models = {
        "fp32-matmul": (_model([helper.make_node("MatMul", ["af", "bf"], ["y"])], [_vi("af", F, ["M", k])], [_vi("y", F, aout)],
                               [_init("bf", b.astype(np.float32) * 0.01)]), {"af": af}),
        "matmulinteger": (_model([helper.make_node("MatMulInteger", ["a", "b", "azp"], ["y"])], [ain], [_vi("y", I32, aout)], base),
                          {"a": a}),
        "matmulintegertofloat": (_model([helper.make_node("MatMulIntegerToFloat", ["a", "b", "as", "bs", "azp"], ["y"],
                                                          domain="com.microsoft")], [ain], [_vi("y", F, aout)],
                                        base + [_init("as", np.float32(0.02)), _init("bs", bs)], ms=True), {"a": a}),
        "qlinearmatmul": (_model([helper.make_node("QLinearMatMul", ["a", "as", "azp", "b", "bs1", "bzp", "ys", "yzp"], ["y"])],
                                 [ain], [_vi("y", U8, aout)],
                                 base + [_init("as", np.float32(0.02)), _init("bs1", np.float32(0.01)), _init("bzp", np.int8(0)),
                                         _init("ys", np.float32(0.05)), _init("yzp", np.uint8(128))]), {"a": a}),
        "qgemm": (_model([helper.make_node("QGemm", ["a", "as", "azp", "b", "bs", "bzp", "", "ys", "yzp"], ["y"],
                                           domain="com.microsoft")], [ain], [_vi("y", U8, aout)],
                         base + [_init("as", np.float32(0.02)), _init("bs", bs), _init("bzp", np.zeros(n, np.int8)),
                                 _init("ys", np.float32(0.05)), _init("yzp", np.uint8(128))], ms=True), {"a": a}),
        "dynamicquantizematmul": (_model([helper.make_node("DynamicQuantizeMatMul", ["af", "b", "bs", "", ""], ["y"],
                                                           domain="com.microsoft")], [_vi("af", F, ["M", k])], [_vi("y", F, aout)],
                                         [_init("b", b), _init("bs", bs)], ms=True), {"af": af}),
        "bf16-matmul": (_model([helper.make_node("MatMul", ["ab", "bb"], ["y"])], [_vi("ab", TP.BFLOAT16, ["M", k])],
                               [_vi("y", TP.BFLOAT16, aout)],
                               [helper.make_tensor("bb", TP.BFLOAT16, [k, n], (b.astype(np.float32).view(np.uint32) >> 16)
                                                   .astype(np.uint16).tobytes(), raw=True)]), None),
    }
    return models


def attention_models(heads, q, kv, d):
    """QK^T on two activations: fp32 MatMul vs MatMulInteger (u8 queries x s8 keys, both run-time)."""
    qf = RNG.standard_normal((heads, q, d), dtype=np.float32)
    kf = RNG.standard_normal((heads, d, kv), dtype=np.float32)
    qu = RNG.integers(0, 256, (heads, q, d), dtype=np.uint8)
    ks = RNG.integers(-127, 128, (heads, d, kv), dtype=np.int8)
    return {
        "fp32-matmul": (_model([helper.make_node("MatMul", ["q", "k"], ["y"])], [_vi("q", F, [heads, q, d]), _vi("k", F, [heads, d, kv])],
                               [_vi("y", F, None)], []), {"q": qf, "k": kf}),
        "matmulinteger": (_model([helper.make_node("MatMulInteger", ["q", "k", "azp"], ["y"])],
                                 [_vi("q", U8, [heads, q, d]), _vi("k", S8, [heads, d, kv])], [_vi("y", I32, None)],
                                 [_init("azp", np.uint8(128))]), {"q": qu, "k": ks}),
    }


CONVS = [  # (name, N, C, H, W, O, k): SD1.5 at 256x256, batch 2 (classifier-free guidance)
    ("res 3x3 320@32x32", 2, 320, 32, 32, 320, 3),
    ("res 3x3 640@16x16", 2, 640, 16, 16, 640, 3),
    ("res 3x3 1280@8x8", 2, 1280, 8, 8, 1280, 3),
    ("up 3x3 960->320@32x32", 2, 960, 32, 32, 320, 3),
    ("proj 1x1 320@32x32", 2, 320, 32, 32, 320, 1),
    ("proj 1x1 1280@8x8", 2, 1280, 8, 8, 1280, 1),
]
GEMMS = [  # (name, M, K, N)
    ("attn q/k/v/out 2048x320x320", 2048, 320, 320),
    ("ff in (GEGLU) 2048x320x2560", 2048, 320, 2560),
    ("ff out 2048x1280x320", 2048, 1280, 320),
    ("attn 1280@8x8: 128x1280x1280", 128, 1280, 1280),
    ("3x3 im2col 2048x2880x320", 2048, 2880, 320),
]


def run_case(models, feeds, gop):
    row = {}
    for name, model in models.items():
        feed = feeds[name]
        try:
            s = _session(model)
            if feed is None:  # the bf16 probe: load only tells whether a kernel exists
                feed = {i.name: np.zeros([1 if isinstance(d, str) else d for d in ([1] + [int(i.shape[1])])], np.float32)
                        for i in s.get_inputs()}
            t = _time(s, feed)
            row[name] = {"cpu_s": t, "gops": gop / t / 1e9}
        except Exception as e:  # a missing kernel is a fact to record, not a crash
            row[name] = {"error": str(e).strip().splitlines()[0][:200]}
        print(f"  {name:24s} " + (f"{row[name]['gops']:8.0f} GOP/s  {row[name]['cpu_s'] * 1e3:8.2f} ms"
                                  if "gops" in row[name] else row[name]["error"]), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {"machine": machine_facts(), "threads": 1, "convs": {}, "gemms": {}, "attention": {}}
    for name, n, c, h, w, o, k in CONVS:
        print(name, flush=True)
        models, feeds = conv_models(n, c, h, w, o, k)
        res["convs"][name] = {"shape": [n, c, h, w, o, k], "gop": 2 * n * h * w * o * c * k * k / 1e9,
                              "ops": run_case(models, feeds, 2 * n * h * w * o * c * k * k)}
    for name, m, k, n in GEMMS:
        print(name, flush=True)
        models = gemm_models(m, k, n)
        res["gemms"][name] = {"shape": [m, k, n], "gop": 2 * m * k * n / 1e9,
                              "ops": run_case({a: b[0] for a, b in models.items()}, {a: b[1] for a, b in models.items()}, 2 * m * k * n)}
    print("attention QK^T 16x1024x40x1024", flush=True)
    models = attention_models(16, 1024, 1024, 40)
    res["attention"]["QK^T 16x1024x40x1024"] = {"gop": 2 * 16 * 1024 * 1024 * 40 / 1e9, "ops": run_case(
        {a: b[0] for a, b in models.items()}, {a: b[1] for a, b in models.items()}, 2 * 16 * 1024 * 1024 * 40)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(to_markdown(res))
    return 0


def to_markdown(res: dict) -> str:
    from onnxdiffusion.bench.machine import machine_line

    lines = [f"Machine: {machine_line(res['machine'])}. 1 thread, GOP/s by process CPU time (best of repeats).", ""]
    for section, title in (("convs", "Convolutions (batch 2, SD1.5 at 256x256)"), ("gemms", "GEMMs (A activations [M,K] x constant B [K,N])"),
                           ("attention", "Attention core (two activations)")):
        cases = res[section]
        ops = list(dict.fromkeys(o for c in cases.values() for o in c["ops"]))
        lines += [f"### {title}", "", "| case | GOP | " + " | ".join(ops) + " |", "|---|---:|" + "---:|" * len(ops)]
        for name, c in cases.items():
            cells = [f"{c['ops'][o]['gops']:.0f}" if "gops" in c["ops"].get(o, {}) else
                     ("n/a" if o not in c["ops"] else "no kernel") for o in ops]
            lines.append(f"| {name} | {c['gop']:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
