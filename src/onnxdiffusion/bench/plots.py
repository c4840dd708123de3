"""The bench's PNG plots (matplotlib, Agg, no display); every axis is labelled with its unit."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from ..folder.artifacts import atomic_write_bytes
from ..errors import UserError

MiB = 1024 * 1024


# --- plots -----------------------------------------------------------------------------------------------
def _plt():
    try:
        import matplotlib
    except ImportError:
        raise UserError("the bench's plots need matplotlib: pip install matplotlib "
                        "(or install the dev extra: pip install -e '.[dev]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _save(fig, path: Path, palette: bool = True) -> None:
    """`palette`: a 256-colour PNG: committed reports stay small (plots ~3.6x fewer bytes; image grids ~4x,
    41 dB PSNR vs the RGBA render on the embedded bench's grid; the PSNR labels are computed from the images,
    not from the figure)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    data = buf.getvalue()
    if palette:
        from PIL import Image

        img = Image.open(io.BytesIO(data)).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE)
        buf = io.BytesIO()
        img.save(buf, format="PNG", optimize=True)
        data = buf.getvalue()
    atomic_write_bytes(path, data)
    import matplotlib.pyplot as plt

    plt.close(fig)


def plot_latency(path: Path, results: dict) -> None:
    plt = _plt()
    rows = [r for r in results["variants"] if r["status"] == "ok" and r.get("timing")]
    names = [r["name"] for r in rows]
    t = [r["timing"] for r in rows]
    parts = [("text encoder", "text_encoder_median_s", "#4c72b0"), ("denoising steps", "sampling_median_s", "#dd8452"),
             ("VAE decoder", "vae_median_s", "#55a868"), ("other", "other_median_s", "#8c8c8c")]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.8), gridspec_kw={"width_ratios": [3, 2]})
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for label, key, colour in parts:
        vals = np.array([max(x.get(key) or 0.0, 0.0) for x in t])
        ax.barh(y, vals, left=left, color=colour, label=label, height=0.6)
        left += vals
    p90 = np.array([x["e2e_p90_s"] for x in t])
    ax.errorbar([x["e2e_median_s"] for x in t], y, xerr=[np.zeros(len(rows)), p90 - np.array([x["e2e_median_s"] for x in t])],
                fmt="none", ecolor="black", capsize=3, label="median → p90")
    for i, r in enumerate(rows):
        s = r.get("speedup_vs_ref")
        ax.text(max(left[i], p90[i]), i, f"  {t[i]['e2e_median_s']:.3g} s" + (f" ({s:.2f}x)" if s else ""), va="center", fontsize=8)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per image, batch 1 (median of repeats; lower is better)")
    ax.set_title(f"End-to-end latency by component ({results['settings']['repeats']} repeats, "
                 f"speed reference {results.get('speed_reference')})")
    ax.set_xlim(0, max(left.max(), p90.max()) * 1.35)
    ax.legend(loc="lower right", fontsize=8)
    steps = np.array([(x.get("backbone_step_median_s") or 0) * 1e3 for x in t])
    ax2.barh(y, steps, color="#dd8452", height=0.6)
    for i, v in enumerate(steps):
        ax2.text(v, i, f" {v:.0f}" if v >= 100 else f" {v:.3g}", va="center", fontsize=8)
    ax2.set_yticks(y, [""] * len(rows))
    ax2.invert_yaxis()
    ax2.set_xlim(0, steps.max() * 1.3 if steps.max() > 0 else 1)
    ax2.set_xlabel("milliseconds per denoising step (backbone + sampler update, median)")
    ax2.set_title("Per-step backbone time")
    _save(fig, path)


def _styles(results: dict) -> dict[str, dict]:
    """One colour / marker / line style per variant, the same in every plot."""
    plt = _plt()
    names = [r["name"] for r in results["variants"] if r["status"] == "ok"]
    cmap = plt.get_cmap("tab20")
    markers = "o s ^ D v P X < > h".split()
    out = {}
    for i, n in enumerate(names):
        out[n] = {"color": cmap(i % 20), "marker": markers[(i + i // 20) % len(markers)],
                  "linestyle": ("-", "--", ":", "-.")[(i // 20) % 4]}
    return out


def _pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated (lower x and higher y is better), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def plot_pareto(path: Path, results: dict) -> bool:
    plt = _plt()
    rows = [r for r in results["variants"] if r["status"] == "ok" and r.get("timing") and r.get("quality")]
    panels = []
    ps = [r for r in rows if r["quality"].get("psnr_db") is not None]
    if ps:
        panels.append(("psnr_db", "PSNR vs fp32 images (dB, higher is better)", ps))
    acc = [r for r in rows if r["quality"].get("attribute_accuracy") is not None]
    if acc:
        panels.append(("attribute_accuracy", "judge attribute accuracy (fraction, higher is better)", acc))
    if not panels:
        return False
    styles = _styles(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels) + 2.8, 4.8), squeeze=False)
    handles = {}
    for ax, (key, ylabel, rs) in zip(axes[0], panels):
        xs = [r["timing"]["e2e_median_s"] for r in rs]
        ys = [r["quality"][key] for r in rs]
        finite = [v for v in ys if not math.isinf(v)]
        cap = (max(finite) + 5.0) if finite else 60.0
        ys_plot = [cap if math.isinf(v) else v for v in ys]
        for x, yv, r, orig in zip(xs, ys_plot, rs, ys):
            st = styles[r["name"]]
            label = r["name"] + (" (reference, ∞ dB)" if math.isinf(orig) else "")
            h = ax.scatter([x], [yv], s=46, color=st["color"], marker=st["marker"], zorder=3, edgecolors="black",
                           linewidths=0.4, label=label)
            handles.setdefault(r["name"], h)
        front = _pareto_front(list(zip(xs, ys_plot)))
        ax.plot([xs[i] for i in front], [ys_plot[i] for i in front], "--", color="#c44e52", zorder=2, lw=1)
        for i in front:  # name the points on the front; the legend names them all
            ax.annotate(rs[i]["name"], (xs[i], ys_plot[i]), textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.set_xlabel("end-to-end latency, median (s per image, lower is better)")
        ax.set_ylabel(ylabel)
        ax.margins(x=0.15, y=0.12)
    from matplotlib.lines import Line2D

    extra = [Line2D([], [], ls="--", color="#c44e52", label="Pareto front (faster and better)")]
    fig.legend(handles=list(handles.values()) + extra, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7,
               frameon=False)
    fig.suptitle("Quality vs latency (each point a variant, same prompts and seeds)")
    fig.tight_layout()
    _save(fig, path)
    return True


def plot_error_growth(path: Path, results: dict) -> bool:
    plt = _plt()
    rows = [r for r in results["variants"] if r["status"] == "ok" and (r.get("quality") or {}).get("error_curve")]
    if not rows:
        return False
    styles = _styles(results)
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for r in rows:
        c = np.maximum(np.asarray(r["quality"]["error_curve"], dtype=np.float64), 1e-12)
        st = styles[r["name"]]
        ax.plot(np.arange(1, len(c) + 1), c, marker=st["marker"], ms=3, color=st["color"], ls=st["linestyle"],
                label=r["name"])
    ax.set_yscale("log")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("sampling step")
    ax.set_ylabel("relative L2 error of latents vs fp32 (||x - x_ref|| / ||x_ref||)")
    ax.set_title(f"Error growth over the sampling loop (reference {results.get('fidelity_reference')})")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    _save(fig, path)
    return True


def plot_memory_size(path: Path, results: dict) -> bool:
    plt = _plt()
    rows = [r for r in results["variants"] if r["status"] == "ok"]
    if not rows:
        return False
    names = [r["name"] for r in rows]
    rss = [(r.get("peak_rss_bytes") or 0) / MiB for r in rows]
    size = [(r.get("size_bytes") or 0) / MiB for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.4 * len(rows) + 1.8))
    y = np.arange(len(rows))
    for ax, vals, xlabel, title, colour in ((a1, rss, "peak resident memory (MiB)", "Peak RSS (fresh process, load + 1 image)", "#8172b3"),
                                            (a2, size, "size on disk (MiB)", "Model size on disk", "#937860")):
        ax.barh(y, vals, color=colour, height=0.6)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.1f}" if v else " n/a", va="center", fontsize=8)
        ax.set_yticks(y, names if ax is a1 else [""] * len(rows))
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.set_xlim(0, (max(vals) or 1) * 1.3)
    _save(fig, path)
    return True


def plot_grid(path: Path, results: dict, image_sets: dict, columns: int = 8) -> bool:
    plt = _plt()
    sets = image_sets.get("images") or {}
    if not sets:
        return False
    ref = image_sets.get("reference")
    order = ([ref] if ref in sets else []) + [n for n in sets if n != ref]
    ncol = min(columns, min(len(v) for v in sets.values()))
    if ncol == 1:  # one image per variant (no quality pass): one row, a variant per column
        fig, axes = plt.subplots(1, len(order), figsize=(2.4 * len(order), 2.9), squeeze=False)
        for ax, name in zip(axes[0], order):
            ax.imshow(sets[name][0], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            ax.set_title(name, fontsize=8)
        caption = (image_sets.get("captions") or [""])[0]
        fig.suptitle(f"The timed job's image per variant (same prompt and seed): \"{caption}\"", fontsize=9)
        _save(fig, path)
        return True
    psnr = {r["name"]: (r.get("quality") or {}).get("psnr_per_image_db") for r in results["variants"]}
    h, w = next(iter(sets.values())).shape[1:3]
    cell = max(1.1, min(2.2, w / 48))
    fig, axes = plt.subplots(len(order), ncol, figsize=(cell * ncol + 1.8, cell * len(order) + 0.6), squeeze=False)
    captions = image_sets.get("captions") or []
    for i, name in enumerate(order):
        for j in range(ncol):
            ax = axes[i][j]
            ax.imshow(sets[name][j], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            p = (psnr.get(name) or [None] * ncol)[j] if name != ref else None
            if p is not None:
                ax.set_title("∞ dB" if math.isinf(p) else f"{p:.1f} dB", fontsize=7, pad=2)
            if j == 0:
                ax.set_ylabel(name + (" (ref)" if name == ref else ""), rotation=0, ha="right", va="center", fontsize=8)
            if i == 0 and j < len(captions) and not (p is not None):
                ax.set_title(captions[j][:28], fontsize=6, pad=2)
    fig_h = cell * len(order) + 0.6
    fig.subplots_adjust(top=1 - 0.55 / fig_h, bottom=0.02, hspace=0.35)
    fig.suptitle("Same prompts and seeds: fp32 reference (top row) vs each variant (PSNR vs the reference above each image)",
                 fontsize=9, y=1 - 0.12 / fig_h)
    _save(fig, path)
    return True


# --- HTML ------------------------------------------------------------------------------------------------
