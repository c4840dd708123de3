#!/usr/bin/env python
"""The peers table of the full-size report: experiments/sd15/sd15_int8_measure.py runs (1 thread, all cores) -> MD + plot.

Reads the measure script's JSON files (one per thread count, same variants, interleaved in each), writes a
markdown table per thread count with ours int8-static's ratios against every other row (end to end by CPU
time and by wall, peak RSS) and one small bar plot of end-to-end CPU time (256-colour PNG).

    python bench/sd15_peers_table.py bench/report_sd15/peers_threads1.json bench/report_sd15/peers_threads2.json \\
        --md bench/report_sd15/peers.md --plot bench/report_sd15/peers.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
OURS = "ours-int8-static"
LABELS = {"ours-fp32": "ours fp32 (ONNX Runtime)", OURS: "**ours int8-static**",
          "openvino-fp32": "OpenVINO fp32", "openvino-int8-hybrid": "OpenVINO int8-hybrid (NNCF)",
          "sdcpp-q8_0": "stable-diffusion.cpp q8_0", "sdcpp-q4_0": "stable-diffusion.cpp q4_0",
          "sdcpp-fp32": "stable-diffusion.cpp f32", "diffusers-eager-fp32": "diffusers eager fp32",
          "diffusers-eager-bf16": "diffusers eager bf16",
          "ours-int8-static-components": "**ours int8-static + int8 VAE decoder and text encoder**"}


def _f(v, d=2):
    return "-" if v is None else f"{v:.{d}f}"


def table(res: dict, source: str) -> list[str]:
    s, summ = res["settings"], res["summary"]
    loads = [x for runs in res["raw"].values() for r in runs for x in (r.get("loadavg_before"), r.get("loadavg_after"))
             if x is not None]
    ours = summ.get(OURS, {})
    lines = [f"### {s['threads']} thread(s) ({s.get('cpus', '?')} cores on the machine), `{source}`: {s['rounds']} "
             f"interleaved round(s), load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f}", "",
             "| variant | runs | step CPU s | step wall s | e2e CPU s | e2e wall s | peak RSS GB | int8-static faster "
             "(CPU) | (wall) | int8-static RSS / this |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in summ.items():
        label = LABELS.get(name, name)
        if "error" in row:
            lines.append(f"| {label} | 0 | failed: {row['error'][:200]} | | | | | | | |")
            continue
        ratio = lambda key: (row[key] / ours[key]) if ours.get(key) and row.get(key) else None  # noqa: E731
        rss = (ours["peak_rss_bytes"] / row["peak_rss_bytes"]) if ours.get("peak_rss_bytes") else None
        lines.append(f"| {label} | {row['runs']} | {_f(row['step_cpu_s'])} | {_f(row['step_wall_s'])} | {_f(row['e2e_cpu_s'])} | "
                     f"{_f(row['e2e_wall_s'])} | {_f(row['peak_rss_bytes'] / GB)} | "
                     f"{'-' if name == OURS else _f(ratio('e2e_cpu_s')) + 'x'} | "
                     f"{'-' if name == OURS else _f(ratio('e2e_wall_s')) + 'x'} | "
                     f"{'-' if name == OURS else _f(rss) + 'x'} |")
    return lines


def plot(path: Path, results: list[dict], sources: list[str]) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    names: list[str] = []
    for res in results:  # every row that ran in any of the runs, first-seen order
        names += [n for n, row in res["summary"].items() if "error" not in row and n not in names]
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(names) * len(results) + 1.0), dpi=80)
    ys, labels = [], []
    for j, res in enumerate(results):
        for i, n in enumerate(names):
            row = res["summary"].get(n, {})
            y = i * (len(results) + 0.6) + j
            if row.get("e2e_cpu_s"):
                ax.barh(y, row["e2e_cpu_s"], color=f"C{j}", label=f"{sources[j]} ({res['settings']['threads']} thread(s))" if i == names.index(
                    next(x for x in names if res["summary"].get(x, {}).get("e2e_cpu_s"))) else None)
                ax.text(row["e2e_cpu_s"], y, f" {row['e2e_cpu_s']:.1f}", va="center", fontsize=7)
            ys.append(y)
            labels.append(LABELS.get(n, n).replace("*", "") if j == 0 else "")
    ax.set_yticks(ys, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("end to end CPU s (user + sys, all threads), 256x256, 10 steps; lower is better")
    ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB").quantize(64)
    tmp = path.with_suffix(".tmp.png")
    img.save(tmp, format="PNG", optimize=True)
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--md", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    results = [json.loads(p.read_text()) for p in args.results]
    parts = ["# Full-size peers: ours vs OpenVINO and stable-diffusion.cpp (issue 16, acceptance 1)", "",
             "Generated by `bench/sd15_peers_table.py` from " + ", ".join(f"`{p.name}`" for p in args.results) + ".", ""]
    for path, res in zip(args.results, results):
        parts += [*table(res, path.name), ""]
    parts += ["Step: ours and diffusers, one backbone call on the classifier-free-guidance pair (batch 2) after a warm-up "
              "call; peers, the median sampling step seen by the pipeline's step callback (both UNet evaluations + the "
              "scheduler; sd.cpp's first step also holds text encoding). End to end: one 256x256 image, 10 steps, "
              "guidance 7.5, from the call to the decoded image (load not included). CPU = user + sys of the whole "
              "process, all threads. Peak RSS = VmHWM of the fresh process (load + calls + image).", ""]
    tmp = args.md.with_suffix(".tmp")
    tmp.write_text("\n".join(parts) + "\n")
    tmp.replace(args.md)
    if args.plot:
        plot(args.plot, results, [p.stem for p in args.results])
    print("\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
