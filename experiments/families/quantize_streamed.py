#!/usr/bin/env python
"""int8-dynamic's build on a backbone in external data: peak RSS and time before (main: the skeleton written out
whole for ORT's quantize_dynamic, which loads it, quantizes and is loaded back) and after (quantize/streamed.py:
weights read one at a time, quantized tensors spilled as they are made).

The backbone is a FLUX.2-width stand-in built without torch: per block the linears of a FLUX.2 double-stream block
at full width (3072; qkv 3072->9216, out 3072->3072, SwiGLU MLP 3072->18432 and 9216->3072: 120 M weights,
0.48 GB fp32) as MatMuls on [1, 256, 3072] tokens, a Gemm modulation per block (3072 -> 18432, transposed: ORT's
dynamic quantizer turns it into a MatMul with a transposed copy of the weight) and a Constant. Weights are random, written tensor by tensor. Each measured run is a
fresh process (`ru_maxrss`), PYTHONPATH naming the code under test; the inline limit is lowered to 64 MB so both
take their skeleton path at every size.

    python experiments/families/quantize_streamed.py WORK --src-before MAIN/src --src-after BRANCH/src \
        --blocks 1 3 5 --before-max 1 [--recipe dynamic|static]   # into quantize_streamed.json beside this script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WIDTH, TOKENS = 3072, 256
LINEARS = (("qkv", WIDTH, 3 * WIDTH), ("out", WIDTH, WIDTH), ("mlp_in", WIDTH, 6 * WIDTH), ("mlp_out", 3 * WIDTH, WIDTH))


def build(path: Path, blocks: int) -> int:
    """The stand-in backbone at `path`, weights in `path`_data written one at a time; returns the weight bytes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    data = path.with_name(path.name + "_data")
    nodes, inits, offset = [], [], 0
    with open(data, "wb") as f:
        def weight(name, shape):
            nonlocal offset
            a = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
            pad = (-offset) % 4096
            f.write(b"\0" * pad)
            offset += pad
            t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(a.nbytes))):
                t.external_data.add(key=k, value=v)
            f.write(a.tobytes())
            offset += a.nbytes
            inits.append(t)
            return name

        x, temb = "hidden", "temb"
        for b in range(blocks):
            mod = f"b{b}.mod"
            nodes.append(helper.make_node("Gemm", [temb, weight(f"{mod}.weight", [6 * WIDTH, WIDTH])], [mod], transB=1,
                                          name=f"/b{b}/mod/Gemm"))
            scale = f"b{b}.scale"
            cval = helper.make_tensor(f"b{b}.cval", TensorProto.FLOAT, [WIDTH],
                                      rng.standard_normal(WIDTH).astype(np.float32).tobytes(), raw=True)
            nodes.append(helper.make_node("Constant", [], [scale], value=cval, name=f"/b{b}/Constant"))
            h = f"b{b}.h"
            nodes.append(helper.make_node("Mul", [x, scale], [h], name=f"/b{b}/Mul"))
            y = h
            for name, k, n in LINEARS:
                if name == "out":
                    y = f"b{b}.qkv_q"  # q of the qkv (first third) through out: full-width activations
                    nodes.append(helper.make_node("Slice", [f"b{b}.qkv", "zero", "w", "two"], [y], name=f"/b{b}/Slice"))
                if name == "mlp_out":
                    y = f"b{b}.gate"
                    nodes.append(helper.make_node("Slice", [f"b{b}.mlp_in", "zero", "w3", "two"], [y], name=f"/b{b}/Gate"))
                nodes.append(helper.make_node("MatMul", [h if name in ("qkv", "mlp_in") else y,
                                                         weight(f"b{b}.{name}.weight", [k, n])], [f"b{b}.{name}"],
                                              name=f"/b{b}/{name}/MatMul"))
            nodes.append(helper.make_node("Add", [f"b{b}.out", f"b{b}.mlp_out"], [f"b{b}.sum"], name=f"/b{b}/Add"))
            nodes.append(helper.make_node("Add", [x, f"b{b}.sum"], [f"b{b}.x"], name=f"/b{b}/Residual"))
            x = f"b{b}.x"
    small = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]), helper.make_tensor("w", TensorProto.INT64, [1], [WIDTH]),
             helper.make_tensor("w3", TensorProto.INT64, [1], [3 * WIDTH]), helper.make_tensor("two", TensorProto.INT64, [1], [2])]
    graph = helper.make_graph(nodes, "standin", [
        helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, TOKENS, WIDTH]),
        helper.make_tensor_value_info("temb", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, TOKENS, WIDTH])], small + inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))  # the weights are references already; the Constants stay inline (main
    return offset  # fails on Constants in external data: tests/quantize/test_quantize_external.py)


def run(path: Path, out: Path, recipe: str) -> dict:
    """One measured build in this process: load (skeleton), quantize every MatMul/Gemm, save. dynamic: int8-dynamic's
    builder; static: int8-static's QDQ build and its cpu-fused stored form with fixed activation ranges (the
    calibration, which runs the fp32 backbone, is not part of the build)."""
    import resource

    from onnxdiffusion.onnxio import files as onnxio_files
    from onnxdiffusion.quantize import _ort, files

    onnxio_files.INLINE_LIMIT = 64 << 20  # both versions: the skeleton path at every size measured
    t0 = time.perf_counter()
    model = files.load_backbone(path)
    assert files.data_dir(model) is not None
    nodes = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
    if recipe == "dynamic":
        q = _ort.dynamic_quantize(model, nodes, ("Conv", "MatMul", "Gemm"), "uint8", False)
    else:
        from onnxdiffusion.quantize.components import stored_graph
        from onnxdiffusion.quantize.graphs import activation_tensors, compact_names, prepare_unet, reroute_shape_reads

        work = prepare_unet(model)
        ranges = {t: (-4.0, 4.0) for t in activation_tensors(work, nodes)}
        q = _ort.qdq_quantize(work, ranges, nodes, ("MatMul", "Gemm"), "uint8", ("MatMul", "Gemm"))
        reroute_shape_reads(q)
        q, _ = stored_graph(compact_names(q), "cpu-fused", 1)
    out.mkdir(parents=True, exist_ok=True)
    files.save(q, out / "model.onnx")
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(peak / 1e9, 3),
            "out_bytes": sum(p.stat().st_size for p in out.iterdir())}


def digest(folder: Path) -> dict:
    """Per-initializer sha256 of a saved model, read one tensor at a time (before and after must agree)."""
    import hashlib

    import onnx

    from onnxdiffusion.onnxio.files import tensor_array

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        a = tensor_array(t, folder) if t.data_location == onnx.TensorProto.EXTERNAL else onnx.numpy_helper.to_array(t)
        out[t.name] = hashlib.sha256(a.tobytes()).hexdigest()[:16]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--src-before", type=Path)
    ap.add_argument("--src-after", type=Path)
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 5])
    ap.add_argument("--before-max", type=int, default=2, help="largest block count the before side runs (its memory)")
    ap.add_argument("--recipe", choices=("dynamic", "static"), default="dynamic")
    ap.add_argument("--child", nargs=2, type=Path)
    ap.add_argument("--digest", type=Path)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run(*a.child, a.recipe)))
        return
    if a.digest:
        print(json.dumps(digest(a.digest)))
        return
    results = []
    for blocks in a.blocks:
        folder = a.work / f"b{blocks}"
        folder.mkdir(parents=True, exist_ok=True)
        weights = build(folder / "model.onnx", blocks)
        sides = (("before", a.src_before), ("after", a.src_after)) if blocks <= a.before_max else (("after", a.src_after),)
        row = {"blocks": blocks, "fp32_weight_gb": round(weights / 1e9, 3)}
        for side, src in sides:
            env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
            out = a.work / f"b{blocks}-{side}"
            proc = subprocess.run([sys.executable, __file__, str(a.work), "--recipe", a.recipe, "--child",
                                   str(folder / "model.onnx"), str(out)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                row[side] = {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
            else:
                row[side] = json.loads(proc.stdout.strip().splitlines()[-1])
                row[side]["peak_over_fp32"] = round(row[side]["peak_rss_gb"] / row["fp32_weight_gb"], 2)
            print(json.dumps(row), flush=True)
        if all("seconds" in row.get(s, {}) for s in ("before", "after")):
            env = {**os.environ, "PYTHONPATH": str(a.src_after)}
            d = [json.loads(subprocess.run([sys.executable, __file__, str(a.work), "--digest", str(a.work / f"b{blocks}-{s}")],
                                           env=env, capture_output=True, text=True, check=True).stdout) for s in ("before", "after")]
            row["same_tensors"] = d[0] == d[1]
        results.append(row)
        print(json.dumps(row), flush=True)
        for p in sorted(a.work.glob(f"b{blocks}*")):
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
    path = Path(__file__).parent / "quantize_streamed.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    done = done if "recipes" in done else {"cpu": _cpu(), "width": WIDTH, "tokens": TOKENS, "recipes": {}}
    done["recipes"][a.recipe] = results
    path.write_text(json.dumps(done, separators=(",", ":")) + "\n")


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "?"


if __name__ == "__main__":
    main()
