"""`onnxdiffusion cache ...`: what a step-cache method needs measured once per model (MagCache's ratios)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .options import from_fields
from ..techniques.cache_magcache import CalibrateOptions

cache_app = typer.Typer(no_args_is_help=True, help="Step caching: per-model calibration (MagCache's magnitude ratios).")
app.add_typer(cache_app, name="cache")


@cache_app.command("calibrate")
@from_fields(CalibrateOptions, "options")
def calibrate_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder (fp32 or quantized)")],
    options: CalibrateOptions = None,
) -> None:
    """Run MODEL uncached and store MagCache's per-step magnitude ratios in its manifest (--cache magcache:T reads them)."""
    from ..folder.artifacts import read_manifest
    from ..runtime.pipeline import Pipeline
    from ..techniques.cache_magcache import calibrate, read_prompts

    texts = read_prompts(options.prompts)
    read_manifest(model)  # a folder that is not a model: one line before anything loads
    record = calibrate(Pipeline.from_folder(model, threads=options.threads), texts, steps=options.steps,
                       sampler=options.sampler, guidance=options.guidance)
    print(f"magcache ratios over {record['steps']} steps ({record['prompts']} prompts, {record['sampler']}): "
          + " ".join(f"{v:.4f}" for v in record["ratios"]))
    print(f"wrote {Path(model) / 'manifest.json'}")
