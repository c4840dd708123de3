"""`onnxdiffusion tune`: search the levers for the fastest configuration within a quality bound on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app


@app.command()
def tune(
    args: Annotated[list[str], typer.Argument(help="[MODEL] OUT (MODEL defaults to the embedded model; OUT gets the "
                                                   "tuned folder OUT/model, report.md, pareto.png, tune.json and the "
                                                   "journal a re-run resumes from)")],
    min_psnr: Annotated[Optional[float], typer.Option(
        "--min-psnr", help="bound: mean image PSNR (dB) vs the model's own fp32 pictures on the tuning prompts (on the "
                           "scene prompts the judge reads, fp32's accuracy is kept too)")] = None,
    keep_accuracy: Annotated[bool, typer.Option(
        "--keep-accuracy", help="bound: the judge's strict accuracy within 1 point of fp32's (scene prompts)")] = False,
    time_budget: Annotated[float, typer.Option("--time-budget", help="minutes for the whole run")] = 20.0,
    prompts: Annotated[Optional[Path], typer.Option(
        help="tuning prompts, one a line (default: the scene world's held-out prompts, which the judge reads)")] = None,
    tune_count: Annotated[int, typer.Option("--tune-count", help="tuning prompts")] = 16,
    holdout_count: Annotated[Optional[int], typer.Option(
        "--holdout-count", help="held-out prompts of the final check (default 96 where the judge reads them, else 32)")]
        = None,
    confirm_count: Annotated[Optional[int], typer.Option(
        "--confirm-count", help="prompts the fastest candidates are confirmed on before one is chosen (default as "
                                "--holdout-count)")] = None,
    recipes: Annotated[str, typer.Option(help="quantize recipes tried, in order, comma-separated (none: fp32 only)")]
        = "int8-static,int8-timestep",
    rounds: Annotated[int, typer.Option(help="interleaved timing rounds")] = 5,
    overwrite: Annotated[bool, typer.Option(help="write into a non-empty OUT that holds no tune journal")] = False,
) -> None:
    """Find the fastest sampler/steps x step cache x decoder x quantize recipe x profile within a quality bound,
    measured here; write the tuned folder (generate/serve run it as chosen) and a report."""
    from ..errors import UserError
    from ..tune import TuneOptions, tune as run_tune

    if len(args) == 1:
        model, out = None, Path(args[0])
    elif len(args) == 2:
        model, out = Path(args[0]), Path(args[1])
    else:
        raise UserError("expected [MODEL] OUT")
    names = tuple(r.strip() for r in recipes.split(",") if r.strip() and r.strip() != "none")
    result = run_tune(model, out, TuneOptions(min_psnr=min_psnr, keep_accuracy=keep_accuracy, time_budget=time_budget,
                                              prompts=prompts, tune_count=tune_count, holdout_count=holdout_count,
                                              confirm_count=confirm_count,
                                              recipes=names, rounds=rounds, overwrite=overwrite))
    print(f"{out / 'model'}: {result['speedup']['vs_default']:.2f}x the default, held-out "
          f"{result['holdout']['psnr']:.1f} dB; report {out / 'report.md'}")
