"""Where an FP8 (W8A8 E4M3) or NVFP4 backbone loses its accuracy: per-node and per-role sensitivity, weights vs
activations, and activation outlier channels, measured on the model's own calibration trajectories.

    .venv/bin/python experiments/lowbit/lowbit_sensitivity.py [--model models/shapes-mmdit-onnx] [--format fp8|nvfp4] [--prompts 16]

Calibration: the scene world's calib split (seeds 10000+, never the held-out pairs), the model's recommended
sampler / steps / guidance. Error measure: the backbone output's SQNR (dB) vs fp32 on `--steps` timesteps spread
over the trajectory (all rows: uncond and cond halves). Conditions, each as an fp32-simulated graph on ONNX
Runtime's CPU provider (what the stored FP8 QDQ file computes):

- fp8: every quantizable node W8A8 (the fp8 recipe), weights only (activations left float), activations only;
  nvfp4: NVFP4 weights with 16-bit activations, and with FP8 activations;
- each node alone (fp8: W8A8; nvfp4: NVFP4 weights, 16-bit activations), then summed per role (the node-name
  pattern after the block index), and each of the top roles kept float with every other node quantized;
- per-input-channel activation scales instead of per-tensor (a diagnostic: a GEMM cannot apply them, smoothing can);
- per-channel absolute maxima of every quantized activation: the largest channel over the median channel.

Writes bench/results/lowbit_sensitivity_<format>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.folder.artifacts import read_manifest  # noqa: E402
from onnxdiffusion.families import get_family  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, recipe_class  # noqa: E402
from onnxdiffusion.quantize import lowbit as L  # noqa: E402
from onnxdiffusion.quantize.calibration import capture, load_prompts, step_ranges  # noqa: E402
from onnxdiffusion.quantize.graphs import quantizable_nodes, with_outputs  # noqa: E402
from onnxdiffusion.quantize.lowbit_graphs import (FP8_MIN_OPSET, _amax, _chosen, _copy, _Editor,  # noqa: E402
                                                  _fp8_activation, _replace_weight, _weight_users, fp8_graph, fp8_tensor,
                                                  simulation_graph, upgrade_opset, weight_layout)
from onnxdiffusion.quantize.recipes import prepare_unet  # noqa: E402
from onnxdiffusion.quantize.runner import backbone_outputs, session  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def role(name: str) -> str:
    """Node name without its block index: /model/transformer_blocks.3/ff/net.0/proj/MatMul -> transformer_blocks.*/ff/net.0/proj."""
    name = re.sub(r"^model/", "", name.strip("/"))
    name = re.sub(r"(transformer_blocks|single_transformer_blocks|down_blocks|up_blocks|resnets|attentions)\.\d+",
                  r"\1.*", name)
    return re.sub(r"/(MatMul|Gemm|Conv)(_\d+)?$", "", name)


def activation_only(model, nodes, ranges, per_channel: dict | None = None):
    """FP8 Q/DQ on the chosen nodes' activations only (weights float); per_channel: {tensor: amax per last-axis channel}."""
    m = upgrade_opset(_copy(model), FP8_MIN_OPSET)
    ed = _Editor(m)
    for n in _chosen(m, nodes):
        x = n.input[0]
        if per_channel is None:
            _fp8_activation(ed, n, _amax(ranges, x))
            continue
        if x not in ed.act_cache:  # one Q/DQ pair per tensor, shared by its readers
            scale = np.asarray([L.fp8_scale(max(float(a), 1e-12)) for a in per_channel[x]], np.float32)
            s = ed.init(numpy_helper.from_array(scale, f"{x}_fp8c_scale"))
            z = ed.init(fp8_tensor(f"{x}_fp8c_zero", np.zeros(scale.shape, np.float32)))
            q, dq = f"{x}_fp8c", f"{x}_fp8c_dq"
            ed.add(n.name, helper.make_node("QuantizeLinear", [x, s, z], [q], axis=-1, name=f"{x}_QuantizeLinear_c"),
                   helper.make_node("DequantizeLinear", [q, s, z], [dq], axis=-1, name=f"{x}_DequantizeLinear_c"))
            ed.act_cache[x] = dq
        n.input[0] = ed.act_cache[x]
    return ed.finish()


def weights_only(model, nodes):
    m = _copy(model)
    ed, users = _Editor(m), _weight_users(m)

    def fake(n, w, name):
        lay = weight_layout(n, w.ndim)
        return ed.init(numpy_helper.from_array(L.fp8_fake(w, L.channel_scale(w, lay.out_axis), lay.out_axis),
                                               f"{name}_fp8_sim"))

    for n in _chosen(m, nodes):
        _replace_weight(ed, n, users, lambda w, name, n=n: fake(n, w, name))
    return ed.finish()


def sqnr(got: np.ndarray, ref: np.ndarray) -> float:
    """dB; inf when the output is unchanged (a node whose result the output does not read)."""
    noise = float(np.mean((got - ref).astype(np.float64) ** 2))
    return float(10 * np.log10(np.mean(ref.astype(np.float64) ** 2) / noise)) if noise > 0 else float("inf")


def _json(obj):
    """inf -> null (strict JSON)."""
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json(v) for v in obj]
    return obj


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "shapes-mmdit-onnx")
    ap.add_argument("--format", choices=("fp8", "nvfp4"), default="fp8")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6, help="timesteps spread over the trajectory for the error")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/lowbit_sensitivity_<format>.json")
    args = ap.parse_args(argv)
    args.out = args.out or Path(__file__).resolve().parent / f"lowbit_sensitivity_{args.format}.json"
    manifest = read_manifest(args.model)
    backbone = get_family(manifest.get("family")).backbone
    rec = manifest.get("recommended") or {}
    cfg = CalibrationConfig(count=args.prompts, steps=int(rec.get("steps", 20)), sampler=rec.get("sampler", "ddim"),
                            guidance=float(rec.get("guidance", 4.0)))
    pipe = Pipeline.from_folder(args.model, threads=1)
    log(f"capturing {cfg.count} calibration trajectories ({cfg.sampler} {cfg.steps}, guidance {cfg.guidance})")
    calib = capture(pipe, load_prompts(cfg)[0], cfg)
    model = prepare_unet(onnx.load(str(args.model / manifest["components"][backbone]["path"])))
    recipe = recipe_class(args.format).with_options({} if args.format == "fp8" else {"activations": "fp16"})
    nodes = [q.name for q in quantizable_nodes(model, recipe.op_types, recipe.keep_float)]
    by_name = {n.name: n for n in model.graph.node}
    tensors = list(dict.fromkeys(by_name[n].input[0] for n in nodes))
    ranges = step_ranges(model, tensors, calib, 1).aggregate(None, "max")
    steps = calib.spread_steps(args.steps)
    ref = calib.outputs[steps]

    def err(m) -> float:
        return sqnr(backbone_outputs(session(m, 1), calib, steps), ref)

    # per-channel maxima of every quantized activation over the calibration steps (last axis = GEMM input channels)
    log(f"activation statistics of {len(tensors)} tensors")
    sess = session(with_outputs(model, tensors), 1)
    chan = {t: None for t in tensors}
    for s in range(calib.num_steps):
        outs = sess.run(tensors, calib.feed(s, slice(0, calib.rows)))
        for t, v in zip(tensors, outs):
            a = np.abs(v.reshape(-1, v.shape[-1])).max(0)
            chan[t] = a if chan[t] is None else np.maximum(chan[t], a)
    outliers = {t: {"amax": float(a.max()), "max_over_median_channel": float(a.max() / max(np.median(a), 1e-12)),
                    "channels": int(a.size)} for t, a in chan.items()}

    def build(chosen):
        if args.format == "fp8":
            return fp8_graph(model, chosen, ranges, recipe.opset)
        return simulation_graph(model, chosen, "nvfp4", "fp16", {})

    result = {"model": args.model.name, "format": args.format, "backbone": backbone, "quantized_nodes": len(nodes),
              "kept_float": list(recipe.keep_float),
              "calibration": cfg.to_dict(), "error_steps": steps, "rows": calib.rows, "conditions": {}}
    cond = result["conditions"]
    log("whole-model conditions")
    if args.format == "fp8":
        cond["all W8A8 (the fp8 recipe)"] = err(build(nodes))
        cond["weights only (E4M3 per output channel)"] = err(weights_only(model, nodes))
        cond["activations only (E4M3 per tensor)"] = err(activation_only(model, nodes, ranges))
        cond["activations only, per input channel scales"] = err(activation_only(model, nodes, ranges, chan))
    else:
        cond["NVFP4 weights, 16-bit activations"] = err(build(nodes))
        cond["NVFP4 weights, FP8 activations (per tensor)"] = err(simulation_graph(model, nodes, "nvfp4", "fp8", ranges))
    log(f"{len(nodes)} nodes one at a time")
    per_node = {}
    for i, n in enumerate(nodes):
        per_node[n] = {"sqnr_db": err(build([n])), "role": role(n),
                       "input": by_name[n].input[0]}
        if i % 10 == 9:
            log(f"  {i + 1}/{len(nodes)}")
    result["nodes"] = per_node
    result["activations"] = outliers
    roles: dict[str, dict] = {}
    for n, e in per_node.items():
        r = roles.setdefault(e["role"], {"nodes": 0, "added_error": 0.0})
        r["nodes"] += 1
        r["added_error"] += 10 ** (-e["sqnr_db"] / 10)  # relative MSE adds (errors of different nodes ~ independent)
    total = sum(r["added_error"] for r in roles.values())
    for r in roles.values():
        r["share"] = r["added_error"] / total
        r["sqnr_db_alone"] = float(-10 * np.log10(r["added_error"]))
    result["roles"] = dict(sorted(roles.items(), key=lambda kv: -kv[1]["added_error"]))
    # each role kept float in turn (all others W8A8): what keeping it in higher precision buys
    log("each of the top roles kept float")
    for name in list(result["roles"])[:6]:
        keep = [n for n in nodes if per_node[n]["role"] != name]
        result["roles"][name]["sqnr_db_all_but_this"] = err(build(keep))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_json(result), indent=2) + "\n")
    what = "FP8 (W8A8 E4M3)" if args.format == "fp8" else "NVFP4 weights (16-bit activations)"
    lines = [f"# Where {what} loses accuracy on {result['model']}", "",
             f"Backbone output SQNR vs fp32 on {len(steps)} timesteps x {calib.rows} rows of {cfg.count} calibration "
             f"trajectories ({cfg.sampler} {cfg.steps}, guidance {cfg.guidance}); {len(nodes)} quantized nodes "
             f"(Model Optimizer's exclusions float).", "", "| condition | SQNR dB |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in cond.items()]
    lines += ["", "| role (node name without block index) | nodes | share of the added error | SQNR alone dB | "
              "SQNR with this role float, rest quantized dB | worst input channel / median channel |", "|---|---|---|---|---|---|"]
    for name, r in result["roles"].items():
        ins = {per_node[n]["input"] for n in nodes if per_node[n]["role"] == name}
        ratio = max(outliers[t]["max_over_median_channel"] for t in ins)
        extra = f"{r['sqnr_db_all_but_this']:.2f}" if "sqnr_db_all_but_this" in r else "-"
        lines.append(f"| {name} | {r['nodes']} | {r['share']:.1%} | {r['sqnr_db_alone']:.2f} | {extra} | {ratio:.1f} |")
    lines.append(f"\nReproduce: `python experiments/lowbit/lowbit_sensitivity.py --model models/{result['model']} --format {args.format}`.")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
