"""`onnxdiffusion lora ...`: insertion points on a folder, and kohya/A1111 files converted once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app

lora_app = typer.Typer(no_args_is_help=True, help="LoRA adapters: insertion points, conversion, inspection.")
app.add_typer(lora_app, name="lora")


@lora_app.command("points")
def points_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder (fp32 or quantized)")],
    out: Annotated[Path, typer.Argument(help="output model folder")],
    scope: Annotated[str, typer.Option(help="linear (Linear and 1x1 conv layers) | all (k x k convs too)")] = "linear",
    overwrite: bool = False,
) -> None:
    """Copy MODEL with LoRA insertion points on its backbone and text encoders (the plain image is unchanged)."""
    from ..adapters.folder import add_points

    manifest = add_points(model, out, scope=scope, overwrite=overwrite)
    for name, entry in manifest.components.items():
        if entry.lora:
            print(f"{name:15s} {len(entry.lora['targets']):5d} insertion points")
    print(f"wrote {out}")


@lora_app.command("convert")
def convert_cmd(
    src: Annotated[Path, typer.Argument(help="LoRA .safetensors (kohya/A1111, diffusers or peft layout)")],
    out: Annotated[Path, typer.Argument(help="output .safetensors (A/B tensors, scales folded in)")],
    model: Annotated[Optional[Path], typer.Option(help="the exported model folder it is for (its family and configs)")] = None,
    overwrite: bool = False,
) -> None:
    """Convert a LoRA once (diffusers' converters, export extra) into the file the run time reads without torch."""
    from ..adapters.convert import convert_lora

    n = convert_lora(src, out, model, overwrite=overwrite)
    print(f"wrote {out} ({n} layers)")
