"""One full-width linear, 1 thread: fp32 vs static W8A8 (QDQ, fused by ORT) vs dynamic activations.

    python experiments/rotation/dynamic_token_speed.py [--tokens 1024] [--width 3072] [--runs 7]

What per-token dynamic activations (quantize/dynamic_token.py) cost where the linears are wide: the
per-token ReduceMax / Div / Round / Cast and the row x column rescale are O(tokens x width), the GEMM
O(tokens x width^2). Variants: fp32 MatMul; static: QuantizeLinear / DequantizeLinear around the
MatMul, per-channel int8 weights (ORT fuses it at load); dynamic-tensor: ORT's own DynamicQuantizeLinear
+ MatMulInteger (per-tensor uint8, fused to DynamicQuantizeMatMul); dynamic-token (int8, symmetric) and
dynamic-token-zp (uint8 with a per-row zero point). Interleaved medians of `--runs` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from onnxdiffusion.quantize.dynamic_token import dynamic_token_linears, weight_quantize  # noqa: E402

F = TensorProto.FLOAT


def model(nodes, inits, k, n):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["m", k])],
                          [helper.make_tensor_value_info("y", F, ["m", n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def variants(w: np.ndarray, x: np.ndarray) -> dict:
    k, n = w.shape
    fp32 = model([helper.make_node("MatMul", ["x", "w"], ["y"], name="lin")], [numpy_helper.from_array(w, "w")], k, n)
    wq, ws = weight_quantize(w)
    amax = float(np.abs(x).max())
    static = model([
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1),
        helper.make_node("MatMul", ["xd", "wd"], ["y"]),
    ], [numpy_helper.from_array(np.float32(2 * amax / 255), "xs"), numpy_helper.from_array(np.uint8(128), "xz"),
        numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"),
        numpy_helper.from_array(np.zeros(n, np.int8), "wz")], k, n)
    dyn_tensor = model([
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
        helper.make_node("MatMulInteger", ["xq", "wq", "xz"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=F),
        helper.make_node("Mul", ["xs", "ws"], ["s"]),
        helper.make_node("Mul", ["accf", "s"], ["y"]),
    ], [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws")], k, n)
    return {"fp32": fp32, "static": static, "dynamic-tensor": dyn_tensor,
            "dynamic-token": dynamic_token_linears(fp32, ["lin"])[0],
            "dynamic-token-zp": dynamic_token_linears(fp32, ["lin"], zero_point=True)[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((args.width, args.width)) / np.sqrt(args.width)).astype(np.float32)
    x = rng.standard_normal((args.tokens, args.width)).astype(np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    sessions = {name: ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
                for name, m in variants(w, x).items()}
    ref = x @ w
    times: dict[str, list[float]] = {name: [] for name in sessions}
    err = {}
    for name, s in sessions.items():  # warm-up, and each variant's error against fp32
        y = s.run(None, {"x": x})[0]
        err[name] = float(10 * np.log10((ref**2).mean() / max(((y - ref) ** 2).mean(), 1e-30)))
    for _ in range(args.runs):
        for name, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, {"x": x})
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: float(np.median(t)) for name, t in times.items()}
    out = {"tokens": args.tokens, "width": args.width, "runs": args.runs, "threads": 1,
           "median_ms": {k: round(v, 2) for k, v in med.items()},
           "vs_fp32": {k: round(v / med["fp32"], 3) for k, v in med.items()},
           "vs_static": {k: round(v / med["static"], 3) for k, v in med.items()},
           "output_sqnr_db": {k: round(v, 1) for k, v in err.items()}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
