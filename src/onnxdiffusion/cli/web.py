"""`export-web`: the model's whole pipeline as a static web page (onnxruntime-web, offline)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app


@app.command("export-web")
def export_web_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder (fp32 or quantized)")],
    out: Annotated[Path, typer.Argument(help="the page folder to write (index.html, runtime, graph, settings)")],
    max_steps: Annotated[int, typer.Option(help="the page offers 1..MAX_STEPS steps (one sampler table each)")] = 50,
    sampler: Annotated[Optional[list[str]], typer.Option(help="samplers the page offers (repeatable; default: all the model's)")] = None,
    webgpu: Annotated[bool, typer.Option(help="also ship onnxruntime-web's WebGPU build (+27 MB), used when the browser offers WebGPU")] = True,
    overwrite: Annotated[bool, typer.Option(help="replace a page folder written by export-web")] = False,
    allow_drift: Annotated[bool, typer.Option(help="export an int8-static rounding=cpu folder anyway (its page's images land 30-55 dB from generate's; quantize with -O rounding=portable for generate's image)")] = False,
) -> None:
    """Write a static page running MODEL's whole pipeline in the browser (open it from any static server)."""
    from ..web import export_web

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    s = export_web(model, out, max_steps=max_steps, samplers=sampler or None, webgpu=webgpu, overwrite=overwrite,
                   allow_drift=allow_drift, log=log)
    size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB; graph {s['graph']['bytes'] / 1e6:.1f} MB) in {s['export_seconds']:.1f}s; "
          f"serve it with `python -m http.server -d {out}` and open http://localhost:8000/")
