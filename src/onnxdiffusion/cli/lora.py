"""`onnxdiffusion lora ...`: insertion points on a folder, and kohya/A1111 files converted once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .options import from_fields
from ..adapters.options import ConvertOptions, PointsOptions

lora_app = typer.Typer(no_args_is_help=True, help="LoRA adapters: insertion points, conversion, inspection.")
app.add_typer(lora_app, name="lora")


@lora_app.command("points")
@from_fields(PointsOptions, "options")
def points_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder (fp32 or quantized)")],
    out: Annotated[Path, typer.Argument(help="output model folder")],
    options: PointsOptions = None,
) -> None:
    """Copy MODEL with LoRA insertion points on its backbone and text encoders (the plain image is unchanged)."""
    from ..adapters.folder import add_points

    manifest = add_points(model, out, scope=options.scope, overwrite=options.overwrite)
    for name, entry in manifest.components.items():
        if entry.lora:
            print(f"{name:15s} {len(entry.lora['targets']):5d} insertion points")
    print(f"wrote {out}")


@lora_app.command("convert")
@from_fields(ConvertOptions, "options")
def convert_cmd(
    src: Annotated[Path, typer.Argument(help="LoRA .safetensors (kohya/A1111, diffusers or peft layout)")],
    out: Annotated[Path, typer.Argument(help="output .safetensors (A/B tensors, scales folded in)")],
    options: ConvertOptions = None,
) -> None:
    """Convert a LoRA once (diffusers' converters, export extra) into the file the run time reads without torch."""
    from ..adapters.convert import convert_lora

    n = convert_lora(src, out, options.model, overwrite=options.overwrite)
    print(f"wrote {out} ({n} layers)")
