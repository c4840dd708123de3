"""The browser page's size and speed: page folder bytes vs the model's ONNX bytes + the runtime's; load time,
first image and per-step time in headless Chromium's WASM (1 thread; all threads when cross-origin isolated)
vs the Python ONNX Runtime CPU path (`generate`'s host loop; and ORT CPU on the page's own three graphs).

    python bench/web_table.py [--rounds 2] [--steps 20] [--work DIR] [--out bench/results/web_table]

Needs the pinned npm packages (make web-deps) and Chromium (bash bench/install_chromium.sh). Rounds interleave
the variants and modes (timings on a shared machine drift); medians over rounds are reported. Per-step time is
the median time of one denoising step (one backbone call on the guided batch + the sampler update): the page's
own per-step record (dataset.stepTimes) and, in Python, the time between generate's step events.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a small red circle on the left", "a blue star above a yellow square", "two green triangles"]

PY_CHILD = r"""
import json, statistics, sys, time
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.runtime.generation import StepEvent
from onnxdiffusion.web.parts import cpu_sessions, page_feeds, run_parts
model, page, threads, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.argv[5])
t0 = time.perf_counter()
pipe = Pipeline.from_folder(model, threads=threads or None)
load = time.perf_counter() - t0
times, step_ms = [], []
for i, p in enumerate(prompts):
    t0 = last = time.perf_counter(); per = []
    for e in pipe.iter_generate(p, seed=i, steps=steps):
        if isinstance(e, StepEvent):  # time between steps: one backbone call (cond + uncond) and the update
            now = time.perf_counter(); per.append(now - last); last = now
    times.append(time.perf_counter() - t0)
    step_ms.append(1000 * statistics.median(per[1:]))  # the first includes the text encoder
# the page's own three graphs on ORT CPU, driven as pipeline.js drives them
sessions, wiring = cpu_sessions(page, threads)
graph = []
for i, p in enumerate(prompts):
    feeds = page_feeds(pipe, p, i, steps); per = []
    last = [time.perf_counter()]
    def tick(k, n):
        now = time.perf_counter(); per.append(now - last[0]); last[0] = now
    run_parts(sessions, feeds, wiring, on_step=tick)
    graph.append(1000 * statistics.median(per[1:]))
print(json.dumps({"load_s": load, "first_s": load + times[0], "run_s": statistics.median(times[1:]),
                  "step_ms": statistics.median(step_ms[1:]), "graph_step_ms": statistics.median(graph[1:])}))
"""


def cpu_name() -> str:
    """The CPU's model name and the ISA flags that matter to these kernels (from /proc/cpuinfo)."""
    from onnxdiffusion.bench.setup import machine_info

    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "amx_tile")
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    return f"{machine_info().get('cpu')} [{' '.join(f for f in wanted if f in flags)}]"


def as_table(rows: list[dict]) -> dict:
    """[{k: v}, ...] -> {"columns": [k, ...], "rows": [[v, ...], ...]} (missing values None)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return {"columns": columns, "rows": [[r.get(k) for k in columns] for r in rows]}


def compact_json(obj) -> str:
    """One line per top-level key, floats to 4 significant digits: the results stay small in the repository."""
    def r(x):
        if isinstance(x, float):
            return float(f"{x:.4g}") if x == x and abs(x) != float("inf") else x
        if isinstance(x, dict):
            return {k: r(v) for k, v in x.items()}
        return [r(v) for v in x] if isinstance(x, (list, tuple)) else x
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(r(v), separators=(',', ':'))}" for k, v in obj.items())
    return "{\n" + body + "\n}\n"


def folder_bytes(folder: Path, skip=()) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name not in skip)


def model_onnx_bytes(model: Path) -> int:
    m = json.loads((model / "manifest.json").read_text())
    return sum(c.get("bytes", 0) for k, c in m["components"].items() if not k.startswith("sampler_") and k != "vae_encoder")


def variants(work: Path, log) -> dict[str, Path]:
    """fp32, int8-static (rounding=cpu, the default) and int8-static rounding=portable, for both embedded models."""
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class

    out = {}
    for family in ("sd", "mmdit"):
        fp32 = ROOT / "models" / f"shapes-{family}-onnx"
        out[f"{family}-fp32"] = fp32
        for suffix, options in (("int8", {}), ("int8p", {"rounding": "portable"})):
            int8 = work / f"{family}-{suffix}"
            if not (int8 / "manifest.json").is_file():
                log(f"quantizing {fp32.name} int8-static {options} -> {int8}")
                sampler = "ddim" if family == "sd" else "flow_euler"
                quantize(fp32, int8, QuantizeConfig(recipe=recipe_class("int8-static").with_options(options), latency_runs=1,
                                                    measure_memory=False,
                                                    calibration=CalibrationConfig(count=8, steps=10, batch=4, sampler=sampler)),
                         measure_quality=False, overwrite=True)
            out[f"{family}-{suffix}"] = int8
    return out


def browser_run(page: Path, isolated: bool, steps: int) -> dict:
    from onnxdiffusion.web.browser import chrome, generate, open_page, static_server

    with static_server(page, isolated=isolated) as url:
        d = chrome()
        try:
            t0 = time.perf_counter()
            status = open_page(d, url)
            wall_load = time.perf_counter() - t0
            assert status == "ready", status
            ds = d.execute_script("return Object.assign({}, document.body.dataset)")
            runs = []
            for i, p in enumerate(PROMPTS):
                r = generate(d, p, i, steps)
                assert r["status"] == "done", r["status"]
                runs.append(r["dataset"])
        finally:
            d.quit()
    return {"threads": int(ds["threads"]), "load_s": float(ds["loadMs"]) / 1000, "wall_load_s": wall_load,
            "first_s": (float(ds["loadMs"]) + float(runs[0]["totalMs"])) / 1000,
            "run_s": statistics.median(float(r["totalMs"]) for r in runs[1:]) / 1000,
            "step_ms": statistics.median(float(r["stepMs"]) for r in runs[1:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "web_table")
    a = ap.parse_args()

    def log(s):
        print(s, file=sys.stderr, flush=True)

    from onnxdiffusion.bench.setup import machine_info
    from onnxdiffusion.web import export_web
    from onnxdiffusion.web.export import WEBGPU_FILES
    from onnxdiffusion.web.npm import installed

    work = a.work or Path(tempfile.mkdtemp(prefix="web-table-"))
    work.mkdir(parents=True, exist_ok=True)
    models = variants(work, log)
    pages, sizes = {}, {}
    for name, model in models.items():
        pages[name] = work / f"page-{name}"
        if not (pages[name] / "settings.json").is_file():
            export_web(model, pages[name], overwrite=True, allow_drift=True)
        s = json.loads((pages[name] / "settings.json").read_text())
        ort_dir = pages[name] / "ort"
        sizes[name] = {"page_bytes": folder_bytes(pages[name]),
                       "page_bytes_wasm_only": folder_bytes(pages[name], skip=WEBGPU_FILES),
                       "graph_bytes": s["graph"]["bytes"], "model_onnx_bytes": model_onnx_bytes(model),
                       "runtime_bytes_wasm": folder_bytes(ort_dir, skip=WEBGPU_FILES),
                       "runtime_bytes": folder_bytes(ort_dir)}
    cores = os.cpu_count()
    raw = []
    for rnd in range(a.rounds):
        for name in models:
            for mode in ("wasm-1", "wasm-all", "python-1", "python-all"):
                log(f"round {rnd + 1}/{a.rounds}: {name} {mode}")
                if mode.startswith("wasm"):
                    r = browser_run(pages[name], isolated=mode == "wasm-all", steps=a.steps)
                else:
                    threads = 1 if mode == "python-1" else cores
                    p = subprocess.run([sys.executable, "-c", PY_CHILD, str(models[name]), str(pages[name]), str(threads),
                                        str(a.steps), json.dumps(PROMPTS)], capture_output=True, text=True)
                    if p.returncode != 0:
                        raise SystemExit(f"the Python run failed: {p.stderr[-2000:]}")
                    r = json.loads(p.stdout.strip().splitlines()[-1]) | {"threads": threads}
                raw.append({"round": rnd, "variant": name, "mode": mode, **r})
    med = {}
    for name in models:
        for mode in ("wasm-1", "wasm-all", "python-1", "python-all"):
            rows = [r for r in raw if r["variant"] == name and r["mode"] == mode]
            med[(name, mode)] = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in ("round", "variant", "mode")}
    result = {"machine": machine_info(), "steps": a.steps, "rounds": a.rounds, "prompts": PROMPTS,
              "onnxruntime_web": installed() and json.loads((installed() / "onnxruntime-web" / "package.json").read_text())["version"],
              "chromium_flags": "headless=new, no-sandbox, disable-gpu (WASM only)",
              "sizes": sizes, "median": {f"{n}/{m}": v for (n, m), v in med.items()}, "raw": as_table(raw)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(compact_json(result))
    mb = lambda b: f"{b / 1e6:.1f}"  # noqa: E731
    lines = [f"# The page: size and speed ({a.steps} steps, model defaults, median of {a.rounds} rounds)", "",
             f"CPU: {cpu_name()} ({cores} cores); load average at the end "
             f"{' '.join(result['machine'].get('loadavg', []))}; onnxruntime-web {result['onnxruntime_web']} in headless "
             f"Chromium (WASM, SIMD; threads = all cores when cross-origin isolated), onnxruntime "
             f"{result['machine'].get('onnxruntime')} CPU for the Python path.", "",
             "## Size (MB)", "",
             "| variant | page folder | page, WASM only | graphs (model/*.onnx) | model ONNX (components) | runtime WASM | runtime + WebGPU |",
             "|---|---|---|---|---|---|---|"]
    for n, s in sizes.items():
        lines.append(f"| {n} | {mb(s['page_bytes'])} | {mb(s['page_bytes_wasm_only'])} | {mb(s['graph_bytes'])} | "
                     f"{mb(s['model_onnx_bytes'])} | {mb(s['runtime_bytes_wasm'])} | {mb(s['runtime_bytes'])} |")
    lines += ["", "## Speed", "",
              "load: page open to ready (runtime + graphs + sessions; Python: Pipeline.from_folder); first image: load + "
              "the first run; run: a later whole run (text encoder + steps + VAE); per step: median time of one "
              "denoising step.", "",
              "| variant | load s (WASM 1t / all / Python 1t) | first image s (WASM 1t / all / Python 1t) | "
              "run s (WASM 1t / all / Python 1t / all) | ms/step WASM 1t | WASM all | Python ORT host loop 1t | all | "
              "ORT CPU, page graphs 1t | WASM 1t / Python 1t |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for n in models:
        w1, wa, p1, pa = (med[(n, m)] for m in ("wasm-1", "wasm-all", "python-1", "python-all"))
        lines.append(f"| {n} | {w1['load_s']:.2f} / {wa['load_s']:.2f} / {p1['load_s']:.2f} | {w1['first_s']:.2f} / "
                     f"{wa['first_s']:.2f} / {p1['first_s']:.2f} | {w1['run_s']:.2f} / {wa['run_s']:.2f} / "
                     f"{p1['run_s']:.2f} / {pa['run_s']:.2f} | {w1['step_ms']:.1f} | {wa['step_ms']:.1f} "
                     f"({wa['threads']:.0f}t) | {p1['step_ms']:.1f} | {pa['step_ms']:.1f} ({pa['threads']:.0f}t) | "
                     f"{p1['graph_step_ms']:.1f} | {w1['step_ms'] / p1['step_ms']:.1f}x |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
