"""Command line: a map from verb to typed library function. Docstrings are the help."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Export, quantize and run diffusion pipelines with ONNX Runtime. "
                  "Every verb accepts --debug (print the traceback of an internal error).")


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr)


@app.command()
def export(
    src: Annotated[Path, typer.Argument(help="local diffusers pipeline folder")],
    out: Annotated[Path, typer.Argument(help="output model folder")],
    opset: int = 17,
    overwrite: bool = False,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="skip the PyTorch comparison")] = False,
    no_fuse_attention: Annotated[bool, typer.Option(
        "--no-fuse-attention", help="plain ONNX attention (portable beyond ONNX Runtime, slower on it)")] = False,
    default_size: Annotated[Optional[int], typer.Option(
        "--default-size", help="the folder's default (square) image size; default: the pipeline's own")] = None,
    skip: Annotated[Optional[list[str]], typer.Option(
        "--skip", help="leave out an optional component (repeatable), e.g. vae_encoder: text-to-image never runs it")] = None,
) -> None:
    """Export a diffusers pipeline (SD, Flux, Qwen-Image, ...) to ONNX (validated against PyTorch)."""
    from .export import ExportOptions, export_pipeline

    options = ExportOptions(opset=opset, overwrite=overwrite, validate=not no_validate,
                            fuse_attention=not no_fuse_attention, default_size=default_size,
                            skip=tuple(skip or ()))
    manifest = export_pipeline(src, out, options)
    for name, info in manifest["components"].items():
        v = info.get("validation", {})
        err = f"max abs err {v['max_abs_error']:.2e}" if v else "not validated"
        print(f"{name:13s} {info['bytes'] / 1e6:9.1f} MB  {err}")
    print(f"wrote {out} in {manifest['export_seconds']:.1f}s")


@app.command()
def generate(
    args: Annotated[list[str], typer.Argument(help="[MODEL] PROMPT (MODEL defaults to the embedded model)")],
    negative_prompt: Annotated[Optional[str], typer.Option("--negative-prompt", "-n")] = None,
    steps: Annotated[Optional[int], typer.Option(help="1..1000 (default: the model's recommended, else 20)")] = None,
    sampler: Annotated[Optional[str], typer.Option(help="default: the model's recommended, else the one the folder's scheduler_config.json names")] = None,
    guidance: Annotated[Optional[float], typer.Option(
        help="0..100, <= 1 turns guidance off (default: the model's recommended, else 7.5)")] = None,
    seed: Annotated[int, typer.Option(help="0..2**63-1")] = 0,
    height: Optional[int] = None,
    width: Optional[int] = None,
    batch: int = 1,
    spacing: Optional[str] = None,
    provider: str = "cpu",
    loop: Annotated[Optional[str], typer.Option(help="host | loop | unrolled (the last two need compile-loop; default: the profile's, else host)")] = None,
    output: Annotated[Path, typer.Option("--output", "-o")] = Path("out.png"),
    overwrite: Annotated[bool, typer.Option(help="replace existing output images")] = False,
    profile: Annotated[Optional[str], typer.Option(help="hardware profile: a name from `onnxdiffusion profiles` or a YAML file (overrides --provider)")] = None,
    model_option: Annotated[Optional[Path], typer.Option("--model", "-m", help="model folder (same as the positional MODEL)")] = None,
) -> None:
    """Generate images from a prompt with ONNX Runtime (no torch)."""
    from .artifacts import read_manifest
    from .imageio import output_paths
    from .paths import default_model_folder
    from .runtime import guards
    from .runtime.pipeline import GenerateOptions, resolve_options
    from .runtime.session import resolve_provider

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
    # everything that can be checked without loading a model is checked first
    guards.prompt_list(prompt, 1, "prompt")
    if negative_prompt is not None:
        guards.prompt_list(negative_prompt, 1, "negative prompt")
    output_paths(output, batch if isinstance(batch, int) and batch > 0 else 1, overwrite)
    resolve_provider(provider)
    folder = model if model is not None else default_model_folder()
    manifest = read_manifest(folder)
    options = resolve_options(GenerateOptions(steps=steps, sampler=sampler, guidance=guidance, seed=seed, height=height,
                                              width=width, batch=batch, spacing=spacing, loop=loop),
                              manifest["recommended"])
    if options.loop is None:  # the profile decides, else the host loop
        from .profiles import load_profile

        options = replace(options, loop=load_profile(profile).loop if profile is not None else "host")
    guards.check_request(folder, manifest, options)

    from tqdm import tqdm

    from .runtime import GenerationResult, Pipeline

    pipe = Pipeline.from_folder(folder, provider=provider, profile=profile)
    events = pipe.iter_generate(prompt, negative_prompt=negative_prompt, **options.__dict__)
    result = None
    steps = options.steps
    with tqdm(total=steps, desc="sampling", unit="step") as bar:
        for event in events:
            if isinstance(event, GenerationResult):
                result = event
            else:
                bar.total = event.num_steps  # model evaluations: Heun makes two per step
                bar.update(1)
        bar.update(bar.total - bar.n)  # one-graph loops report only at the end
    for p in result.save(output, overwrite=overwrite):
        print(p)


@app.command("compile-loop")
def compile_loop_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder")],
    out: Annotated[Path, typer.Argument(help="output model folder (may equal MODEL to add in place)")],
    form: Annotated[str, typer.Option(help="loop (step count at run time) | unrolled (fixed --steps)")] = "loop",
    steps: Optional[int] = None,
    whole: Annotated[bool, typer.Option(help="token ids in, uint8 image out: text encoder + loop + VAE decoder")] = False,
    cpu_tuned: Annotated[Optional[bool], typer.Option(
        "--cpu-tuned/--portable", help="inline ORT's fully optimized CPU graph (default for a float backbone: as fast "
                                       "as the host loop, checked against the CPU at load) or a portable one")] = None,
    overwrite: bool = False,
) -> None:
    """Compile the N-step sampling loop into one ONNX graph (every sampler, guidance inside)."""
    from .loops import compile_loop

    print(f"compiling the {form} sampling graph of {model}", file=sys.stderr, flush=True)
    info = compile_loop(model, out, form=form, steps=steps, whole=whole, overwrite=overwrite, cpu_tuned=cpu_tuned)
    print(f"{info['path']}: {info['bytes'] / 1e6:.1f} MB in {info['compile_seconds']:.1f}s -> {out}")


@app.command()
def quantize(
    model: Annotated[Path, typer.Argument(help="exported fp32 model folder")],
    out: Annotated[Path, typer.Argument(help="output model folder (same layout, quantized components)")],
    recipe: Annotated[str, typer.Option(help="fp16 | int8-dynamic | int8-static | int8-naive | int8-timestep | mixed | int4-weights | fp8 | nvfp4")],
    option: Annotated[Optional[list[str]], typer.Option("--option", "-O", help="recipe field KEY=VALUE (repeatable), e.g. -O groups=4")] = None,
    calib_prompts: Annotated[Optional[Path], typer.Option(help="calibration prompts, one per line (default: the scene world's calib split)")] = None,
    calib_count: Annotated[int, typer.Option(help="calibration prompts to use")] = 32,
    calib_seed: Annotated[int, typer.Option(help="prompt i starts from the latents of seed CALIB_SEED + i")] = 10_000,
    calib_sampler: Annotated[Optional[str], typer.Option(help="default: the model's recommended, else ddim")] = None,
    calib_steps: Annotated[Optional[int], typer.Option(help="default: the model's recommended, else 20")] = None,
    calib_guidance: Annotated[Optional[float], typer.Option(help="default: the model's recommended, else 4.0")] = None,
    correct: Annotated[bool, typer.Option(help="fit a per-timestep scale/bias correction of the backbone output, applied in the sampler")] = False,
    precision_schedule: Annotated[Optional[str], typer.Option(
        help="run a higher-precision backbone at the steps where the quantized one hurts the image most, chosen by "
             "measured per-step sensitivity: auto | K (steps) | KEY=VALUE,... (steps, target, max_latency, "
             "precision=fp32|fp16, prompts)")] = None,
    provider: str = "cpu",
    threads: Annotated[int, typer.Option(help="ONNX Runtime threads for calibration and latency")] = 1,
    latency_runs: int = 30,
    quality: Annotated[bool, typer.Option(help="measure backbone SQNR and probe-image PSNR vs fp32 (--no-quality: skip, e.g. random weights)")] = True,
    require_speedup: Annotated[bool, typer.Option(help="fail (no output) unless the backbone is measurably faster than fp32")] = False,
    force: Annotated[bool, typer.Option(help="quantize a folder that is already quantized")] = False,
    overwrite: bool = False,
) -> None:
    """Quantize a model folder with a typed recipe; writes the folder and quantize_report.json, prints the report."""
    from .quantize import CalibrationConfig, QuantizeConfig, quantize as run_quantize, recipe_class
    from .quantize.api import SpeedGateError, stderr_log
    from .quantize.schedule import ScheduleConfig
    from .quantize.report import format_table

    options = {}
    for item in option or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--option expects KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    built = recipe_class(recipe).with_options(options)
    if None in (calib_sampler, calib_steps, calib_guidance):
        # calibrate on the trajectories the model is run with: its recommended settings (manifest)
        from .artifacts import read_manifest

        rec = read_manifest(model).get("recommended") or {}
        calib_sampler = calib_sampler if calib_sampler is not None else rec.get("sampler", "ddim")
        calib_steps = calib_steps if calib_steps is not None else rec.get("steps", 20)
        calib_guidance = calib_guidance if calib_guidance is not None else rec.get("guidance", 4.0)
    config = QuantizeConfig(
        recipe=built,
        calibration=CalibrationConfig(count=calib_count, prompts_file=str(calib_prompts) if calib_prompts else None,
                                      seed=calib_seed, sampler=calib_sampler, steps=calib_steps, guidance=calib_guidance),
        correct=correct, provider=provider, threads=threads, latency_runs=latency_runs,
        schedule=ScheduleConfig.parse(precision_schedule) if precision_schedule is not None else None,
    )
    try:
        report = run_quantize(model, out, config, overwrite=overwrite, force=force, require_speedup=require_speedup,
                              log=stderr_log, measure_quality=quality)
    except SpeedGateError as e:
        print(format_table(e.report))
        raise
    print(format_table(report))
    print(f"wrote {out} in {report['seconds']:.1f}s")


@app.command()
def evaluate(
    model: Annotated[Optional[Path], typer.Argument(help="model folder (default: the embedded model)")] = None,
    count: Annotated[int, typer.Option(help="1..4096 held-out prompts")] = 256,
    steps: Annotated[Optional[int], typer.Option(help="default: the model's recommended, else 20")] = None,
    sampler: Annotated[Optional[str], typer.Option(help="default: the model's recommended, else the folder's scheduler")] = None,
    guidance: Annotated[Optional[float], typer.Option(help="default: the model's recommended, else 7.5")] = None,
    batch: Annotated[int, typer.Option(help="1..4096 images per run")] = 32,
    provider: str = "cpu",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="JSON result (default: none, summary only)")] = None,
    grid: Annotated[Optional[Path], typer.Option(help="also save a grid of the first 64 images")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace existing output files")] = False,
) -> None:
    """Held-out prompts with fixed seeds: judge attribute / strict accuracy and Fréchet distance."""
    import json

    from .artifacts import atomic_write_bytes
    from .evaluate.run import EvaluateOptions, check_evaluate_options, evaluate_model
    from .imageio import image_grid, output_paths

    if output is not None:
        check_output_file(output, overwrite)
    if grid is not None:
        output_paths(grid, 1, overwrite)
    from .artifacts import read_manifest
    from .paths import default_model_folder
    from .runtime.pipeline import GenerateOptions, resolve_options

    # unset steps / sampler / guidance: the model's recommended settings, as generate resolves them
    rec = resolve_options(GenerateOptions(steps=steps, sampler=sampler, guidance=guidance),
                          read_manifest(model if model is not None else default_model_folder())["recommended"])
    options = EvaluateOptions(count=count, steps=rec.steps, sampler=rec.sampler, guidance=rec.guidance,
                              batch=batch)
    check_evaluate_options(options, provider)
    result = evaluate_model(model, options, provider=provider)
    images = result.pop("_images")
    if output is not None:
        atomic_write_bytes(output, (json.dumps(result, indent=2) + "\n").encode())
    if grid is not None:
        from .imageio import save_images

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
    model: Annotated[Optional[Path], typer.Argument(help="model folder (default: the embedded model)")] = None,
    variants: Annotated[Optional[list[str]], typer.Option(
        "--variants", help="names to run, comma-separated or repeated (default: every variant found), e.g. "
                           "torch-fp32,ort-fp32,ort-fp32-loop,ort-fp32-dpmpp,ort-int8-dynamic,optimum-ort,openvino-fp32")] = None,
    variants_dir: Annotated[Optional[Path], typer.Option(
        help="folder whose sub-folders are quantized model folders (default: MODEL's siblings)")] = None,
    steps: Annotated[Optional[int], typer.Option(help="steps (default 20; --arch sd15: 10, the full-width families: 4)")] = None,
    fast_steps: Annotated[Optional[int], typer.Option(help="DPM-Solver++ 2M steps for *-dpmpp (default steps/2)")] = None,
    repeats: Annotated[int, typer.Option(help="timed repeats per variant, interleaved, after warm-up")] = 5,
    prompts: Annotated[Optional[int], typer.Option(help="held-out prompts for the quality columns (default 16)")] = None,
    batch: Annotated[int, typer.Option(help="batch size of the quality pass")] = 8,
    guidance: Annotated[Optional[float], typer.Option(help="default: the model's evaluated guidance, else 4.0")] = None,
    size: Annotated[Optional[int], typer.Option(help="image height = width (default: the model's)")] = None,
    threads: Annotated[Optional[int], typer.Option(help="intra-op threads for every runtime (default: libraries')")] = None,
    rss: Annotated[str, typer.Option(help="subprocess (peak RSS per variant in a fresh process) | off")] = "subprocess",
    arch: Annotated[Optional[str], typer.Option(help="sd15 | sdxl | sd3 | flux | qwenimage: full-size (sd15) or full-width random-weight model, speed/memory/size only")] = None,
    work: Annotated[Optional[Path], typer.Option(help="--arch: build folder (default /tmp/ARCH-bench)")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="output directory")] = Path("bench-out"),
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
    profile: Annotated[Optional[str], typer.Option(help="hardware profile (name or YAML file) for the ONNX Runtime variants")] = None,
    link_images: Annotated[bool, typer.Option(
        "--link-images", help="report.html links the PNGs beside it instead of embedding them (committed reports)")] = False,
) -> None:
    """Every variant side by side: latency per component, memory, size, fidelity, judge accuracy -> report.html."""
    from .bench import BenchOptions, run_bench
    from .bench.report import print_table

    options = BenchOptions(
        model=model, variants=tuple(variants or ()), variants_dir=variants_dir, steps=steps, fast_steps=fast_steps,
        repeats=repeats, prompts=prompts, batch=batch, guidance=guidance, size=size, threads=threads, rss=rss,
        arch=arch, work=work, out=out, progress=not quiet, profile=profile, embed_images=not link_images,
    )
    if profile is not None:
        from .profiles import resolve

        resolve(profile)  # fail (or say it falls back) before any variant runs
    results = run_bench(options)
    print_table(results)
    print(f"bench took {results['bench_seconds']:.0f} s; report: {results['files']['report_html']}")


@app.command("profiles")
def profiles_cmd() -> None:
    """List the shipped hardware profiles and whether this machine can run each (else its fallback)."""
    from .profiles import load_profile, shipped

    print(f"{'profile':15s} {'provider':9s} {'precision':9s} {'runs here':9s} detail")
    for name in shipped():
        p = load_profile(name)
        why = p.unavailable_reason()
        detail = p.description if why is None else f"{why}; falls back to {p.fallback}" if p.fallback else why
        print(f"{name:15s} {p.provider:9s} {p.precision:9s} {'yes' if why is None else 'no':9s} {detail}")


@app.command("fixup-trt")
def fixup_trt_cmd(
    src: Annotated[Path, typer.Argument(help="TensorRT-bound backbone (.onnx), e.g. NVIDIA Model Optimizer's export")],
    model: Annotated[Path, typer.Argument(help="model folder whose backbone it replaces (the old one is kept as the CPU fallback)")],
) -> None:
    """Opset-23 upgrade, trt-op output types, one external-data file, checker; install as MODEL's backbone."""
    from .fixup_trt import fixup_trt
    from .quantize.api import stderr_log

    entry = fixup_trt(src, model, log=stderr_log)
    up = entry["installed_by"]["opset"]
    print(f"installed {entry['precision']} backbone in {model}: opset {up['from']} -> {up['to']} ({up['converter']}), "
          f"{entry['installed_by']['trt_outputs_typed']} trt outputs typed, {entry['bytes'] / 1e6:.1f} MB; "
          f"fallback {entry['fallback']['path']}")
    for line in up.get("adapted", []):
        print(f"  adapted: {line}")



@app.command()
def serve(
    models: Annotated[Optional[list[str]], typer.Argument(help="model folders, FOLDER or NAME=FOLDER (default: the embedded model)")] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    buckets: Annotated[str, typer.Option(help="sizes WIDTHxHEIGHT, comma-separated; requests snap to the nearest; the first is the default")] = "64x64,128x128,96x96,64x128,128x64",
    max_queue: Annotated[int, typer.Option(help="queued jobs before new ones get 503 + Retry-After")] = 64,
    timeout: Annotated[float, typer.Option(help="per-request timeout in seconds (0: none)")] = 120.0,
    workers: Annotated[Optional[int], typer.Option(help="concurrent backbone batches (default: one per usable core)")] = None,
    threads: Annotated[int, typer.Option(help="ONNX Runtime threads per session")] = 1,
    max_batch: Annotated[int, typer.Option(help="images per micro-batch of compatible requests (1: off)")] = 4,
    golden_threshold: Annotated[float, typer.Option(help="PSNR (dB) an optimized model needs vs its full-precision sibling")] = 30.0,
    retention: Annotated[float, typer.Option(help="seconds finished results are kept")] = 600.0,
    grace: Annotated[float, typer.Option(help="on SIGTERM/SIGINT: seconds in-flight requests get to finish")] = 10.0,
    profile: Annotated[Optional[str], typer.Option(help="hardware profile (not available yet)")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="run as a Ray Serve deployment (the `ray` extra)")] = False,
    replicas: Annotated[int, typer.Option(help="--ray: renderer replicas")] = 1,
    max_replicas: Annotated[Optional[int], typer.Option(help="--ray: autoscale between --replicas and this")] = None,
) -> None:
    """HTTP service: OpenAI-compatible images API, jobs with progress/cancel, model manager, buckets, fallback."""
    from .serve.config import ServeConfig, usable_cores

    if profile is not None:
        raise UserError("--profile is not available yet (hardware profiles have not landed)")
    config = ServeConfig(models=tuple(models or ()), host=host, port=port, buckets=buckets, max_queue=max_queue,
                         timeout=timeout, workers=workers or usable_cores(), threads=threads, max_batch=max_batch,
                         golden_threshold_db=golden_threshold, retention=retention, grace=grace)
    _require("fastapi", "uvicorn", "prometheus_client", extra="serve")
    if ray:
        _require("ray", extra="ray")
        from .serve.ray import run_ray_serve

        run_ray_serve(config, replicas=replicas, max_replicas=max_replicas)
        return
    from .serve.app import run_server

    print(f"serving on http://{host}:{port} (docs: /docs, page: /)", file=sys.stderr, flush=True)
    run_server(config)


@app.command("batch")
def batch_cmd(
    prompts: Annotated[Path, typer.Argument(help="JSON lines: {\"prompt\": ..., optional id, seed, steps, sampler, guidance, negative_prompt, size}")],
    out: Annotated[Path, typer.Argument(help="output folder: one PNG per item (ID.png) + results.jsonl")],
    model: Annotated[Optional[Path], typer.Option(help="model folder (default: the embedded model)")] = None,
    batch_size: Annotated[int, typer.Option(help="items per backbone batch (compatible items only)")] = 4,
    ray: Annotated[bool, typer.Option("--ray", help="render on Ray Data actors (the `ray` extra)")] = False,
    actors: Annotated[int, typer.Option(help="--ray: actors (one model load each)")] = 2,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Render a prompt file offline; resumable (items whose image exists are skipped)."""
    from .serve.batch import BatchOptions, run_batch

    if ray:
        _require("ray", extra="ray")
    options = BatchOptions(model=model, batch_size=batch_size, ray=ray, actors=actors, progress=not quiet)
    summary = run_batch(prompts, out, options)
    print(f"{summary['rendered']} rendered, {summary['skipped']} already done, {summary['total']} items -> {out}")


def _require(*modules: str, extra: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"{', '.join(missing)} not installed: pip install 'onnxdiffusion[{extra}]'")


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so every `finally` and temporary-folder cleanup runs."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _usage_error(e: BaseException) -> bool:
    # typer >= 0.20 vendors click as typer._click: recognise its exceptions by their interface
    return callable(getattr(e, "format_message", None)) and isinstance(getattr(e, "exit_code", None), int)


def _internal_error(e: BaseException, debug: bool) -> None:
    """One line and where the traceback is; --debug prints it instead."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    first = (str(e).strip().splitlines() or [""])[0][:200]
    if debug:
        sys.stderr.write(text)
        _say(f"error: internal error: {type(e).__name__}: {first}", file=sys.stderr)
        return
    fd, path = tempfile.mkstemp(prefix="onnxdiffusion-traceback-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    _say(f"error: internal error: {type(e).__name__}: {first} (traceback in {path}; rerun with --debug to print it)",
          file=sys.stderr)


def run(argv: list[str] | None = None) -> int:
    """The CLI as a function returning its exit status (tests call this in-process).

    2: bad input or an unusable artifact (one line); 130: interrupted (Ctrl-C); 143: terminated (SIGTERM);
    1: an internal error (one line plus where its traceback was written).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if not args:
        args = ["--help"]
    old_show = warnings.showwarning
    warnings.showwarning = _one_line_warning
    old_term = None
    try:
        old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave SIGTERM alone
        pass
    try:
        rv = app(args=args, prog_name="onnxdiffusion", standalone_mode=False)
        if rv == 130:  # typer turns Ctrl-C into a silent 130
            _say("error: interrupted", file=sys.stderr)
        return rv if isinstance(rv, int) and rv in (0, 1, 2, 130, 143) else 0
    except UserError as e:
        _say(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _say("error: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        _say("error: terminated", file=sys.stderr)
        return 143
    except MemoryError:
        _say("error: out of memory (use a smaller size or batch)", file=sys.stderr)
        return 2
    except OSError as e:  # the file system said no: a full disk, a permission, a vanished folder
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        _say(f"error: {_one_line(e.strerror or str(e))}{where}", file=sys.stderr)
        return 2
    except Exception as e:
        cause = _signal_cause(e)
        if cause is not None:  # e.g. an ImportError raised because Ctrl-C hit a module's initialisation
            _say(f"error: {'terminated' if cause == 143 else 'interrupted'}", file=sys.stderr)
            return cause
        if _usage_error(e):
            _say(f"error: {_one_line(e.format_message())} (see --help)", file=sys.stderr)
            return e.exit_code
        if isinstance(getattr(e, "exit_code", None), int):  # click's Exit
            return e.exit_code
        _internal_error(e, debug)
        return 1
    finally:
        warnings.showwarning = old_show
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _signal_cause(e: BaseException) -> int | None:
    """130 / 143 if a Ctrl-C or SIGTERM is what this exception is about (click's Abort, or one chained)."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, Terminated):
            return 143
        if isinstance(e, KeyboardInterrupt) or type(e).__name__ == "Abort":
            return 130
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _say(*args, **kwargs) -> None:
    """The final error line, on a line of its own: progress bars still open are closed first."""
    tqdm_module = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm_module, "tqdm", None), "_instances", ())):
        bar.close()
    print(*args, **kwargs)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
