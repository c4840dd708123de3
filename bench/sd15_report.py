#!/usr/bin/env python
"""The committed full-size report: bench/report_sd15/README.md from the runs' JSON, with portable paths.

Reads what the full-size runs wrote under bench/report_sd15/ (each `bench --arch sd15` run in its own
sub-folder, the roofline JSON beside them), rewrites absolute paths of this machine (the work folder,
the checkout) into placeholders in every text file there, and writes README.md: the acceptance
numbers of issue 16 with the machine's load during each run.

    python bench/sd15_report.py bench/report_sd15 --work /tmp/sd15-bench
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def portable(folder: Path, replacements: dict[str, str]) -> None:
    for p in folder.rglob("*"):
        if p.suffix not in (".json", ".csv", ".html", ".md") or not p.is_file():
            continue
        text = p.read_text(errors="replace")
        new = text
        for old, placeholder in sorted(replacements.items(), key=lambda kv: -len(kv[0])):
            new = new.replace(old, placeholder)
        if new != text:
            p.write_text(new)


def _row(results: dict, name: str) -> dict | None:
    return next((r for r in results["variants"] if r["name"] == name and r["status"] == "ok"), None)


def _t(row: dict | None, key: str):
    return (row or {}).get("timing", {}).get(key)


def bench_table(results: dict) -> list[str]:
    s = results["settings"]
    m = results["machine"]
    lines = [f"Settings: {s['height']}x{s['width']}, {s['steps']} DDIM steps, guidance {s['guidance']}, batch 1, "
             f"threads {s['threads'] or 'library default (all cores)'}, {s['repeats']} interleaved repeats. "
             f"Load average at start {m.get('loadavg')}, at end {m.get('loadavg_end')} on {m.get('cpus')} cores.",
             "",
             "| variant | status | e2e median s | CPU s (all threads) | step median s | text enc s | VAE s | "
             "peak RSS GB | size GB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in results["variants"]:
        t = r.get("timing") or {}
        rss = r.get("peak_rss_bytes")
        size = r.get("size_bytes")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r.get('reason') or '')[:160]}"
        lines.append(f"| {r['name']} | {status} | {f(t.get('e2e_median_s'))} | {f(t.get('e2e_cpu_median_s'))} | "
                     f"{f(t.get('backbone_step_median_s'), 3)} | {f(t.get('text_encoder_median_s'), 3)} | "
                     f"{f(t.get('vae_median_s'), 3)} | {f(rss / GB if rss else None)} | {f(size / GB if size else None)} |")
    return lines


def acceptance(results: dict, best_int8: str) -> list[str]:
    torch, ours, q = _row(results, "torch-fp32"), _row(results, "ort-fp32"), _row(results, best_int8)
    out = []
    if torch and q:
        for key, what in (("e2e_median_s", "wall"), ("e2e_cpu_median_s", "CPU time")):
            if _t(torch, key) and _t(q, key):
                out.append(f"- {best_int8} end to end vs diffusers eager fp32 ({what}): "
                           f"{_t(torch, key) / _t(q, key):.2f}x faster (target >= 3x)")
    if ours and q and _t(ours, "backbone_step_median_s") and _t(q, "backbone_step_median_s"):
        out.append(f"- {best_int8} per-step backbone vs our fp32: "
                   f"{_t(q, 'backbone_step_median_s') / _t(ours, 'backbone_step_median_s'):.2f}x (target <= 0.5x)")
    if torch and q and torch.get("peak_rss_bytes") and q.get("peak_rss_bytes"):
        out.append(f"- {best_int8} peak RSS vs diffusers eager: {q['peak_rss_bytes'] / torch['peak_rss_bytes']:.2f}x "
                   f"(target <= 0.5x)")
    for peer in ("openvino-int8-hybrid", "sdcpp-q8_0"):
        p = _row(results, peer)
        if p and q:
            for key, what in (("e2e_median_s", "wall"), ("e2e_cpu_median_s", "CPU time")):
                if _t(p, key) and _t(q, key):
                    out.append(f"- {best_int8} vs {peer} ({what}): {_t(p, key) / _t(q, key):.2f}x (> 1: ours faster)")
        elif not p:
            r = next((r for r in results["variants"] if r["name"] == peer), None)
            out.append(f"- {peer}: not measured ({(r or {}).get('reason') or 'not in this run'})")
    if ours and ours.get("peak_rss_bytes") and ours.get("size_bytes"):
        out.append(f"- our fp32 pipeline peak RSS / model bytes on disk: "
                   f"{ours['peak_rss_bytes'] / ours['size_bytes']:.2f}x (target <= 1.3x)")
    if ours and q and ours.get("peak_rss_bytes") and q.get("peak_rss_bytes"):
        out.append(f"- {best_int8} peak RSS / our fp32 pipeline's: {q['peak_rss_bytes'] / ours['peak_rss_bytes']:.2f}x "
                   f"(target <= 0.4x)")
    return out


def memory_section(mem: dict) -> list[str]:
    """Peak RSS per variant (fresh process: load + one 256x256 image, 2 steps) against its bytes on disk."""
    lines = ["", "## Memory at full size (peak RSS, not affected by load)", "",
             "Each variant in a fresh process (`onnxdiffusion.bench.memory`): load the pipeline, one 256x256 image "
             "(2 DDIM steps, guidance 7.5, 1 thread), VmHWM.", "",
             "| variant | model bytes on disk GB | peak RSS GB | peak / disk | after load GB |", "|---|---:|---:|---:|---:|"]
    for r in mem["variants"]:
        lines.append(f"| {r['variant']} | {r['disk_bytes'] / GB:.2f} | {r['peak_rss_bytes'] / GB:.2f} | "
                     f"{r['peak_rss_bytes'] / r['disk_bytes']:.2f}x | {r['after_load_rss_bytes'] / GB:.2f} |")
    by = {r["variant"]: r for r in mem["variants"]}
    if "ort-fp32" in by:
        lines += ["", f"- acceptance 4, fp32: peak RSS / bytes on disk = "
                      f"{by['ort-fp32']['peak_rss_bytes'] / by['ort-fp32']['disk_bytes']:.2f}x (target <= 1.3x)"]
        for name, r in by.items():
            if name != "ort-fp32":
                lines.append(f"- acceptance 4, {name}: peak RSS / fp32 pipeline's = "
                             f"{r['peak_rss_bytes'] / by['ort-fp32']['peak_rss_bytes']:.2f}x (target <= 0.4x)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--work", default="/tmp/sd15-bench")
    ap.add_argument("--best-int8", default="ort-int8-static")
    ap.add_argument("--intro", type=Path, help="markdown placed before the generated sections")
    args = ap.parse_args(argv)
    portable(args.folder, {str(Path(args.work).resolve()): "$WORK", args.work: "$WORK", str(ROOT): "."})
    parts = [args.intro.read_text() if args.intro else "# Full-size (SD1.5-sized) report\n"]
    for sub in sorted(p for p in args.folder.iterdir() if (p / "results.json").is_file()):
        res = json.loads((sub / "results.json").read_text())
        parts += [f"\n## {sub.name}\n", *bench_table(res), "", "Acceptance (issue 16):", "",
                  *acceptance(res, args.best_int8), ""]
    for rf in sorted(args.folder.glob("roofline*.md")):
        parts += ["", rf.read_text()]
    mem = args.folder / "memory.json"
    if mem.is_file():
        parts += memory_section(json.loads(mem.read_text()))
    (args.folder / "README.md").write_text("\n".join(parts) + "\n")
    print((args.folder / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
