"""Host loop vs one-graph Loop vs unrolled graph: end-to-end time and peak RSS, interleaved.

Each measurement runs in its own process (so peak RSS belongs to one form): load, one warm-up
generation, then one timed generation. Rounds interleave the forms because timings on a shared
machine drift; medians over rounds are reported with ratios against the host loop.

    python experiments/sd15/loop_forms.py [MODEL] --steps 20 --rounds 5 [--unrolled-steps 10 20 50]
    # full size: a folder compile-loop already wrote, host and Loop only, 1 thread
    python experiments/sd15/loop_forms.py $WORK/loop256 --precompiled --forms host loop --steps 10 --guidance 7.5 \
        --threads 1 --rounds 3 --label '$WORK/loop256' --out bench/report_sd15/loop_forms_fullsize.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, resource, sys, time
from onnxdiffusion.runtime import Pipeline
model, form, steps, sampler, threads, guidance = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), float(sys.argv[6])
t0 = time.perf_counter()
pipe = Pipeline.from_folder(model, threads=threads or None)
kw = dict(steps=steps, sampler=sampler, guidance=guidance, seed=0, loop=form)
if form != "host":
    pipe.sampling_graph(form)
load = time.perf_counter() - t0
t0 = time.perf_counter(); pipe("a red circle on the left", **kw); first = time.perf_counter() - t0
t0, c0 = time.perf_counter(), time.process_time()
r = pipe("a red circle on the left", **kw)
timed, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"load_s": load, "first_s": first, "e2e_s": timed, "cpu_s": cpu,
                  # VmHWM, not ru_maxrss: the latter survives exec and would report the parent's peak
                  "peak_rss_mb": int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024,
                  "latents": r.latents.ravel()[:8].tolist()}))
"""


def measure(model: Path, form: str, steps: int, sampler: str, threads: int, guidance: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), form, str(steps), sampler, str(threads), str(guidance)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {form} run failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "shapes-sd-onnx"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sampler", default="ddim")
    ap.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0 = ORT default)")
    ap.add_argument("--unrolled-sizes", type=int, nargs="*", default=[10, 20, 50])
    ap.add_argument("--portable", action="store_true",
                    help="compile the loop portably (compile-loop --portable) instead of the tuned default")
    ap.add_argument("--guidance", type=float, default=4.0)
    ap.add_argument("--forms", nargs="+", default=["host", "loop", "unrolled"], choices=["host", "loop", "unrolled"])
    ap.add_argument("--precompiled", action="store_true",
                    help="MODEL already has the graphs (compile-loop); measure it as it is, compile nothing")
    ap.add_argument("--label", help="the model as the results name it (default: MODEL; no machine paths in committed results)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "loop_forms.json"))
    args = ap.parse_args()

    from tqdm import tqdm

    from onnxdiffusion.loopgraph.compile import compile_loop

    sizes = {}
    if args.precompiled:
        compiled = Path(args.model)
    else:
        work = Path(tempfile.mkdtemp(prefix="loop-forms-"))
        compiled = work / "model"
        t0 = time.perf_counter()
        compile_loop(args.model, compiled, form="loop", cpu_tuned=False if args.portable else None)
        sizes["loop"] = {"compile_s": time.perf_counter() - t0}
        # the measured step count goes last so its unrolled graph is the one left in the folder
        for n in [k for k in sorted(set(args.unrolled_sizes)) if k != args.steps] + [args.steps] if "unrolled" in args.forms else []:
            t0 = time.perf_counter()
            info = compile_loop(compiled, compiled, form="unrolled", steps=n)
            sizes[f"unrolled_{n}"] = {"compile_s": time.perf_counter() - t0, "bytes": info["bytes"]}
    comps = json.loads((compiled / "manifest.json").read_text())["components"]
    sizes.setdefault("loop", {})["bytes"] = comps["sampler_loop"]["bytes"]
    sizes["loop"]["prefused"] = comps["sampler_loop"].get("prefused")
    sizes["unet_bytes"] = comps["unet"]["bytes"]

    forms = list(dict.fromkeys(["host", *args.forms]))
    runs: dict[str, list[dict]] = {f: [] for f in forms}
    for r in tqdm(range(args.rounds), desc="rounds"):
        k = r % len(forms)
        for form in forms[k:] + forms[:k]:  # rotate who goes first
            runs[form].append(measure(compiled, form, args.steps, args.sampler, args.threads, args.guidance))
    summary = {}
    for form in forms:
        e2e = [x["e2e_s"] for x in runs[form]]
        summary[form] = {
            "e2e_median_s": statistics.median(e2e),
            "e2e_all_s": e2e,
            # CPU time of the timed call (all threads): with --threads 1 it leaves out time other processes
            # held the core, so on a loaded machine it is the steadier comparison
            "cpu_median_s": statistics.median(x["cpu_s"] for x in runs[form]),
            "peak_rss_median_mb": statistics.median(x["peak_rss_mb"] for x in runs[form]),
            "load_median_s": statistics.median(x["load_s"] for x in runs[form]),
            "first_call_median_s": statistics.median(x["first_s"] for x in runs[form]),
            "cpu_all_s": [x["cpu_s"] for x in runs[form]],
            "peak_rss_all_mb": [x["peak_rss_mb"] for x in runs[form]],
        }
    host = summary["host"]
    for form in forms:
        summary[form]["time_vs_host"] = summary[form]["e2e_median_s"] / host["e2e_median_s"]
        summary[form]["cpu_vs_host"] = summary[form]["cpu_median_s"] / host["cpu_median_s"]
        summary[form]["rss_vs_host"] = summary[form]["peak_rss_median_mb"] / host["peak_rss_median_mb"]
    result = {"model": args.label or args.model,
              "loop_compile": "as found" if args.precompiled else "portable" if args.portable else "default (tuned)",
              "loadavg": Path("/proc/loadavg").read_text().split()[:3], "steps": args.steps, "sampler": args.sampler, "guidance": args.guidance, "rounds": args.rounds,
              "threads": args.threads or "ort default", "summary": summary, "sizes": sizes,
              "bench_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{'form':10s} {'e2e median s':>13s} {'x host':>7s} {'CPU s':>7s} {'x host':>7s} {'peak RSS MB':>12s} {'x host':>7s}")
    for form in forms:
        s = summary[form]
        print(f"{form:10s} {s['e2e_median_s']:13.3f} {s['time_vs_host']:7.2f} {s['cpu_median_s']:7.3f} {s['cpu_vs_host']:7.2f} "
              f"{s['peak_rss_median_mb']:12.0f} {s['rss_vs_host']:7.2f}")
    print(f"unet {sizes['unet_bytes'] / 1e6:.1f} MB; loop file {sizes['loop']['bytes'] / 1e6:.1f} MB;",
          ", ".join(f"{k} {v['bytes'] / 1e6:.1f} MB ({v['compile_s']:.1f}s)" for k, v in sizes.items() if k.startswith("unrolled")))
    print("wrote", out)


if __name__ == "__main__":
    main()
