#!/usr/bin/env python
"""bench/results/fullwidth_bench/README.md: `bench --arch sdxl|sd3|flux|qwenimage` side by side, portable paths.

Each arch's run writes its own folder (`onnxdiffusion bench --arch ARCH --out bench/results/fullwidth_bench/ARCH`);
this rewrites the work folder's absolute path into `$WORK` in their text files and tabulates diffusers eager
(PyTorch fp32) against ONNX Runtime fp32: end-to-end and per-step latency, peak RSS, model size.

    python bench/fullwidth_report.py [bench/results/fullwidth_bench]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
ORDER = ("sdxl", "sd3", "flux", "qwenimage")
GiB = 2**30


def main() -> None:
    from sd15_report import portable

    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results" / "fullwidth_bench"
    lines = ["# `bench --arch` on the new families (random weights at the released widths, fewer blocks)", "",
             "diffusers eager (PyTorch fp32, the pipeline class of the folder with its own scheduler) against ONNX "
             "Runtime fp32 (host loop, same sampler), batch 1, same initial latents; latency is the median of the "
             "interleaved repeats; peak RSS of a fresh process that loads the variant and generates one image. The "
             "machine (2 cores) was shared with other jobs: treat ratios as indicative. Configs: "
             "`src/onnxdiffusion/bench/arch/fullwidth.py` (profile `bench`), stated per row.", "",
             "| arch | config (backbone depth / released; encoders) | size | steps | PyTorch e2e s | ORT e2e s | "
             "speedup | PyTorch step s | ORT step s | PyTorch peak RSS GiB | ORT peak RSS GiB | ORT model GiB |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for arch in ORDER:
        res_path = folder / arch / "results.json"
        if not res_path.is_file():
            continue
        res = json.loads(res_path.read_text())
        work = str(Path(res["model"]).parent)
        if work.startswith("/"):
            portable(folder / arch, {work: "$WORK", str(ROOT): "$REPO"})
            res = json.loads(res_path.read_text())
        rows = {r["name"]: r for r in res["variants"]}
        pt, ort = rows.get("torch-fp32", {}), rows.get("ort-fp32", {})
        t_pt, t_ort = pt.get("timing") or {}, ort.get("timing") or {}
        note = next((n for n in res["notes"] if n.startswith(f"--arch {arch}:")), "")
        config = note.split("Built: ", 1)[1].split("; config", 1)[0] if "Built: " in note else "-"
        s = res["settings"]
        gib = lambda b: None if b is None else b / GiB  # noqa: E731
        lines.append(
            f"| {arch} | {config} | {s['height']}x{s['width']} | {s['steps']} | {f(t_pt.get('e2e_median_s'))} | "
            f"{f(t_ort.get('e2e_median_s'))} | {f(ort.get('speedup_vs_ref'))}x | "
            f"{f(t_pt.get('backbone_step_median_s'), 3)} | {f(t_ort.get('backbone_step_median_s'), 3)} | "
            f"{f(gib(pt.get('peak_rss_bytes')))} | {f(gib(ort.get('peak_rss_bytes')))} | "
            f"{f(gib(ort.get('size_bytes')))} |")
    lines += ["", "Per-arch details (every column, plots, the noise images): `ARCH/report.html`, `ARCH/results.json`."]
    out = folder / "README.md"
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
