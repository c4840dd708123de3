"""`onnxdiffusion export`, `generate`, `compile-loop`, `quantize`: the pipeline's verbs, from a diffusers folder to
images. Docstrings are the help."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app
from .options import from_fields
from ..errors import UserError
from ..export.options import ExportOptions
from ..loopgraph.options import LoopOptions
from ..quantize.options import QuantizeOptions
from ..runtime.options import GenerateOptions, GenerateRequest


@app.command()
@from_fields(ExportOptions, "options")
def export(
    src: Annotated[Path, typer.Argument(help="local diffusers pipeline folder, a single-file .safetensors checkpoint "
                                             "(A1111/ComfyUI layout; with --config), or a GGUF backbone (with --base)")],
    out: Annotated[Path, typer.Argument(help="output model folder")],
    options: ExportOptions,
    config: Annotated[Optional[Path], typer.Option(
        help="single-file SRC: a local diffusers folder of the same model kind (configs and tokenizers; weights "
             "only for a component the file lacks)")] = None,
    family: Annotated[Optional[str], typer.Option(help="single-file SRC: the model family it must be (sd, sdxl, sd3, flux, ...)")] = None,
    base: Annotated[Optional[Path], typer.Option(
        help="GGUF SRC: a local diffusers folder of the same model kind (text encoders, VAE, scheduler, tokenizers, "
             "the backbone's config.json), or an fp32 model folder exported from one; the backbone's weights stay the "
             "GGUF's low-bit blocks")] = None,
) -> None:
    """Export a diffusers pipeline (SD, Flux, Qwen-Image, ...) to ONNX (validated against PyTorch)."""
    from ..export import export_pipeline
    from ..export.gguf import is_gguf

    if src.is_file() and is_gguf(src):
        from ..export.gguf import export_gguf

        if config is not None or family is not None:
            raise UserError("--config and --family are for a single-file .safetensors SRC; a GGUF SRC takes --base")
        manifest = export_gguf(src, out, options, base=base)
    elif base is not None:
        raise UserError(f"--base is for a GGUF SRC (MODEL.gguf); {src} is not one")
    elif src.is_file():
        from ..export.single_file import export_checkpoint

        manifest = export_checkpoint(src, out, options, config=config, family=family)
    elif config is not None or family is not None:
        raise UserError("--config and --family are for a single-file checkpoint SRC, not a diffusers folder")
    else:
        manifest = export_pipeline(src, out, options)
    for name, entry in manifest.components.items():
        v = entry.validation
        err = f"max abs err {v['max_abs_error']:.2e}" if v else "not validated"
        print(f"{name:13s} {entry.bytes / 1e6:9.1f} MB  {err}")
    print(f"wrote {out} in {manifest.export_seconds:.1f}s")


@app.command()
@from_fields(GenerateRequest, "request")
@from_fields(GenerateOptions, "options")
def generate(
    args: Annotated[list[str], typer.Argument(help="[MODEL] PROMPT (MODEL defaults to the embedded model)")],
    options: GenerateOptions,
    request: GenerateRequest,
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write")] = Path("out.png"),
    overwrite: Annotated[bool, typer.Option(help="replace existing output images")] = False,
    model_option: Annotated[Optional[Path], typer.Option("--model", "-m", help="model folder (same as the positional MODEL)")] = None,
) -> None:
    """Generate images from a prompt with ONNX Runtime (no torch)."""
    from ..folder.imageio import output_paths
    from ..runtime.request import plan

    if len(args) == 1:
        model, prompt = None, args[0]
    elif len(args) == 2:
        model, prompt = Path(args[0]), args[1]
    else:
        raise UserError("expected [MODEL] PROMPT")
    if model_option is not None:
        if model is not None:
            raise UserError("give the model folder once: positional MODEL or --model, not both")
        model = model_option
    # every check that needs no model, in the library (runtime/request.py), before anything loads
    checked = plan(model, prompt, options, request, outputs=lambda n: output_paths(output, n, overwrite))
    from tqdm import tqdm

    from ..runtime import GenerationResult

    events = checked.events(checked.load())
    result = None
    with tqdm(total=checked.options.steps, desc="sampling", unit="step") as bar:
        for event in events:
            if isinstance(event, GenerationResult):
                result = event
            else:
                bar.total = event.num_steps  # model evaluations: Heun makes two per step
                bar.update(1)
        bar.update(bar.total - bar.n)  # one-graph loops report only at the end
    if options.stop_early is not None:
        ran, total = result.settings["steps_run"], bar.total
        print(f"stop-early {options.stop_early}: ran {ran} of {total} steps" + (" (stopped early)" if ran < total else ""),
              file=sys.stderr)
    for p in result.save(output, overwrite=overwrite):
        print(p)


@app.command("compile-loop")
@from_fields(LoopOptions, "options")
def compile_loop_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder")],
    out: Annotated[Path, typer.Argument(help="output model folder (may equal MODEL to add in place)")],
    options: LoopOptions,
) -> None:
    """Compile the N-step sampling loop into one ONNX graph (every sampler, guidance inside)."""
    from dataclasses import asdict

    from ..loopgraph.compile import compile_loop

    print(f"compiling the {options.form} sampling graph of {model}", file=sys.stderr, flush=True)
    entry = compile_loop(model, out, **asdict(options))
    print(f"{entry.path}: {entry.bytes / 1e6:.1f} MB in {entry.setting('compile_seconds'):.1f}s -> {out}")


@app.command()
@from_fields(QuantizeOptions, "options")
def quantize(
    model: Annotated[Path, typer.Argument(help="exported fp32 model folder")],
    out: Annotated[Path, typer.Argument(help="output model folder (same layout, quantized components)")],
    options: QuantizeOptions,
) -> None:
    """Quantize a model folder with a typed recipe; writes the folder and quantize_report.json, prints the report."""
    from ..quantize.api import SpeedGateError, stderr_log
    from ..quantize.report import format_table

    try:
        report = options.run(model, out, log=stderr_log)
    except SpeedGateError as e:
        print(format_table(e.report))
        raise
    print(format_table(report))
    print(f"wrote {out} in {report['seconds']:.1f}s")
