"""The acceptance table of issue 46 from finished `tune` runs: for each OUT folder given, the choice, its held-out
PSNR and strict accuracy (and fp32's), its speed-ups, the search's seconds and generations, and where the run's folder
holds them, the process's wall clock (time.txt, /usr/bin/time -v) and the load average through it (load.txt); a
re-run's OUT beside its first run's says whether the same point came back and how long the re-run took.

    python experiments/tune/collect.py RUN_OUT [RUN_OUT ...] > table.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(out: Path) -> str:
    r = json.loads((out / "tune.json").read_text())
    c, h, sp = r["chosen"], r["holdout"], r["speedup"]
    label = f"{c['recipe']}, {c['sampler']} {c['steps']}" + (f", {c['cache']}" if c["cache"] else "") + \
        (f", {c['decoder']} decoder" if c["decoder"] != "full" else "") + f" [{c['profile']}]"
    strict = f"{h['strict']:.3f} / {h['reference']['strict']:.3f}" if h.get("strict") is not None else "-"
    single = f"{sp['vs_best_single_lever']:.2f}x" if sp.get("vs_best_single_lever") else "-"
    if h.get("strict_each") is not None and h.get("reference", {}).get("strict_each") is not None:
        lost = sum(1 for a, b in zip(h["strict_each"], h["reference"]["strict_each"]) if b and not a)
        won = sum(1 for a, b in zip(h["strict_each"], h["reference"]["strict_each"]) if a and not b)
        strict += f" ({lost} lost / {won} gained of {len(h['strict_each'])})"
    floor = "-" if r.get("psnr_floor") is None else f"{r['psnr_floor']:g}"
    conf = r.get("confirmations") or []
    walked = f"{sum(1 for c in conf if not c['confirmed'])} down, {sum(1 for c in conf if c['confirmed'])} up"
    return (f"| {out.name} | {r['bound']} | {label} | {h['psnr']:.2f} (worst {h['psnr_worst']:.2f}) | {strict} | "
            f"{sp['vs_default']:.2f}x | {single} | {floor} | {walked} | {r['seconds']:.0f} | {_wall(out)} | "
            f"{_load(out)} | {r['generations_this_run']} | {'replayed' if r.get('replayed') else ''} |")


def _wall(out: Path) -> str:
    """The process's wall clock, from /usr/bin/time -v's lines kept beside the run (time.txt), if any."""
    t = out / "time.txt"
    if not t.is_file():
        return "-"
    for line in t.read_text().splitlines():
        if "Elapsed (wall clock)" in line:
            return line.rsplit(": ", 1)[-1].strip()
    return "-"


def _load(out: Path) -> str:
    """The 1-minute load average through the run (load.txt: one `HH:MM:SS 1min 5min 15min` line each 30 s)."""
    t = out / "load.txt"
    vals = [float(ln.split()[1]) for ln in t.read_text().splitlines() if len(ln.split()) >= 2] if t.is_file() else []
    if not vals:
        return "-"
    return f"{min(vals):.1f}-{max(vals):.1f} (mean {sum(vals) / len(vals):.1f})"


def main(argv: list[str]) -> int:
    print("| OUT | bound | chosen | held-out PSNR dB | held-out strict (chosen / fp32) | vs default | "
          "vs best single lever | PSNR floor dB | confirmations | seconds in tune | wall | load avg 1 min | "
          "generations | |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for a in argv:
        print(row(Path(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
