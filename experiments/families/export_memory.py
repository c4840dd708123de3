#!/usr/bin/env python
"""Export peak memory vs the exported component's bytes (issue 11, acceptance 5).

For each arch (sdxl, sd3, flux, qwenimage): build a full-width random-weight pipeline folder
(src/onnxdiffusion/bench/arch/fullwidth.py, profile `memory`: the released widths, the backbone's depth reduced to what fits
this machine), then, in a fresh process, run the project's export of its backbone exactly as
`onnxdiffusion export` does (onnxdiffusion.export.pipeline.export_pipeline: load, TorchScript export,
external data, ONNX checker, ONNX Runtime validation at two shapes). Reported: the process's peak RSS
(VmHWM), its RSS after imports, the component's bytes on disk, peak / bytes, and the peak of each
phase of the export (VmHWM reset at every phase boundary through /proc/self/clear_refs, so the
phase that sets the overall peak is named).

    python experiments/families/export_memory.py sd3 [--depth 13] [--work /tmp/expmem] [--keep]
    python experiments/families/export_memory.py --table            # experiments/families/export_memory.md from the JSON
Results are merged (by arch) into experiments/families/export_memory.json and the table is rewritten.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "export_memory.json"
TABLE = Path(__file__).resolve().parent / "export_memory.md"
LIMIT = 2.5
GiB = 2**30


class Meter:
    """Peak RSS per phase: every mark closes the running segment (its VmHWM) and resets VmHWM."""

    def __init__(self) -> None:
        from onnxdiffusion.bench.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss

        self._cur, self._peak, self._reset = current_rss_bytes, peak_rss_bytes, reset_peak_rss
        self.peak = 0
        self.segments: list[dict] = []
        self.label = "imports"
        self._start = 0
        self.resettable = reset_peak_rss()

    def mark(self, label: str) -> None:
        hwm = self._peak()
        self.peak = max(self.peak, hwm)
        now = self._cur()
        self.segments.append({"phase": self.label, "rss_at_start_bytes": self._start, "peak_rss_bytes": hwm,
                              "rss_at_end_bytes": now})
        self._reset()
        self._start = now
        self.label = label

    def wrap(self, owner, attr: str, label: str, after: str) -> None:
        fn = getattr(owner, attr)

        def wrapped(*a, **kw):
            self.mark(label)
            try:
                return fn(*a, **kw)
            finally:
                self.mark(after)

        setattr(owner, attr, wrapped)


def child(src: Path, out: Path) -> dict:
    import onnx
    import onnxruntime
    import torch

    import onnxdiffusion.export.pipeline as pipeline_mod
    import onnxdiffusion.export.validate as validate_mod
    from onnxdiffusion.export.pipeline import ExportOptions, export_pipeline
    from onnxdiffusion.families import family_for_pipeline

    meter = Meter()
    base = meter._cur()
    backbone = family_for_pipeline(json.loads((src / "model_index.json").read_text())["_class_name"]).backbone
    meter.wrap(pipeline_mod, "_load", "load (from_pretrained, mmap)", "attention fusion, dummy inputs")
    meter.wrap(validate_mod, "_outputs", "PyTorch reference outputs", "between references")
    meter.wrap(torch.onnx, "export", "torch.onnx.export", "release torch module")
    meter.wrap(validate_mod, "consolidate", "external data consolidate", "between")
    meter.wrap(onnx.checker, "check_model", "onnx checker", "between")
    meter.wrap(onnxruntime, "InferenceSession", "ORT session create", "ORT validation runs")
    meter.mark("setup")
    t0 = time.time()
    manifest = export_pipeline(src, out, ExportOptions(components=(backbone,), overwrite=True), progress=False)
    seconds = time.time() - t0
    meter.mark("end")
    entry = manifest["components"][backbone]
    return {"component": backbone, "component_bytes": entry["bytes"], "external_data": entry["external_data"],
            "peak_rss_bytes": meter.peak, "rss_after_imports_bytes": base, "export_s": round(seconds, 1),
            "validation": entry.get("validation"), "phase_peaks_resettable": meter.resettable,
            "phases": meter.segments,
            "versions": {k: manifest["tool_versions"][k] for k in ("torch", "diffusers", "onnx", "onnxruntime")}}


def measure(arch: str, depth: str | None, work: Path, keep: bool) -> dict:
    src, out = work / f"{arch}-src", work / f"{arch}-onnx"
    desc_path = src / "fullwidth.json"
    want = None
    if depth is not None:
        want = [int(p) for p in depth.split(",")]
        want = want[0] if len(want) == 1 else want
    if not desc_path.is_file() or (want is not None and json.loads(desc_path.read_text())["backbone_depth"] != want):
        cmd = [sys.executable, "-m", "onnxdiffusion.bench.arch.fullwidth", "build", arch, str(src), "--profile", "memory"]
        if depth is not None:
            cmd += ["--depth", depth]
        print("build:", " ".join(cmd[1:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
    desc = json.loads(desc_path.read_text())
    from onnxdiffusion.bench.arch.fullwidth import count_params

    depth_ = desc["backbone_depth"]
    params = count_params(arch, tuple(depth_) if isinstance(depth_, list) else depth_)
    proc = subprocess.run([sys.executable, __file__, "--child", str(src), str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"export child failed:\n{proc.stderr[-4000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    row = {"arch": arch, **desc, "params": params, **row}
    row["peak_over_component"] = round(row["peak_rss_bytes"] / row["component_bytes"], 3)
    row["peak_minus_imports_over_component"] = round(
        (row["peak_rss_bytes"] - row["rss_after_imports_bytes"]) / row["component_bytes"], 3)
    row["holds"] = row["peak_over_component"] <= LIMIT
    row["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "shared": True}
    return row


def _gib(b: float) -> str:
    return f"{b / GiB:.2f}"


def table(rows: list[dict]) -> str:
    lines = [
        "# Export peak memory (issue 11, acceptance 5)",
        "",
        f"Peak RSS (VmHWM) of a fresh process running `export_pipeline` on the backbone, vs the exported "
        f"component's bytes on disk; limit {LIMIT}x. Random weights at the released widths, depth reduced to fit "
        "this 24 GB machine (shared with other jobs; measured one at a time). "
        "Reproduce: `python experiments/families/export_memory.py ARCH` (see src/onnxdiffusion/bench/arch/fullwidth.py for the configs).",
        "",
        "| arch | export code | backbone (depth measured / released) | params | component GiB | peak RSS GiB | after imports GiB "
        "| peak / component | (peak - imports) / component | phase setting the peak | export s | holds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        top = max(r["phases"], key=lambda s: s["peak_rss_bytes"])
        lines.append(
            f"| {r['arch']} | {r.get('code') or 'this branch'} | {r['backbone_class']} {r['backbone_depth']} / {r['released_depth']} | "
            f"{r['params'] / 1e9:.2f} B | {_gib(r['component_bytes'])} | {_gib(r['peak_rss_bytes'])} | "
            f"{_gib(r['rss_after_imports_bytes'])} | {r['peak_over_component']:.2f}x | "
            f"{r['peak_minus_imports_over_component']:.2f}x | {top['phase']} | {r['export_s']:.0f} | "
            f"{'yes' if r['holds'] else 'NO'} |")
    lines += [
        "",
        "Where the memory goes (this branch): the torch weights are memory-mapped from the safetensors files and paged in "
        "by the PyTorch reference outputs (computed before the export); torch.onnx.export adds its constant-folded "
        "weight copies (+10-25% of the component) and writes external data tensor by tensor; the torch module is then "
        "released, and ONNX Runtime's validation session (no weight pre-packing, no CPU arena) maps the external data, "
        "so its runs page in one copy. The two copies are never resident together.",
        "",
        "`before` row: the same export on main before this branch (measured once, SD3 at 13 blocks): the torch module "
        "stayed referenced while ONNX Runtime loaded and pre-packed its own copy, so the peak was both copies at "
        "session load. Below 2 GB (no external data) torch.onnx.export serializes the whole model in memory: SD3 at 2 "
        "blocks (0.80 GiB) peaked at 4.8x, inside torch's exporter (not changed here; components that size peak "
        "under 10 GB).",
        "",
        "Peak RSS per export phase, in order (GiB; VmHWM reset at each boundary):", "",
        "| arch (depth) | phases |", "|---|---|"]
    for r in rows:
        if r.get("code"):
            continue
        parts = [f"{s['phase']} {_gib(s['peak_rss_bytes'])}" for s in r["phases"]
                 if s["phase"] not in ("imports", "setup", "between", "between references")]
        lines.append(f"| {r['arch']} ({r['backbone_depth']}) | " + " · ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch", nargs="?", choices=("sdxl", "sd3", "flux", "qwenimage"))
    ap.add_argument("--depth", help="backbone depth override (see src/onnxdiffusion/bench/arch/fullwidth.py)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/onnxdiffusion-expmem"))
    ap.add_argument("--keep", action="store_true", help="keep the exported folder")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    rows = json.loads(args.results.read_text()) if args.results.is_file() else []
    if args.arch:
        args.work.mkdir(parents=True, exist_ok=True)
        row = measure(args.arch, args.depth, args.work, args.keep)
        rows = [r for r in rows if (r["arch"], r["backbone_depth"], r.get("code", "")) !=
                (row["arch"], row["backbone_depth"], "")] + [row]
        order = {"sdxl": 0, "sd3": 1, "flux": 2, "qwenimage": 3}
        rows.sort(key=lambda r: (order[r["arch"]], r.get("code", ""), r["params"]))
        args.results.parent.mkdir(parents=True, exist_ok=True)
        _write(args.results, json.dumps(rows, indent=1) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("phases", "backbone_config")}))
    if rows:
        _write(args.results.with_suffix(".md"), table(rows))


if __name__ == "__main__":
    main()
