"""`onnxdiffusion add-controlnet`: a diffusers ControlNet exported into a model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .app import app


@app.command("add-controlnet")
def add_controlnet_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder (changed in place)")],
    controlnet: Annotated[Path, typer.Argument(
        help="diffusers ControlNet folder (config.json + safetensors) for this model's backbone: ControlNetModel "
             "(SD, SDXL), SD3ControlNetModel, FluxControlNetModel")],
    name: Annotated[str, typer.Option(help="the name generate --controlnet uses")],
    overwrite: Annotated[bool, typer.Option(help="replace a ControlNet of that name")] = False,
) -> None:
    """Export a ControlNet into MODEL as controlnets/NAME, validated against PyTorch; a net of another family or size is refused."""
    from ..export.controlnet import add_controlnet

    manifest = add_controlnet(model, controlnet, name, overwrite=overwrite)
    entry = manifest.controlnet(name)
    v = entry.validation
    err = f"max abs err {v['max_abs_error']:.2e}" if v else "not validated"
    print(f"controlnets/{name}  {entry.bytes / 1e6:.1f} MB  {len(entry.setting('residuals'))} + 1 residuals  {err}")
    print(f"wrote {model}")

