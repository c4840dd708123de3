"""The measuring verbs: evaluate (judge accuracy, FD) and bench (every variant side by side)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app
from ..errors import UserError


@app.command()
def evaluate(
    model: Annotated[Optional[Path], typer.Argument(help="model folder (default: the embedded model)")] = None,
    count: Annotated[int, typer.Option(help="1..4096 held-out prompts")] = 256,
    steps: Annotated[Optional[int], typer.Option(help="default: the model's recommended, else 20")] = None,
    sampler: Annotated[Optional[str], typer.Option(help="default: the model's recommended, else the folder's scheduler")] = None,
    guidance: Annotated[Optional[float], typer.Option(help="default: the model's recommended, else 7.5")] = None,
    batch: Annotated[int, typer.Option(help="1..4096 images per run")] = 32,
    provider: Annotated[str, typer.Option(help="ONNX Runtime execution provider, e.g. cpu | cuda | tensorrt | openvino")] = "cpu",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="JSON result (default: none, summary only)")] = None,
    grid: Annotated[Optional[Path], typer.Option(help="also save a grid of the first 64 images")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace existing output files")] = False,
    decoder: Annotated[str, typer.Option(help="full (the VAE) | tiny (the folder's tiny autoencoder)")] = "full",
) -> None:
    """Held-out prompts with fixed seeds: judge attribute / strict accuracy and Fréchet distance."""
    import json

    from ..folder.artifacts import atomic_write_bytes
    from ..evaluate.run import EvaluateOptions, check_evaluate_options, evaluate_model
    from ..folder.imageio import image_grid, output_paths

    if output is not None:
        check_output_file(output, overwrite)
    if grid is not None:
        output_paths(grid, 1, overwrite)
    from ..folder.artifacts import read_manifest
    from ..folder.paths import default_model_folder
    from ..runtime.pipeline import GenerateOptions, resolve_options

    # unset steps / sampler / guidance: the model's recommended settings, as generate resolves them
    rec = resolve_options(GenerateOptions(steps=steps, sampler=sampler, guidance=guidance),
                          read_manifest(model if model is not None else default_model_folder()).recommended)
    options = EvaluateOptions(count=count, steps=rec.steps, sampler=rec.sampler, guidance=rec.guidance,
                              batch=batch, decoder=decoder)
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
def bench(
    models: Annotated[Optional[list[Path]], typer.Argument(
        help="model folder(s) (default: the embedded model); two or more: each benched with its own defaults into "
             "OUT/<model>/, then one side-by-side report in OUT")] = None,
    variants: Annotated[Optional[list[str]], typer.Option(
        "--variants", help="names to run, comma-separated or repeated (default: every variant found), e.g. "
                           "torch-fp32,ort-fp32,ort-fp32-loop,ort-fp32-dpmpp,ort-int8-dynamic,optimum-ort,openvino-fp32")] = None,
    variants_dir: Annotated[Optional[Path], typer.Option(
        help="folder whose sub-folders are quantized model folders (default: MODEL's siblings)")] = None,
    steps: Annotated[Optional[int], typer.Option(help="steps (default 20; --arch sd15: 10, the full-width families: 4)")] = None,
    fast_steps: Annotated[Optional[int], typer.Option(help="DPM-Solver++ 2M steps for *-dpmpp (default steps/2)")] = None,
    repeats: Annotated[Optional[int], typer.Option(
        help="timed repeats per variant, interleaved, after warm-up (default 5); --isolate: rounds (default 3)")] = None,
    prompts: Annotated[Optional[int], typer.Option(help="held-out prompts for the quality columns (default 16)")] = None,
    batch: Annotated[int, typer.Option(help="batch size of the quality pass")] = 8,
    guidance: Annotated[Optional[float], typer.Option(help="default: the model's evaluated guidance (--arch sd15: 7.5), else 4.0")] = None,
    size: Annotated[Optional[int], typer.Option(help="image height = width (default: the model's)")] = None,
    threads: Annotated[Optional[int], typer.Option(help="intra-op threads for every runtime (default: libraries')")] = None,
    rss: Annotated[str, typer.Option(help="subprocess (peak RSS per variant in a fresh process) | off")] = "subprocess",
    arch: Annotated[Optional[str], typer.Option(help="sd15 | sd15-tiny | sdxl | sd3 | flux | qwenimage: full-size (sd15) or full-width random-weight model, speed/memory/size only")] = None,
    work: Annotated[Optional[Path], typer.Option(
        help="--arch: build folder (default /tmp/ARCH-bench); also where --quantize caches its folders (WORK/quantized; "
             "default without --arch: ~/.cache/onnxdiffusion/bench-quantized) and peers their converted models")] = None,
    quantize: Annotated[Optional[list[str]], typer.Option(
        "--quantize", help="RECIPE[,RECIPE]: build these quantized siblings first (onnxdiffusion quantize, cached by the "
                           "model's content hash + recipe) and bench them as ort-RECIPE")] = None,
    isolate: Annotated[bool, typer.Option(
        "--isolate", help="measure each variant in fresh processes, interleaved rounds: CPU time and peak RSS per phase "
                          "(speed and memory only, no quality columns)")] = False,
    memory: Annotated[Optional[str], typer.Option(
        help="memory options for our ONNX Runtime variants, as generate --memory (e.g. lean)")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="output directory")] = Path("bench-out"),
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
    profile: Annotated[Optional[str], typer.Option(help="hardware profile (name or YAML file) for the ONNX Runtime variants")] = None,
    link_images: Annotated[bool, typer.Option(
        "--link-images", help="report.html links the PNGs beside it instead of embedding them (committed reports)")] = False,
) -> None:
    """Every variant side by side: latency per component, memory, size, fidelity, judge accuracy -> report.html."""
    from ..bench import BenchOptions, run_bench
    from ..bench.report import print_table

    models = list(models or [])
    if len(models) > 1 and arch is not None:
        raise UserError("--arch builds its own model; name no model folder with it")
    from ..bench.quantized import parse_recipes

    options = BenchOptions(
        model=models[0] if models else None, variants=tuple(variants or ()), variants_dir=variants_dir, steps=steps,
        fast_steps=fast_steps,
        repeats=repeats, prompts=prompts, batch=batch, guidance=guidance, size=size, threads=threads, rss=rss,
        arch=arch, work=work, out=out, progress=not quiet, profile=profile, embed_images=not link_images,
        quantize=parse_recipes(quantize), isolate=isolate, memory=memory,
    )
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
