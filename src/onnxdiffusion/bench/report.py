"""Bench output: results.json, results.csv, PNG plots and one self-contained report.html.

Plots are drawn with matplotlib (Agg, no display); every axis is labelled with its unit. The HTML
embeds the PNGs as base64 data URIs so the file can be mailed or opened anywhere; `embed=False`
(bench --link-images, used for the reports committed to the repository) links the PNGs beside it instead,
so their bytes are stored once.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from pathlib import Path

import numpy as np

from ..folder.artifacts import atomic_write_bytes
from .plots import plot_error_growth, plot_grid, plot_latency, plot_memory_size, plot_pareto

MiB = 1024 * 1024

# (key, header, unit/help) — the summary table, everywhere
COLUMNS = [
    ("name", "variant", ""),
    ("precision", "precision", ""),
    ("sampler", "sampler", "what every row runs (a peer that cannot run the bench's sampler is refused)"),
    ("calls", "calls", "backbone calls per image, counted (a batched CFG pair: one); like with like: the same in "
                       "every row but *-dpmpp"),
    ("loop", "loop", ""),
    ("size_mib", "size MiB", "on disk, components loaded"),
    ("load_s", "load s", "session creation (hash check excluded)"),
    ("first_call_s", "1st call s", "first generation after load"),
    ("te_ms", "text enc ms", "median per image"),
    ("step_ms", "step ms", "backbone + sampler update, median per step"),
    ("vae_ms", "VAE ms", "median per image"),
    ("e2e_s", "e2e s", "median end to end, batch 1"),
    ("p90_s", "p90 s", "90th percentile end to end"),
    ("cpu_s", "CPU s", "median CPU time per image, all threads (1 thread: the load-proof measure)"),
    ("speedup", "speedup", "reference median / this median"),
    ("rss_mib", "peak RSS MiB", "the highest phase (load, first image, steady repeats); a peer's one-off conversion "
                                "is not in it"),
    ("phase_mib", "RSS by phase MiB", "peak per phase: load / first image / steady (- where not measured apart)"),
    ("convert_mib", "convert MiB", "a peer's one-off conversion (IR, GGUF), its own process: reported apart"),
    ("psnr", "PSNR dB", "vs fp32 images, same prompt+seed"),
    ("ssim", "SSIM", "vs fp32 images"),
    ("attr", "attr acc", "judge attribute accuracy"),
    ("strict", "strict acc", "judge strict prompt accuracy"),
    ("fd", "FD", "Frechet distance to real images (judge embedding)"),
    ("rel_l2", "final rel L2", "final latents vs fp32"),
]


def _f(v, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, fmt)


def summary_rows(results: dict) -> list[dict]:
    """One dict of display strings per variant that ran (COLUMNS' keys), plus raw numbers under '_raw'."""
    rows = []
    for r in results["variants"]:
        if r["status"] != "ok":
            continue
        t = r.get("timing") or {}
        q = r.get("quality") or {}
        steps = f"{r['sampler']} {r['steps']}"
        mem = r.get("memory") or {}
        phases = mem.get("phase_peak_rss_bytes") or {}
        conv = (mem.get("convert") or {}).get("peak_rss_bytes")
        raw = {
            "size_mib": (r.get("size_bytes") or 0) / MiB if r.get("size_bytes") else None,
            "load_s": r.get("load_s"),
            "first_call_s": r.get("first_call_s"),
            "te_ms": t.get("text_encoder_median_s") * 1e3 if t.get("text_encoder_median_s") is not None else None,
            "step_ms": t.get("backbone_step_median_s") * 1e3 if t.get("backbone_step_median_s") is not None else None,
            "vae_ms": t.get("vae_median_s") * 1e3 if t.get("vae_median_s") is not None else None,
            "e2e_s": t.get("e2e_median_s"),
            "p90_s": t.get("e2e_p90_s"),
            "cpu_s": t.get("e2e_cpu_median_s"),
            "speedup": r.get("speedup_vs_ref"),
            "rss_mib": r["peak_rss_bytes"] / MiB if r.get("peak_rss_bytes") else None,
            "convert_mib": conv / MiB if conv else None,
            "psnr": q.get("psnr_db"),
            "ssim": q.get("ssim"),
            "attr": q.get("attribute_accuracy"),
            "strict": q.get("strict_accuracy"),
            "fd": q.get("frechet_distance"),
            "rel_l2": q.get("final_latent_rel_l2"),
        }
        fmt = {"size_mib": ".1f", "load_s": ".2f", "first_call_s": ".3f", "te_ms": ".1f", "step_ms": ".1f",
               "vae_ms": ".1f", "e2e_s": ".3f", "p90_s": ".3f", "cpu_s": ".3f", "speedup": ".2f", "rss_mib": ".0f",
               "convert_mib": ".0f", "psnr": ".1f",
               "ssim": ".4f", "attr": ".3f", "strict": ".3f", "fd": ".2f", "rel_l2": ".2e"}
        row = {"name": r["name"], "precision": r["precision"], "sampler": steps,
               "loop": r["loop"] if r["kind"] != "peer" else r["name"].split("-")[0]}
        row.update({k: _f(v, fmt[k]) for k, v in raw.items()})
        row["calls"] = _f(r.get("backbone_calls"), "")
        row["phase_mib"] = " / ".join(_f(phases[k] / MiB if phases.get(k) else None, ".0f")
                                      for k in (("load", "image") if "image" in phases else ("load", "first", "steady")))
        if raw["speedup"] is not None:
            row["speedup"] += "x"
        row["_raw"] = raw
        rows.append(row)
    return rows


def visible_columns(results: dict) -> list[tuple[str, str, str]]:
    """Drop quality columns that no variant has (e.g. --arch sd15, no judge)."""
    rows = summary_rows(results)
    keep = []
    for key, head, unit in COLUMNS:
        if key in ("psnr", "ssim", "attr", "strict", "fd", "rel_l2", "convert_mib") and \
                all(r["_raw"].get(key) is None for r in rows):
            continue
        keep.append((key, head, unit))
    return keep


def text_table(results: dict) -> str:
    rows = summary_rows(results)
    cols = visible_columns(results)
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h, _ in cols]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, ((k, h, _), w) in enumerate(zip(cols, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(r[k].ljust(w) if i == 0 else r[k].rjust(w) for i, ((k, _, _), w) in enumerate(zip(cols, widths))))
    skipped = [v for v in results["variants"] if v["status"] != "ok"]
    if skipped:
        lines.append("")
        lines.append("not run:")
        for v in skipped:
            lines.append(f"  {v['name']}: {v['status']}: {v['reason']}")
    return "\n".join(lines)


SPEED_KEYS = ("name", "precision", "sampler", "calls", "loop", "size_mib", "load_s", "first_call_s", "te_ms", "step_ms",
              "vae_ms", "e2e_s", "p90_s", "cpu_s", "speedup", "rss_mib", "phase_mib", "convert_mib")
QUALITY_KEYS = ("name", "psnr", "ssim", "attr", "strict", "fd", "rel_l2")


def print_table(results: dict, console=None) -> None:
    """The summary on the terminal (rich when available): a speed/memory/size table and a quality table."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.markup import escape
    except ImportError:
        print(text_table(results))
        return
    import shutil

    console = console or Console(width=max(shutil.get_terminal_size((200, 40)).columns, 200))
    cols = visible_columns(results)
    rows = summary_rows(results)
    name = Path(results["model"]).name if not results.get("arch") else f"--arch {results['arch']} (random weights)"
    titles = {SPEED_KEYS: f"bench {name}: speed, memory, size (speed reference {results.get('speed_reference')})",
              QUALITY_KEYS: f"bench {name}: quality (fidelity reference {results.get('fidelity_reference')})"}
    for keys, title in titles.items():
        use = [c for c in cols if c[0] in keys]
        if len(use) <= 1 or not rows:
            continue
        table = Table(title=escape(title), title_justify="left")
        for i, (k, h, _) in enumerate(use):
            table.add_column(h, justify="left" if k in ("name", "precision", "sampler", "loop") else "right",
                             no_wrap=True)
        for r in rows:
            table.add_row(*[escape(str(r[k])) for k, _, _ in use])
        console.print(table)
    for v in results["variants"]:
        if v["status"] != "ok":
            # escape: reasons hold commands like pip install -e '.[export]' that Rich would read as markup
            console.print(f"[yellow]{escape(str(v['status']))}[/] {escape(str(v['name']))}: {escape(str(v['reason']))}",
                          highlight=False, soft_wrap=True)


# --- results files -------------------------------------------------------------------------------------
def _jsonable(obj):
    if isinstance(obj, float):
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        if math.isnan(obj):
            return None
        return obj
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating,)):
        return _jsonable(float(obj))
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_csv(path: Path, results: dict) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    keys = [k for k, _, _ in COLUMNS]
    w.writerow(keys[:1] + ["status", "reason"] + keys[1:])
    raw = {r["name"]: r["_raw"] for r in summary_rows(results)}
    by = {r["name"]: r for r in summary_rows(results)}
    for v in results["variants"]:
        row = [v["name"], v["status"], v["reason"] or ""]
        for k in keys[1:]:
            if v["name"] in raw:
                val = raw[v["name"]][k] if k in raw[v["name"]] else by[v["name"]].get(k)
                if isinstance(val, float):
                    val = "inf" if math.isinf(val) else f"{val:.6g}"
                row.append("" if val is None else val)
            else:
                row.append({"precision": v["precision"], "sampler": f"{v['sampler']} {v['steps']}",
                            "loop": v["loop"]}.get(k, ""))
        w.writerow(row)
    atomic_write_bytes(path, buf.getvalue().encode())


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:12px} th,td{border:1px solid #ddd;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f3f3f3;white-space:normal;vertical-align:bottom} .scroll{overflow-x:auto} td.l,th.l{text-align:left} tr:nth-child(even) td{background:#fafafa}
.meta{color:#555;font-size:13px} .skip td{color:#8a5a00} img.plot{max-width:100%;border:1px solid #eee;margin:6px 0}
code{background:#f4f4f4;padding:1px 4px;border-radius:3px} .note{font-size:13px;color:#444}
"""


def _img_tag(png: Path, alt: str, cls: str = "plot", embed: bool = True) -> str:
    src = f"data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}" if embed else html.escape(png.name)
    return f'<img class="{cls}" id="{html.escape(png.stem)}" alt="{html.escape(alt)}" src="{src}">'


def write_html(path: Path, results: dict, plots: dict[str, Path], embed: bool = True) -> None:
    e = html.escape
    s = results["settings"]
    cols = visible_columns(results)
    rows = summary_rows(results)
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>onnxdiffusion bench</title>",
           f"<style>{_CSS}</style></head><body>"]
    title = Path(results["model"]).name if not results.get("arch") else f"--arch {results['arch']} (random weights, full size)"
    main = next((r["sampler"] for r in results["variants"] if r["name"] == "ort-fp32"), "ddim")
    from .variants import SAMPLER_LABELS

    main = SAMPLER_LABELS.get(main, main)
    out.append(f"<h1>onnxdiffusion bench — {e(title)}</h1>")
    out.append(f"<p class='meta'>{e(results['created'])} · model <code>{e(results['model'])}</code>"
               + (f" · diffusers source <code>{e(results['source'])}</code>" if results.get("source") else "")
               + f"<br>{e(main)} {s['steps']} steps (DPM-Solver++ 2M {s['fast_steps']} steps for *-dpmpp), guidance {s['guidance']}, "
               f"{s['height']}x{s['width']}, threads {s['threads'] or 'library default'} · timed job: {e(s['timed_job'])}, "
               f"{s['repeats']} interleaved repeats after a first call and the quality pass · "
               + (f"quality: {s['prompts']} held-out prompts, per-item seeds" if s['prompts'] else "no quality pass")
               + f" · speed reference <b>{e(str(results.get('speed_reference')))}</b>, fidelity reference "
               f"<b>{e(str(results.get('fidelity_reference')))}</b> · bench took {results.get('bench_seconds', 0):.0f} s</p>")
    m = results.get("machine", {})
    out.append(f"<p class='meta'>machine: {e(str(m.get('cpu')))}, {m.get('cpus')} CPUs, "
               f"{(m.get('mem_total_bytes') or 0) / 2**30:.0f} GiB RAM, load average (1/5/15 min) at start "
               f"{e(' '.join(m.get('loadavg') or []))}, at end {e(' '.join(m.get('loadavg_end') or []))}; "
               f"{e(m.get('platform', ''))}</p>")
    out.append("<h2>Summary</h2><div class='scroll'><table id='summary'><tr>")
    for i, (k, h, unit) in enumerate(cols):
        out.append(f"<th class='{'l' if i < 4 else ''}' title='{e(unit)}'>{e(h)}</th>")
    out.append("</tr>")
    for r in rows:
        out.append("<tr>" + "".join(f"<td class='{'l' if i < 4 else ''}'>{e(r[k])}</td>" for i, (k, _, _) in enumerate(cols)) + "</tr>")
    out.append("</table></div>")
    out.append("<p class='note'>" + " · ".join(f"<b>{e(h)}</b>: {e(u)}" for _, h, u in cols if u) + "</p>")
    skipped = [v for v in results["variants"] if v["status"] != "ok"]
    if skipped:
        out.append("<h2>Not run</h2><table id='skipped'><tr><th class='l'>variant</th><th class='l'>status</th><th class='l'>reason</th></tr>")
        for v in skipped:
            out.append(f"<tr class='skip'><td class='l'>{e(v['name'])}</td><td class='l'>{e(v['status'])}</td>"
                       f"<td class='l' style='white-space:normal'>{e(str(v['reason']))}</td></tr>")
        out.append("</table>")
    titles = {"latency": "Latency per component", "pareto": "Quality vs latency", "error_growth": "Error growth per step",
              "memory_size": "Memory and size", "image_grid": "Image grid: fp32 vs each variant, same seeds"}
    for key, title in titles.items():
        if key in plots:
            out.append(f"<h2>{e(title)}</h2>{_img_tag(plots[key], title, embed=embed)}")
    if results.get("notes"):
        out.append("<h2>Notes</h2><ul class='note'>" + "".join(f"<li>{e(n)}</li>" for n in results["notes"]) + "</ul>")
    out.append("<h2>How it was measured</h2><ul class='note'>"
               "<li>All variants are loaded in one process (peers in their own venv's worker process, timed inside it) and "
               "the timed repeats interleave them, rotating the order each round.</li>"
               "<li>Component times: text encoder and VAE by wrapping those calls; the step time is the time between "
               "per-step events (host loops) or the sampling time divided by the step count (one-graph loops).</li>"
               f"<li>Peak RSS: {e(results.get('memory_method', ''))}.</li>"
               "<li>Fidelity: PSNR pooled over all quality images, SSIM the mean per image (11x11 Gaussian window), final "
               "rel L2 over the final latents; error curves compare the latents after every step with the reference's "
               "(host-loop variants with the reference's sampler and step count only).</li>"
               "<li>Judge accuracy and Fréchet distance use the shipped scene judge on the quality images; the Fréchet "
               "distance is against renders of the same held-out scenes and is noisy with few prompts.</li></ul>")
    out.append("<h2>Details</h2><table id='details'><tr><th class='l'>variant</th><th class='l'>label</th><th>verify s</th>"
               "<th>load s</th><th>e2e min s</th><th>sampling s</th><th>baseline RSS MiB</th><th class='l'>step time from</th>"
               "<th class='l'>versions / notes</th></tr>")
    for v in results["variants"]:
        if v["status"] != "ok":
            continue
        t, ld, mem = v.get("timing") or {}, v.get("load") or {}, v.get("memory") or {}
        out.append(f"<tr><td class='l'>{e(v['name'])}</td><td class='l'>{e(v['label'])}</td><td>{_f(ld.get('verify_s'), '.2f')}</td>"
                   f"<td>{_f(v.get('load_s'), '.2f')}</td><td>{_f(t.get('e2e_min_s'), '.3f')}</td>"
                   f"<td>{_f(t.get('sampling_median_s'), '.3f')}</td>"
                   f"<td>{_f((mem.get('baseline_rss_bytes') or 0) / MiB if mem.get('baseline_rss_bytes') else None, '.0f')}</td>"
                   f"<td class='l'>{e(t.get('backbone_step_source', ''))}</td>"
                   f"<td class='l' style='white-space:normal'>{e(_versions_note(ld, v))}</td></tr>")
    out.append("</table><p class='meta'>Raw numbers: results.json, results.csv beside this file.</p></body></html>")
    atomic_write_bytes(path, "\n".join(out).encode())


def _versions_note(load: dict, v: dict) -> str:
    parts = [f"{k} {val}" for k, val in (load.get("versions") or {}).items() if val]
    if load.get("convert_s") is not None:
        parts.append(f"IR conversion {load['convert_s']:.1f} s (cached)")
    if load.get("shared_pipeline"):
        parts.append("pipeline shared with another variant of the same folder")
    parts += v.get("notes") or []
    return "; ".join(parts)


def write_all(out: Path, results: dict, image_sets: dict, embed: bool = True) -> dict:
    """Write every output file under `out`; returns {kind: path}. `embed`: report.html embeds the PNGs (else links)."""
    out = Path(out)
    files: dict[str, str] = {}
    plots: dict[str, Path] = {}
    makers = [("latency", lambda p: (plot_latency(p, results), True)[1]), ("pareto", lambda p: plot_pareto(p, results)),
              ("error_growth", lambda p: plot_error_growth(p, results)),
              ("memory_size", lambda p: plot_memory_size(p, results)),
              ("image_grid", lambda p: plot_grid(p, results, image_sets))]
    if not any(r["status"] == "ok" and r.get("timing") for r in results["variants"]):
        makers = []
    for key, make in makers:
        p = out / f"{key}.png"
        if make(p):
            plots[key] = p
            files[key] = str(p)
        elif p.exists():
            p.unlink()
    files["results_json"] = str(out / "results.json")
    files["results_csv"] = str(out / "results.csv")
    files["report_html"] = str(out / "report.html")
    results["files"] = {k: Path(v).name for k, v in files.items()}  # beside results.json; no machine path
    atomic_write_bytes(out / "results.json", (json.dumps(_jsonable(results), indent=2) + "\n").encode())
    write_csv(out / "results.csv", results)
    write_html(out / "report.html", results, plots, embed=embed)
    return files
