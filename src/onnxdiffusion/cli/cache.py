"""`onnxdiffusion cache ...`: what a step-cache method needs measured once per model (MagCache's ratios)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app

cache_app = typer.Typer(no_args_is_help=True, help="Step caching: per-model calibration (MagCache's magnitude ratios).")
app.add_typer(cache_app, name="cache")


@cache_app.command("calibrate")
def calibrate_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder (fp32 or quantized)")],
    prompts: Annotated[Optional[Path], typer.Option(help="prompts file, one a line (default: 4 built-in prompts)")] = None,
    steps: Annotated[Optional[int], typer.Option(help="steps of each calibration run (default: the model's)")] = None,
    sampler: Annotated[Optional[str], typer.Option(help="sampler of the runs (default: the model's)")] = None,
    guidance: Annotated[Optional[float], typer.Option(help="guidance scale of the runs (default: the model's)")] = None,
    threads: Annotated[Optional[int], typer.Option(help="ONNX Runtime threads")] = None,
) -> None:
    """Run MODEL uncached and store MagCache's per-step magnitude ratios in its manifest (--cache magcache:T reads them)."""
    from ..folder.artifacts import read_manifest
    from ..runtime.pipeline import Pipeline
    from ..techniques.cache_magcache import calibrate, read_prompts

    texts = read_prompts(prompts)
    read_manifest(model)  # a folder that is not a model: one line before anything loads
    record = calibrate(Pipeline.from_folder(model, threads=threads), texts, steps=steps, sampler=sampler,
                       guidance=guidance)
    print(f"magcache ratios over {record['steps']} steps ({record['prompts']} prompts, {record['sampler']}): "
          + " ".join(f"{v:.4f}" for v in record["ratios"]))
    print(f"wrote {Path(model) / 'manifest.json'}")
