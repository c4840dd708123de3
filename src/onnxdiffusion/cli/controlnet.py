"""`onnxdiffusion add-controlnet`: a diffusers ControlNet exported into a model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .options import from_fields
from ..export.options import AddControlNetOptions


@app.command("add-controlnet")
@from_fields(AddControlNetOptions, "options")
def add_controlnet_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder (changed in place)")],
    controlnet: Annotated[Path, typer.Argument(
        help="diffusers ControlNet folder (config.json + safetensors) for this model's backbone: ControlNetModel "
             "(SD, SDXL), SD3ControlNetModel, FluxControlNetModel, QwenImageControlNetModel, ZImageControlNetModel")],
    options: AddControlNetOptions = None,
) -> None:
    """Export a ControlNet into MODEL as controlnets/NAME, validated against PyTorch; a net of another family or size is refused."""
    from ..export.controlnet import add_controlnet
    from ..families import get_family

    manifest = add_controlnet(model, controlnet, options.name, overwrite=options.overwrite, backbone=options.backbone)
    entry = manifest.controlnet(options.name)
    v = entry.validation
    err = f"max abs err {v['max_abs_error']:.2e}" if v else "not validated"
    # (a transformer net's record names no UNet residuals: count what the family says it gives)
    outputs = len(get_family(manifest.family).control_residuals(dict(manifest.controlnets[options.name])))
    print(f"controlnets/{options.name}  {entry.bytes / 1e6:.1f} MB  {outputs} residuals  {err}")
    print(f"wrote {model}")
