"""The side-by-side bench's plot: each variant's speed-up vs its model's own reference, the models' bars
next to each other, and speed-up against image PSNR vs fp32 per model."""

from __future__ import annotations

import math
from pathlib import Path

from .plots import _plt, _save

PSNR_CAP = 60.0  # dB: identical images (inf) and near-identical ones drawn at the top of the axis


def plot_compare(path: Path, joined: dict) -> bool:
    names = [m["name"] for m in joined["models"]]
    rows = [r for r in joined["rows"] if any(r["cells"][n]["status"] == "ok" and r["cells"][n].get("speedup_vs_ref")
                                             for n in names)]
    if not rows:
        return False
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 0.28 * len(rows) + 1.6), gridspec_kw={"width_ratios": [1.3, 1]})
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    height = 0.8 / len(names)
    for k, n in enumerate(names):
        ys, xs = [], []
        for i, r in enumerate(rows):
            c = r["cells"][n]
            if c["status"] == "ok" and c.get("speedup_vs_ref"):
                ys.append(i + (k - (len(names) - 1) / 2) * height)
                xs.append(c["speedup_vs_ref"])
        colour = colours[k % len(colours)]
        ax.barh(ys, xs, height=height, color=colour, label=n)
        pts = [(r["cells"][n]["speedup_vs_ref"], min(float(r["cells"][n]["psnr_db"]), PSNR_CAP), r["name"])
               for r in rows if r["cells"][n]["status"] == "ok" and r["cells"][n].get("speedup_vs_ref")
               and r["cells"][n].get("psnr_db") is not None and not math.isnan(float(r["cells"][n]["psnr_db"]))]
        ax2.scatter([p[0] for p in pts], [p[1] for p in pts], color=colour, label=n, s=18)
        for x, y, label in pts:
            ax2.annotate(label.removeprefix("ort-"), (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["name"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="#888", lw=0.8)
    ax.set_xlabel("speed-up vs the model's own reference (x, end to end, batch 1)")
    ax.legend(fontsize=7, loc="lower right")
    ax2.set_xlabel("speed-up vs the model's own reference (x)")
    ax2.set_ylabel(f"image PSNR vs fp32 (dB, capped at {PSNR_CAP:.0f})")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)
    return True
