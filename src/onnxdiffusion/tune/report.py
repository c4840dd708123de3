"""report.md and pareto.png of a `tune` run, in the bench report's style: the machine section first (machine.py),
one table, one plot (speed vs quality, the chosen point marked), then the choice, the runner-up per lever and why
it won on this CPU kind (machine.py)."""

from __future__ import annotations

from pathlib import Path

from ..folder.artifacts import atomic_write_bytes
from .machine import machine_section, why_section
from .space import LEVERS, Candidate


def _q(s: dict | None) -> str:
    if not s:
        return "-"
    acc = f" / {s['strict']:.3f}" if s.get("strict") is not None else ""
    return f"{s['psnr']:.1f}{acc}"


def hand_spelled(result: dict, model: str = "MODEL") -> list[str]:
    """The commands that make the chosen configuration by hand (the report prints them; a test runs them)."""
    c = Candidate.from_dict(result["chosen"])
    folder = model
    cmds = []
    if c.recipe != "fp32":
        # a build of another form (builds.py) is named by its recipe and options: quantize takes the recipe
        b = next((b for b in result["quantize_builds"] if b.get("recipe") == c.recipe), {})
        cmds.append(f"onnxdiffusion quantize {model} {c.recipe}-folder --recipe {b.get('quantize_recipe', c.recipe)} "
                    f"{' '.join(b.get('quantize_args', []))}".strip())
        folder = f"{c.recipe}-folder"
    flags = f"--sampler {c.sampler} --steps {c.steps} --decoder {c.decoder} --profile {c.profile}"
    if c.cache:
        flags += f" --cache {c.cache}"
    cmds.append(f'onnxdiffusion generate {folder} "PROMPT" {flags}')
    return cmds


def _confirmations(result: dict) -> list[str]:
    """The accuracy guards' figures: the PSNR floor and each confirmation (the paired counts vs fp32)."""
    lines = []
    if result.get("psnr_floor") is not None:
        lines += ["", f"PSNR floor read off the tuning data: {result['psnr_floor']:g} dB (below it the judge's verdicts "
                  "flipped more than once in 32 neighbouring images)."]
    rows = result.get("confirmations") or []
    if rows:
        n = result["options"]["confirm_count"]
        lines += ["", f"Confirmation on {n} other prompts, fastest first (lost / gained: prompts fp32 gets right and "
                  "the candidate wrong, and the reverse; expected: from the judge's margins, "
                  "accuracy.expected_discordant):", "",
                  "| candidate | PSNR dB | strict / fp32 | lost / gained | |", "|---|---|---|---|---|"]
        for r in rows:
            acc = f"{r['strict']:.3f} / {r['reference_strict']:.3f}" if r.get("strict") is not None else "-"
            pair = f"{r['lost']} / {r['gained']}" if "lost" in r else "-"
            if "expected_lost" in r:
                pair += f" (expected {r['expected_lost']:.2f} / {r['expected_gained']:.2f})"
            psnr = f"{r['psnr']:.1f}" if "psnr" in r else "-"
            lines.append(f"| {Candidate.from_dict(r['candidate']).label()} | {psnr} | {acc} | {pair} | "
                         f"{'confirmed' if r['confirmed'] else 'turned down' + (' (' + r['why'] + ')' if r.get('why') else '')} |")
    elif result.get("turned_down"):
        lines += ["", "Faster within the bound on the tuning prompts but turned down on the confirmation prompts: "
                  + "; ".join(Candidate.from_dict(c).label() for c in result["turned_down"]) + "."]
    return lines


def write_report(out: Path, result: dict) -> None:
    chosen = Candidate.from_dict(result["chosen"])
    sp, lat, held = result["speedup"], result["latency_s"], result["holdout"]
    lines = [f"# tune: {result['model']}", "", *machine_section(result),
             f"Bound: {result['bound']} on {result['options']['tune_count']} tuning prompts; "
             + (f"the store's finished search with this bound, written again in {result['seconds']:.0f} s."
                if result.get("replayed") else
                f"searched in {result['seconds']:.0f} s ({result['generations_this_run']} generations this run, the "
                "rest from the store)."), "",
             f"**Chosen: {chosen.label()}**: {lat['chosen'] * 1e3:.1f} ms per image vs {lat['default'] * 1e3:.1f} ms "
             f"for the default ({sp['vs_default']:.2f}x)"
             + (f", {sp['vs_best_single_lever']:.2f}x the best single lever ("
                f"{Candidate.from_dict(result['best_single_lever']).label()}, {lat['best_single_lever'] * 1e3:.1f} ms)"
                if result["best_single_lever"] else "") + ".", "",
             f"Held out ({result['options']['holdout_count']} prompts the search never saw): mean PSNR "
             f"{held['psnr']:.2f} dB (worst {held['psnr_worst']:.2f} dB)"
             + (f", strict accuracy {held['strict']:.3f} vs fp32's {held['reference']['strict']:.3f}"
                if held.get("strict") is not None else "") + ".", "",
             "By hand, the same configuration:", "", "```bash", *hand_spelled(result), "```", "",
             "## Timed candidates", "",
             "Median of one image end to end (fresh ONNX Runtime sessions, interleaved rounds); quality on the tuning "
             "prompts: mean PSNR dB vs fp32 / strict accuracy.", "",
             "| configuration | ms per image | spread | speed-up | quality | |", "|---|---|---|---|---|---|"]
    for t in sorted(result["timed"], key=lambda t: t["median_s"]):
        c = Candidate.from_dict(t)
        mark = "**chosen**" if c == chosen else ("default" if t == result["timed"][0] else "")
        runs = t.get("runs")
        spread = f"{(max(runs) - min(runs)) / t['median_s']:.0%}" if runs else "-"
        lines.append(f"| {c.label()} | {t['median_s'] * 1e3:.1f} | {spread} | "
                     f"{lat['default'] / t['median_s']:.2f}x | {_q(t['score'])} | {mark} |")
    lines += ["", "Spread: (slowest - fastest round) / median; candidates closer than that are a tie on this machine "
              "at this load (the choice takes the faster median)."]
    lines += _confirmations(result)
    lines += ["", "## Runner-up per lever", "", "| lever | runner-up (fastest other value within the bound) |",
              "|---|---|"]
    for lever in LEVERS:
        r = result["runner_up"].get(lever)
        lines.append(f"| {lever} | {Candidate.from_dict(r).label() if r else '- (no other value timed within the bound)'} |")
    lines += ["", *why_section(result), ""]
    if result.get("shrunk"):
        lines += ["## Shrunk to keep to the time budget", "", *[f"- {n}" for n in result["shrunk"]], ""]
    if result["notes"]:
        lines += ["## Notes", "", *[f"- {n}" for n in result["notes"]], ""]
    lines += ["![speed vs quality](pareto.png)", "",
              f"Every scored candidate: {len(result['measured'])} (tune.json has each figure).", ""]
    atomic_write_bytes(Path(out) / "report.md", "\n".join(lines).encode())
    _plot(Path(out) / "pareto.png", result)


def _plot(path: Path, result: dict) -> None:
    """Speed-up over the default (x) vs mean PSNR (y): timed candidates by their measured latency, the others by the
    quality pass's seconds per image against the default's in the same pass (an estimate, drawn fainter)."""
    try:
        from ..bench.plots import _plt, _save
        plt = _plt()
    except Exception:  # noqa: BLE001 - matplotlib missing: the report stands without its plot
        return
    default = Candidate.from_dict(result["default"]).key
    est0 = next((r["estimate_s"] for r in result["measured"] if r["key"] == default), None)
    base = result["latency_s"]["default"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if est0:
        for passes, colour, label in ((False, "#c44e52", "misses the bound"), (True, "#4c72b0", "within the bound")):
            pts = [(est0 / r["estimate_s"], min(r["score"]["psnr"], 60)) for r in result["measured"]
                   if r["passes"] == passes]
            if pts:
                ax.scatter(*zip(*pts), s=14, c=colour, alpha=0.5, label=f"{label} (estimated speed)")
    tpts = [(base / t["median_s"], min((t["score"] or {}).get("psnr", 60), 60)) for t in result["timed"]]
    ax.scatter(*zip(*tpts), s=34, marker="s", facecolors="none", edgecolors="k", label="timed (one image, median)")
    chosen = Candidate.from_dict(result["chosen"])
    c = next(t for t in result["timed"] if Candidate.from_dict(t) == chosen)
    ax.scatter([base / c["median_s"]], [min((c["score"] or {}).get("psnr", 60), 60)], s=180, marker="*",
               c="#dd8452", label=f"chosen: {chosen.label()}", zorder=5)
    if result["options"]["min_psnr"] is not None:
        ax.axhline(result["options"]["min_psnr"], ls="--", c="grey", lw=1)
    ax.set_xlabel("speed-up over the default (fp32, the folder's sampler and steps), x")
    ax.set_ylabel("mean PSNR vs fp32 on the tuning prompts, dB (capped at 60)")
    ax.set_title("tune: speed vs quality")
    ax.legend(fontsize=7)
    _save(fig, path)
