"""`export-web`: the model's whole pipeline as a static web page (onnxruntime-web, offline)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .options import from_fields
from ..web.options import WebExportOptions


@app.command("export-web")
@from_fields(WebExportOptions, "options")
def export_web_cmd(
    model: Annotated[Path, typer.Argument(help="exported model folder (fp32 or quantized)")],
    out: Annotated[Path, typer.Argument(help="the page folder to write (index.html, runtime, graph, settings)")],
    options: WebExportOptions = None,
) -> None:
    """Write a static page running MODEL's whole pipeline in the browser (open it from any static server)."""
    from ..web import export_web

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    samplers = list(options.samplers) if options.samplers else None
    s = export_web(model, out, max_steps=options.max_steps, samplers=samplers, webgpu=options.webgpu,
                   overwrite=options.overwrite, allow_drift=options.allow_drift, log=log)
    size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB; graph {s['graph']['bytes'] / 1e6:.1f} MB) in {s['export_seconds']:.1f}s; "
          f"serve it with `python -m http.server -d {out}` and open http://localhost:8000/")
