"""stable-diffusion.cpp's int8 ConvRot linear against ours (rotated W8A8) on one full-width linear, CPU.

    python experiments/rotation/sdcpp_convrot.py WORK --ggml-linear BIN [--tokens 1024] [--k 3072] [--n 3072]
        [--rounds 5] [--threads 1,2] [--acts gaussian,outliers]

Why one linear and not the DiT: stable-diffusion.cpp's int8 ConvRot (its docs/int8_convrot.md) arrived after
0.4.7, the newest stable-diffusion-cpp-python on PyPI, and needs two ops of its own ggml fork; the DiT-level run
is blocked here (experiments/rotation/sdcpp_convrot.md). What can be built is that fork's CPU ops on upstream
ggml (sdcpp_convrot/build.sh), and sd.cpp runs a ConvRot linear as exactly those two ops:
ggml_quantize_i8_convrot (regular-Hadamard H256 rotation of every activation row + one int8 scale per row)
then ggml_mul_mat_i8_tensorwise (int8 x int8 -> int32, times row scale x weight-row scale). BIN is
sdcpp_convrot/ggml_linear.c built against it.

Rows, each on the same x and W (seeded): sd.cpp f32 / f16 / q8_0 (ggml_mul_mat) and int8 ConvRot, the
ConvRot quantize op alone; ours (ONNX Runtime) fp32, static W8A8 (per-tensor activation scale from this very
x: the best a calibration can do), rotated static W8A8 (`rotate=hadamard:256`), rotated per-token dynamic
(`rotate=hadamard:256 -O activations=dynamic-token`: the peer's arithmetic in plain ONNX) and with a per-token
zero point (`activations=dynamic-token-asym`, the docs' choice). Quality = output
SQNR in dB against the float64 product; time = median over `--rounds` interleaved rounds (each sd.cpp row a
fresh process, 3 calls, the first dropped; each ORT row one session, 1 warm-up call). Resumable: WORK keeps
the data files and rounds.jsonl (a rerun adds rounds until `--rounds` are there per thread count; a row added
later has its median over the rounds that timed it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from onnxdiffusion.quantize.dynamic_token import dynamic_token_linears, weight_quantize  # noqa: E402
from onnxdiffusion.quantize.rotation import rotate_activation, rotate_linears  # noqa: E402

F = TensorProto.FLOAT
GROUP = 256
SDCPP_ROWS = ("sdcpp-f32", "sdcpp-f16", "sdcpp-q8_0", "sdcpp-int8-convrot", "sdcpp-convrot-quantize-op")
OURS_ROWS = ("ours-fp32", "ours-w8a8-static", "ours-w8a8-static-rot256", "ours-w8a8-dyntoken-rot256",
             "ours-w8a8-dyntoken-asym-rot256")


def sd_hadamard(order: int) -> np.ndarray:
    """sd.cpp's rotation as its docs give it: Kronecker powers of [[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]]/2
    (regular and symmetric like ours, whose order-4 block is J - 2I: the same family, rows in another order)."""
    h4 = np.ones((4, 4)) - 2 * np.fliplr(np.eye(4))
    h = np.ones((1, 1))
    while h.shape[0] < order:
        h = np.kron(h, h4)
    return h / np.sqrt(order)


def activations(kind: str, t: int, k: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((t, k))
    if kind == "outliers":  # a DiT's pattern, synthetic: a few channels 30x wide with offsets, a few loud tokens
        ch = rng.choice(k, 12, replace=False)
        x[:, ch] = x[:, ch] * 30 + rng.standard_normal(12) * 20
        x += rng.standard_normal(k) * 0.5
        x[rng.choice(t, max(1, t // 64), replace=False)] *= 4
    return x.astype(np.float32)


def prepare(work: Path, acts: str, t: int, k: int, n: int) -> Path:
    d = work / f"{acts}_{t}x{k}x{n}"
    if (d / "done").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)  # ours reads x W, W (K, N)
    x = activations(acts, t, k, np.random.default_rng(1))
    np.save(d / "w.npy", w)
    np.save(d / "x.npy", x)
    x.tofile(d / "x.f32")
    wt = np.ascontiguousarray(w.T)  # ggml: one row per output
    wt.tofile(d / "w.f32")
    # the checkpoint sd.cpp reads (its docs): W_rot = W R per output row, s = max|row| / 127, clamp +-127
    h = sd_hadamard(GROUP)
    wrot = (wt.astype(np.float64).reshape(n, k // GROUP, GROUP) @ h).reshape(n, k)
    s = np.abs(wrot).max(axis=1) / 127
    s = np.where(s > 0, s, 1.0)
    np.clip(np.round(wrot / s[:, None]), -127, 127).astype(np.int8).tofile(d / "wq.i8")
    s.astype(np.float32).tofile(d / "ws.f32")
    (d / "done").write_text("ok\n")
    return d


def graph(nodes, inits, k, n):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["m", k])],
                          [helper.make_tensor_value_info("y", F, ["m", n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def with_static(model, amax: float):
    """The linear `lin` of `model` with per-tensor uint8 QDQ on its input and per-channel int8 weights (ORT
    fuses the pair into its integer GEMM at load), as dynamic_token_speed.py's static row."""
    m = type(model)()
    m.CopyFrom(model)
    lin = next(nd for nd in m.graph.node if nd.name == "lin")
    inits = {i.name: i for i in m.graph.initializer}
    w = numpy_helper.to_array(inits[lin.input[1]])
    wq, ws = weight_quantize(w)
    m.graph.initializer.remove(inits[lin.input[1]])
    m.graph.initializer.extend([numpy_helper.from_array(np.float32(2 * amax / 255), "xs"),
                                numpy_helper.from_array(np.uint8(128), "xz"), numpy_helper.from_array(wq, "wq"),
                                numpy_helper.from_array(ws, "ws"), numpy_helper.from_array(np.zeros(w.shape[1], np.int8), "wz")])
    a = lin.input[0]
    pos = list(m.graph.node).index(lin)
    for i, nd in enumerate([helper.make_node("QuantizeLinear", [a, "xs", "xz"], ["xq"]),
                            helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
                            helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1)]):
        m.graph.node.insert(pos + i, nd)
    lin.input[0], lin.input[1] = "xd", "wd"
    return m


def ours(w: np.ndarray, x: np.ndarray) -> dict:
    k, n = w.shape
    fp32 = graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="lin")], [numpy_helper.from_array(w, "w")], k, n)
    rot = rotate_linears(fp32, ["lin"], GROUP)[0]
    return {"ours-fp32": fp32,
            "ours-w8a8-static": with_static(fp32, float(np.abs(x).max())),
            "ours-w8a8-static-rot256": with_static(rot, float(np.abs(rotate_activation(x, GROUP)).max())),
            "ours-w8a8-dyntoken-rot256": dynamic_token_linears(rot, ["lin"])[0],
            "ours-w8a8-dyntoken-asym-rot256": dynamic_token_linears(rot, ["lin"], zero_point=True)[0]}


def doc_emulation(x: np.ndarray, d: Path, n: int) -> np.ndarray:
    """sd.cpp's int8 ConvRot linear computed from its docs' formulas in numpy (float64 rotation, exact int32
    sums): what the ggml op should return, to check the build runs the documented arithmetic."""
    t, k = x.shape
    wq = np.fromfile(d / "wq.i8", np.int8).reshape(n, k).astype(np.int64)
    ws = np.fromfile(d / "ws.f32", np.float32).astype(np.float64)
    xr = (x.astype(np.float64).reshape(t, k // GROUP, GROUP) @ sd_hadamard(GROUP)).reshape(t, k)
    s = np.abs(xr).max(axis=1) / 127
    q = np.clip(np.round(xr / np.where(s > 0, s, 1)[:, None]), -127, 127).astype(np.int64)
    return (q @ wq.T) * s[:, None] * ws[None, :]


def sqnr(ref: np.ndarray, y: np.ndarray) -> float:
    return float(10 * np.log10((ref**2).mean() / max(((y - ref) ** 2).mean(), 1e-30)))


def run_sdcpp(binary: str, row: str, d: Path, shape, threads: int) -> list[float]:
    variant = {"sdcpp-f32": "f32", "sdcpp-f16": "f16", "sdcpp-q8_0": "q8_0", "sdcpp-int8-convrot": "i8convrot",
               "sdcpp-convrot-quantize-op": "i8quant"}[row]
    t, k, n = shape
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([binary, variant, str(t), str(k), str(n), str(threads), "3", str(d)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["ms"][1:]


def sizes(k: int, n: int, onnx_bytes: dict) -> dict:
    """Bytes of the linear: sd.cpp's weight tensors as its file holds them (f32 / f16 / q8_0 blocks of 32 with an
    f16 scale / int8 + one f32 scale per row), ours the serialized ONNX model (weights, scales, rotation constant)."""
    return {"sdcpp-f32": 4 * k * n, "sdcpp-f16": 2 * k * n, "sdcpp-q8_0": k * n // 32 * 34,
            "sdcpp-int8-convrot": k * n + 4 * n, **onnx_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--ggml-linear", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3072)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--acts", default="gaussian,outliers")
    args = ap.parse_args()
    shape = (args.tokens, args.k, args.n)
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "rounds.jsonl"
    done = [json.loads(s) for s in log.read_text().splitlines()] if log.exists() else []
    quality, onnx_bytes = {}, {}
    for acts in args.acts.split(","):
        d = prepare(args.work, acts, *shape)
        x, w = np.load(d / "x.npy"), np.load(d / "w.npy")
        ref = x.astype(np.float64) @ w.astype(np.float64)
        q = {}
        for row in SDCPP_ROWS[:4]:
            run_sdcpp(args.ggml_linear, row, d, shape, 2)
            v = {"f32": "f32", "f16": "f16", "q8_0": "q8_0", "int8-convrot": "i8convrot"}[row[6:]]
            q[row] = np.fromfile(d / f"y_{v}.f32", np.float32).reshape(args.tokens, args.n)
        for name, m in ours(w, x).items():
            onnx_bytes[name] = m.ByteSize()
            s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            q[name] = s.run(None, {"x": x})[0]
        quality[acts] = {k: round(sqnr(ref, y), 2) for k, y in q.items()}
        emu = doc_emulation(x, d, args.n)
        quality[acts]["sdcpp-int8-convrot_docs_emulated"] = round(sqnr(ref, emu), 2)
        quality[acts]["sdcpp-int8-convrot_vs_emulation_db"] = round(sqnr(emu, q["sdcpp-int8-convrot"]), 1)
        print(acts, json.dumps(quality[acts]), flush=True)
    # speed on the outlier data (timing does not depend on the values)
    d = prepare(args.work, args.acts.split(",")[-1], *shape)
    x, w = np.load(d / "x.npy"), np.load(d / "w.npy")
    for threads in map(int, args.threads.split(",")):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        sessions = {nm: ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
                    for nm, m in ours(w, x).items()}
        for s in sessions.values():
            s.run(None, {"x": x})
        have = sum(1 for r in done if r["threads"] == threads and r["shape"] == list(shape))
        for rnd in range(have, args.rounds):
            rec = {"threads": threads, "shape": list(shape), "round": rnd, "ms": {}}
            for row in SDCPP_ROWS:
                rec["ms"][row] = float(np.median(run_sdcpp(args.ggml_linear, row, d, shape, threads)))
            for nm, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, {"x": x})
                rec["ms"][nm] = (time.perf_counter() - t0) * 1e3
            print(json.dumps(rec), flush=True)
            with log.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            done.append(rec)
        del sessions
    speed = {}
    for threads in map(int, args.threads.split(",")):
        rs = [r for r in done if r["threads"] == threads and r["shape"] == list(shape)]
        rows = [k for k in SDCPP_ROWS + OURS_ROWS if any(k in r["ms"] for r in rs)]
        med = {k: float(np.median([r["ms"][k] for r in rs if k in r["ms"]])) for k in rows}
        speed[str(threads)] = {"rounds": {k: sum(1 for r in rs if k in r["ms"]) for k in rows},
                               "median_ms": {k: round(v, 1) for k, v in med.items()},
                               "vs_sdcpp_f32": {k: round(v / med["sdcpp-f32"], 3) for k, v in med.items()},
                               "vs_ours_fp32": {k: round(v / med["ours-fp32"], 3) for k, v in med.items()}}
    out = {"shape": {"tokens": args.tokens, "k": args.k, "n": args.n}, "group": GROUP,
           "output_sqnr_db": quality, "speed": speed, "bytes": sizes(args.k, args.n, onnx_bytes),
           "cpu": subprocess.run(["bash", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"],
                                 capture_output=True, text=True).stdout.strip()}
    (args.work / "result.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
