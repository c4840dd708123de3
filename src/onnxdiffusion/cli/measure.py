"""The measuring verbs: evaluate (judge accuracy, FD) and bench (every variant side by side)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app
from .options import from_fields
from ..bench.options import BenchOptions
from ..evaluate.options import EvaluateOptions
from ..errors import UserError


@app.command()
@from_fields(EvaluateOptions, "options")
def evaluate(
    model: Annotated[Optional[Path], typer.Argument(help="model folder (default: the embedded model)")] = None,
    options: EvaluateOptions = None,
    provider: Annotated[str, typer.Option(help="ONNX Runtime execution provider, e.g. cpu | cuda | tensorrt | openvino")] = "cpu",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="JSON result (default: none, summary only)")] = None,
    grid: Annotated[Optional[Path], typer.Option(help="also save a grid of the first 64 images")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace existing output files")] = False,
) -> None:
    """Held-out prompts with fixed seeds: judge attribute / strict accuracy and Fréchet distance."""
    import json
    from dataclasses import replace

    from ..folder.artifacts import atomic_write_bytes
    from ..evaluate.run import check_evaluate_options, evaluate_model
    from ..folder.imageio import image_grid, output_paths

    if output is not None:
        check_output_file(output, overwrite)
    if grid is not None:
        output_paths(grid, 1, overwrite)
    from ..folder.artifacts import read_manifest
    from ..folder.paths import default_model_folder
    from ..runtime.pipeline import GenerateOptions, resolve_options

    # unset steps / sampler / guidance: the model's recommended settings, as generate resolves them
    rec = resolve_options(GenerateOptions(steps=options.steps, sampler=options.sampler, guidance=options.guidance),
                          read_manifest(model if model is not None else default_model_folder()).recommended)
    options = replace(options, steps=rec.steps, sampler=rec.sampler, guidance=rec.guidance)
    check_evaluate_options(options, provider)
    result = evaluate_model(model, options, provider=provider)
    images = result.pop("_images")
    if output is not None:
        atomic_write_bytes(output, (json.dumps(result, indent=2) + "\n").encode())
    if grid is not None:
        from ..folder.imageio import save_images

        save_images(image_grid(images[:64], 8)[None], grid, overwrite)
    print(f"attribute accuracy {result['attribute_accuracy']:.3f}  strict {result['strict_accuracy']:.3f}  "
          f"FD {result['frechet_distance']:.2f}  ({result['count']} images)" + (f" -> {output}" if output else ""))


def check_output_file(path: Path, overwrite: bool) -> None:
    if path.is_dir():
        raise UserError(f"output {path} is a directory; name a file")
    if not path.parent.is_dir():
        raise UserError(f"output directory does not exist: {path.parent}")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UserError(f"output directory is not writable: {path.parent}")
    if path.exists() and not overwrite:
        raise UserError(f"output {path} already exists (pass --overwrite to replace it)")


@app.command()
@from_fields(BenchOptions, "options")
def bench(
    models: Annotated[Optional[list[Path]], typer.Argument(
        help="model folder(s) (default: the embedded model); two or more: each benched with its own defaults into "
             "OUT/<model>/, then one side-by-side report in OUT")] = None,
    options: BenchOptions = None,
) -> None:
    """Every variant side by side: latency per component, memory, size, fidelity, judge accuracy -> report.html."""
    from dataclasses import replace

    from ..bench import run_bench
    from ..bench.report import print_table

    models = list(models or [])
    if len(models) > 1 and options.arch is not None:
        raise UserError("--arch builds its own model; name no model folder with it")
    options = replace(options, model=models[0] if models else None)
    profile, out = options.profile, options.out
    if profile is not None:
        from ..profiles import resolve

        resolve(profile)  # fail (or say it falls back) before any variant runs
    if len(models) > 1:
        from ..bench.compare import markdown, run_bench_models

        joined = run_bench_models(options, models)
        print(markdown(joined))
        print(f"report: {out / 'report.html'} (each model's own under {out}/<model>/)")
        return
    results = run_bench(options)
    print_table(results)
    print(f"bench took {results['bench_seconds']:.0f} s; report: {results['files']['report_html']}")
