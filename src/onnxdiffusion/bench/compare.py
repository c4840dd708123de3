"""Several models' benches in one report: each model benched alone (its own sampler, steps and guidance,
its own references), then the per-model results joined variant by variant, side by side.

    onnxdiffusion bench models/shapes-sd-onnx models/shapes-mmdit-onnx --out bench-out
    python -m onnxdiffusion.bench.compare OUT A/results.json B/results.json   # join finished runs

OUT/<model>/ holds each model's own bench (results.json, report.html, plots); OUT/results.json,
results.csv, compare.png and report.html the side-by-side view. A variant one model has and another
lacks, or could not run, shows as "n/a (reason)" in that model's column, never dropped.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..folder.artifacts import atomic_write_bytes
from ..errors import UserError

MiB = 1024 * 1024
CELL_KEYS = ("status", "reason", "label", "sampler", "steps", "e2e_median_s", "speedup_vs_ref", "psnr_db",
             "strict_accuracy", "peak_rss_bytes", "size_bytes")


def run_bench_models(options, models: list[Path]) -> dict:
    """`bench` on each model into options.out/<model name>/ (the models' own defaults for what options leave
    None), then the joined report in options.out. Returns the joined results."""
    from .core import run_bench

    if len(models) < 2:
        raise UserError("comparing models needs at least two model folders")
    names = _subfolder_names(models)
    out = Path(options.out)
    per_model = []
    for model, name in zip(models, names):
        per_model.append(run_bench(replace(options, model=Path(model), out=out / name)))
    return write_joined(out, join(per_model, names))


def _subfolder_names(models: list[Path]) -> list[str]:
    names: list[str] = []
    for m in models:
        base = Path(m).resolve().name or "model"
        name, k = base, 2
        while name in names:
            name, k = f"{base}-{k}", k + 1
        names.append(name)
    return names


def _number(v):
    """results.json writes non-finite floats as strings ('inf')."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return v


def _cell(v: dict) -> dict:
    q, t = v.get("quality") or {}, v.get("timing") or {}
    cell = {"status": v["status"], "reason": v.get("reason"), "label": v.get("label"), "sampler": v.get("sampler"),
            "steps": v.get("steps"), "e2e_median_s": t.get("e2e_median_s"), "speedup_vs_ref": v.get("speedup_vs_ref"),
            "psnr_db": _number(q.get("psnr_db")), "strict_accuracy": q.get("strict_accuracy"),
            "peak_rss_bytes": v.get("peak_rss_bytes"), "size_bytes": v.get("size_bytes")}
    if cell["status"] != "ok" and not cell["reason"]:
        cell["reason"] = "did not run"
    return cell


def join(per_model: list[dict], names: list[str] | None = None) -> dict:
    """Per-model bench results -> {models: [...], rows: [{name, cells: {model: cell}}]}; every variant any
    model has is a row, a model without it gets an n/a cell saying so."""
    names = names or _subfolder_names([Path(r["model"]) for r in per_model])
    order: list[str] = []
    for r in per_model:
        order += [v["name"] for v in r["variants"] if v["name"] not in order]
    models = []
    for name, r in zip(names, per_model):
        s = r.get("settings", {})
        main = next((v for v in r["variants"] if v["name"] == "ort-fp32"), None)
        models.append({"name": name, "model": r.get("model"), "source": r.get("source"),
                       "sampler": main.get("sampler") if main else None, "steps": s.get("steps"),
                       "guidance": s.get("guidance"), "prompts": s.get("prompts"), "repeats": s.get("repeats"),
                       "threads": s.get("threads"), "speed_reference": r.get("speed_reference"),
                       "fidelity_reference": r.get("fidelity_reference"), "bench_seconds": r.get("bench_seconds"),
                       "results": f"{name}/results.json", "report": f"{name}/report.html"})
    rows = []
    for vname in order:
        cells = {}
        for name, r in zip(names, per_model):
            v = next((v for v in r["variants"] if v["name"] == vname), None)
            cells[name] = _cell(v) if v is not None else {
                "status": "absent", "reason": f"no such variant for {name} (not found beside it or not requested)"}
        rows.append({"name": vname, "cells": cells})
    return {"what": "onnxdiffusion bench, models side by side", "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "models": models, "rows": rows,
            "machine": next((r.get("machine") for r in per_model if r.get("machine")), None)}


def join_files(out: Path, files: list[Path]) -> dict:
    """Join finished runs' results.json files (one model each) into `out`."""
    per_model = []
    for f in files:
        try:
            per_model.append(json.loads(Path(f).read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read bench results {f}: {e}") from None
        if "variants" not in per_model[-1]:
            raise UserError(f"{f} is not a bench results.json (no 'variants')")
    names = [Path(f).parent.name for f in files]
    if len(set(names)) != len(names):
        names = _subfolder_names([Path(r.get("model") or f"model{i}") for i, r in enumerate(per_model)])
    return write_joined(Path(out), join(per_model, names))


def fmt_cell(c: dict) -> dict[str, str]:
    """Display strings of one model's cell: every column reads n/a (reason) when the variant did not run."""
    if c["status"] != "ok":  # the reason once, in the first column
        return {"latency": f"n/a ({c.get('reason') or c['status']})", "speedup": "n/a", "psnr": "n/a", "rss": "n/a",
                "size": "n/a"}

    def f(v, spec, unit=""):
        v = _number(v)
        if v is None:
            return "-"
        return "inf" if isinstance(v, float) and math.isinf(v) else f"{v:{spec}}{unit}"

    return {"latency": f(c["e2e_median_s"] and c["e2e_median_s"] * 1e3, ".0f", " ms"),
            "speedup": f(c["speedup_vs_ref"], ".2f", "x"), "psnr": f(c["psnr_db"], ".1f", " dB"),
            "rss": f(c["peak_rss_bytes"] and c["peak_rss_bytes"] / MiB, ".0f", " MiB"),
            "size": f(c["size_bytes"] and c["size_bytes"] / MiB, ".1f", " MiB")}


COLUMNS = (("latency", "latency"), ("speedup", "speed-up"), ("psnr", "PSNR"), ("rss", "peak RSS"), ("size", "size"))


def markdown(joined: dict) -> str:
    names = [m["name"] for m in joined["models"]]
    head = ["variant"] + [f"{n}: {h}" for n in names for _, h in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in joined["rows"]:
        cells = [fmt_cell(r["cells"][n]) for n in names]
        lines.append("| " + " | ".join([r["name"]] + [c[k] for c in cells for k, _ in COLUMNS]) + " |")
    return "\n".join(lines)


def write_joined(out: Path, joined: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    files = {"results_json": "results.json", "results_csv": "results.csv", "report_md": "report.md",
             "report_html": "report.html"}
    from .compare_plot import plot_compare

    if plot_compare(out / "compare.png", joined):
        files["compare"] = "compare.png"
    joined["files"] = files  # beside results.json; no machine path
    atomic_write_bytes(out / "results.json", (json.dumps(joined, indent=2, default=str) + "\n").encode())
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["variant", "model"] + list(CELL_KEYS))
    for r in joined["rows"]:
        for name, c in r["cells"].items():
            w.writerow([r["name"], name] + ["" if c.get(k) is None else c.get(k) for k in CELL_KEYS])
    atomic_write_bytes(out / "results.csv", buf.getvalue().encode())
    atomic_write_bytes(out / "report.md", (_settings_md(joined) + "\n\n" + markdown(joined) + "\n").encode())
    atomic_write_bytes(out / "report.html", _html(joined, out).encode())
    return joined


def _settings_lines(joined: dict) -> list[str]:
    out = []
    for m in joined["models"]:
        out.append(f"{m['name']}: {m['sampler']} {m['steps']} steps, guidance {m['guidance']}, {m['prompts']} held-out "
                   f"prompts, {m['repeats']} interleaved repeats, {m['threads']} thread(s); speed-up vs "
                   f"{m['speed_reference']}, PSNR vs {m['fidelity_reference']} (its own fp32 reference)")
    return out


def _settings_md(joined: dict) -> str:
    return "## Bench, models side by side\n\n" + "\n".join(f"- {s}" for s in _settings_lines(joined))


def _html(joined: dict, out: Path) -> str:
    from .report import _CSS, _img_tag

    e = html.escape
    names = [m["name"] for m in joined["models"]]
    h = ["<!doctype html><html><head><meta charset='utf-8'><title>onnxdiffusion bench: models side by side</title>",
         f"<style>{_CSS}</style></head><body>", "<h1>Models side by side</h1>",
         f"<p>{e(joined['created'])}; each model benched with its own sampler, steps and guidance; latency = median "
         "end-to-end of one batch-1 image; speed-up vs the model's own reference; PSNR of the held-out images vs the "
         "model's own fp32 reference.</p><ul>"]
    h += [f"<li>{e(s)} (<a href='{e(m['report'])}'>its report</a>)</li>" for s, m in zip(_settings_lines(joined), joined["models"])]
    h.append("</ul><table><tr><th rowspan=2>variant</th>")
    h += [f"<th colspan={len(COLUMNS)}>{e(n)}</th>" for n in names]
    h.append("</tr><tr>" + "".join(f"<th>{e(c)}</th>" for _ in names for _, c in COLUMNS) + "</tr>")
    for r in joined["rows"]:
        h.append(f"<tr><td style='text-align:left'>{e(r['name'])}</td>")
        for n in names:
            c = r["cells"][n]
            if c["status"] != "ok":
                h.append(f"<td colspan={len(COLUMNS)} style='text-align:left;color:#888'>n/a ({e(c.get('reason') or c['status'])})</td>")
            else:
                h += [f"<td>{e(v)}</td>" for v in fmt_cell(c).values()]
        h.append("</tr>")
    h.append("</table>")
    if (out / "compare.png").exists():
        h.append("<h2>Speed-up and fidelity, both models</h2>" + _img_tag(out / "compare.png", "compare", embed=False))
    h.append("</body></html>")
    return "\n".join(h)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        print("usage: python -m onnxdiffusion.bench.compare OUT RESULTS.json RESULTS.json [...]", file=sys.stderr)
        return 2
    try:
        joined = join_files(Path(args[0]), [Path(a) for a in args[1:]])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(markdown(joined))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
