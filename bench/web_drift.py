"""Which kernels make an int8-static page drift from `generate`, and what the portable form of each costs.

1. Per node of the page's step graph (int8-static, rounding=cpu), on identical inputs (the values x86 ONNX Runtime
   computes at step --at of a 20-step run): x86 ORT CPU vs onnxruntime-web's WASM build (node, the page's .wasm):
   how many nodes of each op type give different bits, and in how many of their elements.
2. With --leave-out: the rounding=cpu folder's backbone rewritten by quantize/portable_rounding.py with every op
   type but one (or none: the recipe's rounding=portable; all: rounding=cpu): the page's image (WASM in node, the
   page's own pipeline.js) vs `generate`'s over six prompts, and the backbone call's CPU time (1 thread, batch 2,
   interleaved rounds, median).

    python bench/web_drift.py --work DIR [--leave-out] [--out bench/results/web_drift]   # DIR: web_table.py's --work
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
SHAPE_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Shape", "Gather", "Concat", "Transpose", "Slice", "Expand", "Split",
             "Identity", "Equal", "Where", "Min", "Max", "Constant", "Cast", "Neg", "Sub", "Clip"}
PROMPTS = ["a small red circle on the left", "a blue star above a yellow square", "two green triangles",
           "a purple ring in the middle", "a big orange square on the right", "a yellow star below a red circle"]


def step_inputs(model: Path, page: Path, at: int) -> dict:
    """The page's step-graph feeds at step `at` of prompt 4 / seed 4, computed on ORT CPU."""
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.web.parts import D_IN, D_OUT, ITER, X_IN, X_OUT, cpu_sessions, page_feeds

    sessions, wiring = cpu_sessions(page, 1)
    values = dict(page_feeds(Pipeline.from_folder(model, threads=1), PROMPTS[4], 4, 20))
    names = [o.name for o in sessions["prologue"].get_outputs()]
    values.update(zip(names, sessions["prologue"].run(names, {k: values[k] for k in wiring["inputs"]["prologue"]})))
    x, d = values[wiring["start"][X_IN]], values[wiring["start"][D_IN]]
    feeds = {k: values[k] for k in wiring["inputs"]["step"] if k not in (ITER, X_IN, D_IN)}
    for i in range(at):
        x, d = sessions["step"].run([X_OUT, D_OUT], {ITER: np.array(i, np.int64), X_IN: x, D_IN: d, **feeds})
    return {ITER: np.array(at, np.int64), X_IN: x, D_IN: d, **feeds}


def node_drift(model: Path, page: Path, at: int) -> dict:
    """{op type: {nodes, differing, max_share}}: each compute node alone, x86 vs WASM, on the step's own values."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from onnxdiffusion.web.wasm import run_on_wasm

    step = onnx.load(str(page / "model" / "step.onnx"))
    feeds = step_inputs(model, page, at)
    every = onnx.ModelProto()
    every.CopyFrom(step)
    every.graph.output.extend(onnx.ValueInfoProto(name=o) for n in step.graph.node for o in n.output if o)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # every node's own output
    s = ort.InferenceSession(every.SerializeToString(), so, providers=["CPUExecutionProvider"])
    values = {**feeds, **dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))}
    inits = {t.name: t for t in step.graph.initializer}
    jobs, meta = [], []
    for n in step.graph.node:
        if n.op_type in SHAPE_OPS:
            continue
        used = list(dict.fromkeys(x for x in n.input if x))
        ins = {x: values[x] for x in used if x not in inits}
        g = helper.make_graph([n], "one", [helper.make_tensor_value_info(x, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
                                           for x, v in ins.items()],
                              [onnx.ValueInfoProto(name=n.output[0])], initializer=[inits[x] for x in used if x in inits])
        one = helper.make_model(g, opset_imports=list(step.opset_import))
        one.ir_version = step.ir_version
        data = one.SerializeToString()
        so1 = ort.SessionOptions()
        so1.intra_op_num_threads = 1
        cpu = ort.InferenceSession(data, so1, providers=["CPUExecutionProvider"]).run(None, ins)[0]
        jobs.append((data, ins))
        meta.append((n.op_type, cpu))
    out = collections.defaultdict(lambda: {"nodes": 0, "differing": 0, "max_share": 0.0})
    for (op, cpu), got in zip(meta, run_on_wasm(jobs)):
        share = float((next(iter(got.values())) != cpu).mean())
        r = out[op]
        r["nodes"] += 1
        r["differing"] += share > 0
        r["max_share"] = max(r["max_share"], share)
    return dict(sorted(out.items()))


def rewritten(base: Path, folder: Path, op_types: tuple[str, ...]) -> dict:
    """A copy of the rounding=cpu folder `base` whose backbone has `op_types` in their portable form."""
    import onnx

    from onnxdiffusion.folder.artifacts import sha256_file
    from onnxdiffusion.quantize.portable_rounding import portable_rounding

    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(base, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    key = next(k for k, c in manifest["components"].items() if c.get("precision") == "int8-static")
    path = folder / manifest["components"][key]["path"]
    m = onnx.load(str(path))
    report = portable_rounding(m, op_types)
    onnx.save(m, str(path))
    manifest["components"][key]["bytes"] = path.stat().st_size
    manifest["files"][manifest["components"][key]["path"]] = sha256_file(path)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return report


def page_vs_generate(folder: Path, page: Path, steps: int) -> list[float]:
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    requests = [{"prompt": p, "seed": str(i), "steps": steps} for i, p in enumerate(PROMPTS)]
    (page.parent / f"{page.name}.req.json").write_text(json.dumps(requests))
    subprocess.run(["node", str(ROOT / "tests" / "web" / "run_page.mjs"), str(page), str(page.parent / f"{page.name}.req.json"),
                    str(page.parent / f"{page.name}.img"), "1"], check=True, capture_output=True)
    pipe = Pipeline.from_folder(folder, threads=1)
    out = []
    for i, p in enumerate(PROMPTS):
        want = pipe(p, seed=i, steps=steps).images[0]
        out.append(psnr(np.fromfile(page.parent / f"{page.name}.img{i}.rgb", np.uint8).reshape(want.shape), want))
    return out


def backbone_ms(folders: dict[str, Path], rounds: int = 5) -> dict[str, float]:
    """CPU ms of one backbone call (batch 2, the first validated shape), 1 thread, interleaved rounds."""
    import onnxruntime as ort

    sessions = {}
    for name, folder in folders.items():
        manifest = json.loads((folder / "manifest.json").read_text())
        c = next(c for c in manifest["components"].values() if c.get("precision") == "int8-static")
        shape = c["shapes_validated"][0]
        rng = np.random.default_rng(0)
        feeds = {i["name"]: (rng.standard_normal([shape.get(d, d) if isinstance(d, str) else d for d in i["shape"]])
                             * (500 if "time" in i["name"] else 1)).astype(i["dtype"]) for i in c["inputs"]}
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        s = ort.InferenceSession(str(folder / c["path"]), so, providers=["CPUExecutionProvider"],
                                 disabled_optimizers=c.get("session_options", {}).get("disabled_optimizers", []))
        s.run(None, feeds)
        sessions[name] = (s, feeds)
    times = {n: [] for n in sessions}
    for _ in range(rounds):
        for n, (s, feeds) in sessions.items():
            t0 = time.process_time()
            for _ in range(5):
                s.run(None, feeds)
            times[n].append((time.process_time() - t0) / 5 * 1000)
    return {n: statistics.median(t) for n, t in times.items()}


def leave_out(work: Path, family: str, steps: int) -> list[dict]:
    from onnxdiffusion.quantize.portable_rounding import LOWERED
    from onnxdiffusion.web import export_web

    base, scratch = work / f"{family}-int8", work / "drift"
    scratch.mkdir(exist_ok=True)
    present = tuple(rewritten(base, scratch / "probe", LOWERED)["lowered"])
    groups = [tuple(t for t in present if t in ("Sin", "Cos"))] + [(t,) for t in present if t not in ("Sin", "Cos")]
    cases = [("all (rounding=portable)", present)] + [(f"all but {', '.join(g)}", tuple(t for t in present if t not in g))
                                                       for g in groups if g] + [("none (rounding=cpu)", ())]
    rows, folders = [], {}
    for k, (name, ops) in enumerate(cases):
        folder, page = scratch / f"{family}-{k}", scratch / f"page-{family}-{k}"
        rewritten(base, folder, ops)
        export_web(folder, page, max_steps=steps, webgpu=False, overwrite=page.exists(), allow_drift=True)
        scores = page_vs_generate(folder, page, steps)
        rows.append({"variant": name, "lowered": list(ops), "psnr": scores})
        folders[name] = folder
        print(family, name, [round(s, 1) for s in scores], file=sys.stderr, flush=True)
    ms = backbone_ms(folders)
    for r in rows:
        r["backbone_ms"] = ms[r["variant"]]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--at", type=int, default=10, help="the step whose inputs feed the per-node comparison")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--leave-out", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "web_drift")
    a = ap.parse_args()
    from web_table import compact_json, cpu_name, variants

    from onnxdiffusion.bench.setup import machine_info
    from onnxdiffusion.web import export_web

    models = variants(a.work, lambda s: print(s, file=sys.stderr))
    result = {"machine": machine_info(), "at": a.at, "steps": a.steps, "nodes": {}, "leave_out": {}}
    lines = ["# Which kernels make an int8-static page drift from `generate` (bench/web_drift.py)", "",
             f"CPU: {cpu_name()}; onnxruntime-web WASM (node, 1 thread) vs x86 ONNX Runtime CPU (1 thread).", "",
             f"## Each node of the page's step graph alone, on identical inputs (step {a.at} of 20; int8-static rounding=cpu)", "",
             "| model | op type | nodes | nodes whose output bits differ | largest share of elements differing |", "|---|---|---|---|---|"]
    for family in ("sd", "mmdit"):
        page = a.work / f"page-{family}-int8"
        if not (page / "settings.json").is_file():
            export_web(models[f"{family}-int8"], page, overwrite=True, allow_drift=True)
        drift = result["nodes"][family] = node_drift(models[f"{family}-int8"], page, a.at)
        lines += [f"| {family} | {op} | {r['nodes']} | {r['differing']} | {r['max_share']:.3f} |" for op, r in drift.items()]
    if a.leave_out:
        lines += ["", f"## The portable form with one op type left out: page (WASM, node) vs generate, six prompts, {a.steps} "
                  "steps; backbone call CPU ms (batch 2, 1 thread, median of 5 interleaved rounds; machine shared, "
                  f"load {' '.join(machine_info().get('loadavg', []))})", "",
                  "| model | op types in the portable form | page vs generate dB min / median / max | prompts >= 40 dB | "
                  "backbone ms | vs rounding=cpu |", "|---|---|---|---|---|---|"]
        for family in ("sd", "mmdit"):
            rows = result["leave_out"][family] = leave_out(a.work, family, a.steps)
            cpu_ms = rows[-1]["backbone_ms"]
            for r in rows:
                p = r["psnr"]
                lines.append(f"| {family} | {r['variant']} | {min(p):.1f} / {statistics.median(p):.1f} / {max(p):.1f} | "
                             f"{sum(x >= 40 for x in p)}/{len(p)} | {r['backbone_ms']:.1f} | {r['backbone_ms'] / cpu_ms:.2f}x |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(compact_json(result))
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
