"""`onnxdiffusion export`, `generate`, `compile-loop`, `quantize`: the pipeline's verbs, from a diffusers folder to
images. Docstrings are the help."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app
from ..errors import UserError
from ..families import describe_image_roles


@app.command()
def export(
    src: Annotated[Path, typer.Argument(help="local diffusers pipeline folder, a single-file .safetensors checkpoint "
                                             "(A1111/ComfyUI layout; with --config), or a GGUF backbone (with --base)")],
    out: Annotated[Path, typer.Argument(help="output model folder")],
    opset: Annotated[int, typer.Option(help="ONNX opset of the exported graphs")] = 17,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output folder written by this tool")] = False,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="skip the PyTorch comparison")] = False,
    no_fuse_attention: Annotated[bool, typer.Option(
        "--no-fuse-attention", help="plain ONNX attention (portable beyond ONNX Runtime, slower on it)")] = False,
    default_size: Annotated[Optional[int], typer.Option(
        "--default-size", help="the folder's default (square) image size; default: the pipeline's own")] = None,
    skip: Annotated[Optional[list[str]], typer.Option(
        "--skip", help="leave out an optional component (repeatable), e.g. vae_encoder: text-to-image never runs it")] = None,
    lora: Annotated[Optional[list[str]], typer.Option(
        "--lora", help="FILE[:SCALE]: merge a LoRA (.safetensors, diffusers/peft layout or `lora convert`ed) into the "
                       "weights before export (repeatable)")] = None,
    lora_points: Annotated[Optional[str], typer.Option(
        "--lora-points", help="linear | all: LoRA insertion points on the backbone and text encoders for run-time "
                              "LoRAs (generate --lora); all adds k x k convolutions")] = None,
    config: Annotated[Optional[Path], typer.Option(
        help="single-file SRC: a local diffusers folder of the same model kind (configs and tokenizers; weights "
             "only for a component the file lacks)")] = None,
    family: Annotated[Optional[str], typer.Option(help="single-file SRC: the model family it must be (sd, sdxl, sd3, flux, ...)")] = None,
    base: Annotated[Optional[Path], typer.Option(
        help="GGUF SRC: a local diffusers folder of the same model kind (text encoders, VAE, scheduler, tokenizers, "
             "the backbone's config.json), or an fp32 model folder exported from one; the backbone's weights stay the "
             "GGUF's low-bit blocks")] = None,
    tiny_vae: Annotated[Optional[Path], typer.Option(
        "--tiny-vae", help="a diffusers AutoencoderTiny (TAESD) folder for this pipeline's VAE: exported beside it as "
                           "vae_decoder_tiny / vae_encoder_tiny (generate --decoder tiny)")] = None,
    controlnet: Annotated[Optional[list[str]], typer.Option(
        "--controlnet", help="NAME=DIR: a diffusers ControlNet folder (ControlNetModel, SD3ControlNetModel, "
                             "FluxControlNetModel) exported beside the backbone as controlnets/NAME (repeatable; "
                             "generate --controlnet NAME)")] = None,
    stream_weights: Annotated[str, typer.Option(
        "--stream-weights", help="auto | on | off: the backbone's Linear weights streamed from its safetensors shards "
                                 "(export bounded by memory; validated on a cut-down copy); auto above 12 GiB fp32")] = "auto",
) -> None:
    """Export a diffusers pipeline (SD, Flux, Qwen-Image, ...) to ONNX (validated against PyTorch)."""
    from ..export import ExportOptions, export_pipeline

    options = ExportOptions(opset=opset, overwrite=overwrite, validate=not no_validate,
                            fuse_attention=not no_fuse_attention, default_size=default_size,
                            skip=tuple(skip or ()), loras=tuple(_loras(lora)), lora_points=lora_points,
                            tiny_vae=None if tiny_vae is None else str(tiny_vae), controlnets=tuple(controlnet or ()),
                            stream_weights=stream_weights)
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
def generate(
    args: Annotated[list[str], typer.Argument(help="[MODEL] PROMPT (MODEL defaults to the embedded model)")],
    negative_prompt: Annotated[Optional[str], typer.Option("--negative-prompt", "-n", help="what the image should not show (default: the empty prompt)")] = None,
    steps: Annotated[Optional[int], typer.Option(help="1..1000 (default: the model's recommended, else 20)")] = None,
    sampler: Annotated[Optional[str], typer.Option(help="default: the model's recommended, else the one the folder's scheduler_config.json names")] = None,
    guidance: Annotated[Optional[float], typer.Option(
        help="0..100, <= 1 turns guidance off (default: the model's recommended, else 7.5)")] = None,
    seed: Annotated[int, typer.Option(help="0..2**63-1")] = 0,
    height: Annotated[Optional[int], typer.Option(help="image height in pixels (default: the model's)")] = None,
    width: Annotated[Optional[int], typer.Option(help="image width in pixels (default: the model's)")] = None,
    batch: Annotated[int, typer.Option(help="images per prompt (1..4096), written as OUT-0.png, OUT-1.png, ...")] = 1,
    spacing: Annotated[Optional[str], typer.Option(help="timestep spacing: leading | trailing | linspace (default: the scheduler config's)")] = None,
    provider: Annotated[str, typer.Option(help="ONNX Runtime execution provider, e.g. cpu | cuda | tensorrt | openvino")] = "cpu",
    loop: Annotated[Optional[str], typer.Option(help="host | loop | unrolled (the last two need compile-loop; default: the profile's, else host)")] = None,
    cache: Annotated[Optional[str], typer.Option(help="step caching (host loop, or a Loop graph compiled with compile-loop --cache): first_block:THRESHOLD | taylorseer:INTERVAL[:ORDER] | residual:INTERVAL[:ORDER] | magcache:THRESHOLD[:MAX_SKIP[:RETENTION]] (transformers; magcache after `cache calibrate`) | deepcache:INTERVAL[:BRANCH] (UNets; BRANCH block pairs, or L<N> skip layers)")] = None,
    stop_early: Annotated[Optional[str], typer.Option(help="THRESHOLD[:MIN_STEPS]: end sampling once the denoised estimate changes by less than THRESHOLD (mean |D_i - D_i-1| / mean |D_i-1|) after at least MIN_STEPS steps (default 1) and decode that estimate; host loop, or a Loop graph compiled with compile-loop --stop-early; 0 never stops")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write")] = Path("out.png"),
    overwrite: Annotated[bool, typer.Option(help="replace existing output images")] = False,
    profile: Annotated[Optional[str], typer.Option(help="hardware profile: a name from `onnxdiffusion profiles` or a YAML file (overrides --provider)")] = None,
    memory: Annotated[Optional[str], typer.Option(help="default | lean (text encoder let go after encoding, no ORT memory pattern: lower peak RSS, same image) | bounded (lean, and the backbone let go before the VAE decode, no packed weight copies, no arena: one component resident at a time) | KEY=0|1,... with KEY release_text_encoders, release_backbone, prepacking, arena, mem_pattern; vae_tile=PIXELS[,vae_overlap=PIXELS]: tiled VAE decoding (lower peak at large sizes, image close, not identical) (default: the profile's, else default)")] = None,
    model_option: Annotated[Optional[Path], typer.Option("--model", "-m", help="model folder (same as the positional MODEL)")] = None,
    image: Annotated[Optional[list[Path]], typer.Option(metavar="PICTURE", help="a picture; its meaning is the model family's: " + describe_image_roles() + ". A start picture is resized to the generation size with a notice, a picture to edit to the size its family encodes references at (the output keeps --height/--width); repeatable where the family takes several references; needs the folder's vae_encoder")] = None,
    strength: Annotated[Optional[float], typer.Option(help="with --image: share of the schedule that runs, (0, 1] (default 1; 0.8 keeps the layout, lower keeps more)")] = None,
    mask: Annotated[Optional[Path], typer.Option(help="inpainting: white = repaint, black = keep (the image's size; needs --image)")] = None,
    mask_blur: Annotated[float, typer.Option(help="with --mask: Gaussian blur radius in pixels before the mask is binarized")] = 0.0,
    mask_overlay: Annotated[bool, typer.Option(help="with --mask: paste the picture's own pixels back outside the mask (the VAE round trip then leaves them unchanged)")] = False,
    lora: Annotated[Optional[list[str]], typer.Option(
        "--lora", help="FILE[:SCALE]: a run-time LoRA (repeatable; a folder without insertion points gets a copy with them, derived once and cached)")] = None,
    lora_dir: Annotated[Optional[Path], typer.Option(help="where a prompt's <lora:NAME:WEIGHT> tags find NAME.safetensors (default: the shipped models/loras)")] = None,
    decoder: Annotated[Optional[str], typer.Option(help="full (the VAE) | tiny (the folder's tiny autoencoder, vae_decoder_tiny: export --tiny-vae) (default: the folder's recommended, a tuned folder's, else full)")] = None,
    control: Annotated[Optional[list[Path]], typer.Option("--control", help="a control image (repeatable; paired in order with --controlnet; resized to the generation size with a notice)")] = None,
    controlnet: Annotated[Optional[list[str]], typer.Option("--controlnet", help="NAME[:SCALE[:START:END]]: a ControlNet of the folder (add-controlnet) steering by the matching --control image; SCALE default 1, START/END the share of the steps it acts in (default 0:1)")] = None,
) -> None:
    """Generate images from a prompt with ONNX Runtime (no torch)."""
    from ..folder.artifacts import read_manifest
    from ..folder.imageio import output_paths
    from ..folder.paths import default_model_folder
    from ..runtime import guards
    from ..runtime.pipeline import GenerateOptions, resolve_options
    from ..runtime.session import resolve_provider

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
    # a batch out of range is refused below (guards): naming its 100000 output files first took seconds
    output_paths(output, batch if isinstance(batch, int) and 0 < batch <= guards.MAX_BATCH else 1, overwrite)
    resolve_provider(provider)
    if memory is not None:
        from ..runtime.memory import memory_options

        memory_options(memory)  # a bad setting fails before any model loads
    from ..techniques.caching import parse_cache
    from ..techniques.stop import parse_stop

    # parsed once, before any model loads (a bad spec: one line), and passed down typed
    cache_spec, stop_spec = parse_cache(cache), parse_stop(stop_early)
    picture = picture_mask = None
    if image or mask is not None or strength is not None:
        from ..runtime.image_input import check_mask_matches, check_strength, read_picture

        if not image:
            raise UserError("--mask and --strength need --image")
        if strength is not None:
            check_strength(strength)
        picture = [read_picture(p, "--image") for p in image]
        picture_mask = read_picture(mask, "--mask") if mask is not None else None
        check_mask_matches(picture[0], picture_mask)
    from .controlnet import control_pairs

    controls = control_pairs(control, controlnet)
    folder = model if model is not None else default_model_folder()
    manifest = read_manifest(folder)
    from ..families import get_family
    from ..runtime.references import check_image_request

    family = get_family(manifest.family)  # what --image means to it: a start picture or the picture(s) to edit
    check_image_request(family, len(picture or ()), mask is not None, strength is not None)
    if picture is not None and family.image_role != "reference":
        picture = picture[0]
    if picture is not None and "vae_encoder" not in manifest.components:
        raise UserError(f"{folder} has no vae_encoder component, which --image needs (export it without `--skip vae_encoder`)")
    options = resolve_options(GenerateOptions(steps=steps, sampler=sampler, guidance=guidance, seed=seed, height=height,
                                              width=width, batch=batch, spacing=spacing, loop=loop, strength=strength,
                                              mask_blur=mask_blur, mask_overlay=mask_overlay,
                                              stop_early=stop_spec, decoder=decoder,
                                              cache="none" if cache is not None and cache_spec is None else cache_spec),
                              manifest.recommended)
    cache_spec = parse_cache(options.cache)  # a tuned folder's recommended cache, where none was asked for
    if options.loop is None:  # the profile decides, else the host loop
        from ..profiles import load_profile

        options = replace(options, loop=load_profile(profile).loop if profile is not None else "host")
    if controls:
        from ..runtime.controlnet import check_request

        check_request(folder, manifest, options, [c[0] for c in controls])  # before any model loads
    from ..techniques.active import Specs, check as check_techniques

    # what does not combine (techniques/registry.py), as far as the options say; generate checks it all again
    # with the folder's precision schedule and the picture's mask
    check_techniques(Specs(cache_spec, stop_spec), options.loop, lora=bool(lora), controlnet=bool(controls))
    guards.check_request(folder, manifest, options)
    from ..adapters.tags import split_tags, tagged_files

    prompt, tagged = split_tags(prompt)  # <lora:NAME:WEIGHT> as A1111 clients write it; the encoder sees no tag
    loras = _loras(lora) + tagged_files(tagged, lora_dir)
    if loras:
        from ..adapters.feeds import build_feeds
        from ..adapters.folder import with_points

        folder = with_points(folder, log=lambda m: print(m, file=sys.stderr))  # a plain export: its points copy
        manifest = read_manifest(folder)
        build_feeds(manifest, loras)  # a bad file, key, shape or scale fails before any model loads

    from tqdm import tqdm

    from ..runtime import GenerationResult, Pipeline

    pipe = Pipeline.from_folder(folder, provider=provider, profile=profile, memory=memory)
    events = pipe.iter_generate(prompt, negative_prompt=negative_prompt, image=picture, mask=picture_mask,
                                loras=loras, controlnets=controls, **options.__dict__)
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
    if stop_early is not None:
        ran, total = result.settings["steps_run"], bar.total
        print(f"stop-early {stop_early}: ran {ran} of {total} steps" + (" (stopped early)" if ran < total else ""),
              file=sys.stderr)
    for p in result.save(output, overwrite=overwrite):
        print(p)


@app.command("compile-loop")
def compile_loop_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder")],
    out: Annotated[Path, typer.Argument(help="output model folder (may equal MODEL to add in place)")],
    form: Annotated[str, typer.Option(help="loop (step count at run time) | unrolled (fixed --steps)")] = "loop",
    steps: Annotated[Optional[int], typer.Option(help="--form unrolled: the fixed step count it unrolls")] = None,
    whole: Annotated[bool, typer.Option(help="token ids in, uint8 image out: text encoder + loop + VAE decoder")] = False,
    cpu_tuned: Annotated[Optional[bool], typer.Option(
        "--cpu-tuned/--portable", help="inline ORT's fully optimized CPU graph (default for a float backbone: as fast "
                                       "as the host loop, checked against the CPU at load) or a portable one")] = None,
    cache: Annotated[Optional[str], typer.Option(help="--form loop: build in step caching with this method, first_block | taylorseer[:INTERVAL[:ORDER]] | residual[:INTERVAL[:ORDER]] | magcache | deepcache[:INTERVAL[:BRANCH]] (BRANCH: block pairs or L<N> skip layers; ORDER, BRANCH compiled in; generate --cache picks the interval or threshold per run)")] = None,
    controlnet: Annotated[Optional[list[str]], typer.Option("--controlnet", help="NAME: build this ControlNet of the folder into the graph beside the backbone (repeatable; generate --controlnet NAME then runs in it)")] = None,
    stop_early: Annotated[bool, typer.Option(help="--form loop: build in adaptive stopping (the Loop's cond output tests the denoised estimate's change; generate --stop-early picks THRESHOLD[:MIN_STEPS] per run)")] = False,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output folder written by this tool")] = False,
) -> None:
    """Compile the N-step sampling loop into one ONNX graph (every sampler, guidance inside)."""
    from ..loopgraph.compile import compile_loop

    print(f"compiling the {form} sampling graph of {model}", file=sys.stderr, flush=True)
    entry = compile_loop(model, out, form=form, steps=steps, whole=whole, overwrite=overwrite, cpu_tuned=cpu_tuned,
                         cache=cache, controlnets=tuple(controlnet or ()), stop_early=stop_early)
    print(f"{entry.path}: {entry.bytes / 1e6:.1f} MB in {entry.setting('compile_seconds'):.1f}s -> {out}")


@app.command()
def quantize(
    model: Annotated[Path, typer.Argument(help="exported fp32 model folder")],
    out: Annotated[Path, typer.Argument(help="output model folder (same layout, quantized components)")],
    recipe: Annotated[str, typer.Option(help="fp16 | int8-dynamic | int8-static | int8-naive | int8-timestep | mixed | int4-weights | w4a8 | fp8 | nvfp4")],
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
    provider: Annotated[str, typer.Option(help="ONNX Runtime execution provider, e.g. cpu | cuda | tensorrt | openvino")] = "cpu",
    threads: Annotated[int, typer.Option(help="ONNX Runtime threads for calibration and latency")] = 1,
    latency_runs: Annotated[int, typer.Option(help="timed backbone calls per side for the report's latency ratio")] = 30,
    quality: Annotated[bool, typer.Option(help="measure backbone SQNR and probe-image PSNR vs fp32 (--no-quality: skip, e.g. random weights)")] = True,
    require_speedup: Annotated[bool, typer.Option(help="fail (no output) unless the backbone is measurably faster than fp32")] = False,
    force: Annotated[bool, typer.Option(help="quantize a folder that is already quantized")] = False,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output folder written by this tool")] = False,
) -> None:
    """Quantize a model folder with a typed recipe; writes the folder and quantize_report.json, prints the report."""
    from ..quantize import CalibrationConfig, QuantizeConfig, quantize as run_quantize, recipe_class
    from ..quantize.api import SpeedGateError, stderr_log
    from ..quantize.schedule import ScheduleConfig
    from ..quantize.report import format_table

    options = {}
    for item in option or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--option expects KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    built = recipe_class(recipe).with_options(options)
    if None in (calib_sampler, calib_steps, calib_guidance):
        # calibrate on the trajectories the model is run with: its recommended settings (manifest)
        from ..folder.artifacts import read_manifest

        rec = read_manifest(model).recommended
        calib_sampler = calib_sampler if calib_sampler is not None else (
            rec.sampler if rec.sampler is not None else "ddim")
        calib_steps = calib_steps if calib_steps is not None else (rec.steps if rec.steps is not None else 20)
        calib_guidance = calib_guidance if calib_guidance is not None else (
            rec.guidance if rec.guidance is not None else 4.0)
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


def _loras(values: list[str] | None) -> list[tuple[str, float]]:
    """--lora FILE[:SCALE] (repeatable) -> [(file, scale)], scales checked."""
    from ..adapters.feeds import normalize

    return [(str(p), w) for p, w in normalize(list(values or []))]
