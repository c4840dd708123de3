"""The deployment verbs: hardware profiles, TensorRT fix-up, the HTTP service and offline batches."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app, require
from .options import from_fields
from ..folder.relayout import RelayoutOptions
from ..serve.batch import BatchOptions
from ..serve.config import ServeConfig


@app.command("profiles")
def profiles_cmd() -> None:
    """List the shipped hardware profiles and whether this machine can run each (else its fallback)."""
    from ..profiles import load_profile, shipped

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
    from ..export.fixup_trt import fixup_trt
    from ..quantize.api import stderr_log

    entry = fixup_trt(src, model, log=stderr_log)
    installed = entry.setting("installed_by")
    up = installed["opset"]
    print(f"installed {entry.precision} backbone in {model}: opset {up['from']} -> {up['to']} ({up['converter']}), "
          f"{installed['trt_outputs_typed']} trt outputs typed, {entry.bytes / 1e6:.1f} MB; "
          f"fallback {entry.fallback.path}")
    for line in up.get("adapted", []):
        print(f"  adapted: {line}")



@app.command("relayout")
@from_fields(RelayoutOptions, "options")
def relayout_cmd(
    model: Annotated[Path, typer.Argument(help="model folder")],
    out: Annotated[Path, typer.Argument(help="output model folder (other files hard-linked)")],
    options: RelayoutOptions = None,
) -> None:
    """Copy a model folder with its weights laid out anew: large components' weights in external-data files
    beside their graphs (ONNX Runtime then holds each weight once, inline ones twice: a lower resident set at the
    same speed), and with --storage fp16 every float32 weight that is exactly a float16 value stored as float16
    (the same numbers at load; the shipped folders are stored so)."""
    from ..folder.relayout import store_external

    done = store_external(model, out, min_bytes=options.min_bytes, overwrite=options.overwrite,
                          storage=options.storage)
    print(f"{out}: {', '.join(done) if done else 'no component'} rewritten")


@app.command()
@from_fields(ServeConfig, "config")
def serve(
    models: Annotated[Optional[list[str]], typer.Argument(help="model folders, FOLDER or NAME=FOLDER (default: the embedded model)")] = None,
    config: ServeConfig = None,
    api_key: Annotated[Optional[list[str]], typer.Option("--api-key", help="require `Authorization: Bearer KEY` on the API and job routes (repeatable; a file or ONNXDIFFUSION_API_KEYS keeps keys out of `ps`)")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(help="API keys, one a line (# comments)")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="run as a Ray Serve deployment (the `ray` extra)")] = False,
    replicas: Annotated[int, typer.Option(help="--ray: renderer replicas")] = 1,
    max_replicas: Annotated[Optional[int], typer.Option(help="--ray: autoscale between --replicas and this")] = None,
) -> None:
    """HTTP service: OpenAI-compatible images API, jobs with progress/cancel, model manager, buckets, fallback."""
    from dataclasses import replace

    from ..serve.auth import read_keys

    if config.profile is not None:
        from ..profiles import resolve

        note = resolve(config.profile).note  # one line and exit 2 now, not when the first model loads
        if note:
            print(f"warning: {note}", file=sys.stderr)
    config = replace(config, models=tuple(models or ()), api_keys=read_keys(tuple(api_key or ()), api_key_file))
    if ray and (config.lora_dir or config.loras):
        from ..errors import UserError

        raise UserError("--ray does not serve LoRA adapters yet (its renderer replicas take no `lora`); "
                        "drop --lora/--lora-dir or --ray")
    if config.web is not None:
        from ..web.serve import check_page_folder

        check_page_folder(Path(config.web))  # one line and exit 2 now, not when the server starts
    require("fastapi", "uvicorn", "prometheus_client", "multipart", extra="serve")
    if ray:
        require("ray", extra="ray")
        from ..serve.ray import run_ray_serve

        run_ray_serve(config, replicas=replicas, max_replicas=max_replicas)
        return
    from ..serve.app import run_server

    keys = f"; {len(config.api_keys)} API key(s) required" if config.api_keys else ""
    print(f"serving on http://{config.host}:{config.port} (docs: /docs, page: /{keys})", file=sys.stderr, flush=True)
    run_server(config)


@app.command("batch")
@from_fields(BatchOptions, "options")
def batch_cmd(
    prompts: Annotated[Path, typer.Argument(help="JSON lines: {\"prompt\": ..., optional id, seed, steps, sampler, guidance, negative_prompt, size}")],
    out: Annotated[Path, typer.Argument(help="output folder: one PNG per item (ID.png) + results.jsonl")],
    options: BatchOptions = None,
) -> None:
    """Render a prompt file offline; resumable (items whose image exists are skipped)."""
    from ..serve.batch import run_batch

    if options.ray:
        require("ray", extra="ray")
    from ..serve.ray import render_on_ray

    summary = run_batch(prompts, out, options, remote=render_on_ray if options.ray else None)
    print(f"{summary['rendered']} rendered, {summary['skipped']} already done, {summary['total']} items -> {out}")
