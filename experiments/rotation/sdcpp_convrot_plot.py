"""Plot sdcpp_convrot.json: each row's 1-thread time (relative to ours fp32) against its output SQNR on the outlier
activations, one panel per linear shape.

    python experiments/rotation/sdcpp_convrot_plot.py experiments/rotation/sdcpp_convrot.json OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402,F401


def main() -> int:
    data = json.load(open(sys.argv[1]))
    fig, axes = plt.subplots(1, len(data["shapes"]), figsize=(6 * len(data["shapes"]), 4.5), squeeze=False)
    for ax, r in zip(axes[0], data["shapes"]):
        sh, q, sp = r["shape"], r["output_sqnr_db"]["outliers"], r["speed"]["1"]["vs_ours_fp32"]
        for row, rel in sp.items():
            if row not in q:
                continue
            peer = row.startswith("sdcpp")
            ax.scatter(rel, q[row], marker="s" if peer else "o", color="tab:red" if peer else "tab:blue")
            ax.annotate(row, (rel, q[row]), fontsize=7, xytext=(4, -10 if "asym" in row else 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([0.2, 0.3, 0.5, 1, 2, 3])
        ax.set_xlabel("1-thread time / ours fp32 (log)")
        ax.set_ylabel("output SQNR vs float64, outlier activations (dB)")
        ax.set_ylim(0, 145)
        ax.set_title(f"{sh['tokens']} tokens x {sh['k']} -> {sh['n']} (red: sd.cpp, blue: ours/ORT)", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
