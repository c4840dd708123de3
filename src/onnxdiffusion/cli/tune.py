"""`onnxdiffusion tune`: search the levers for the fastest configuration within a quality bound on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .options import from_fields
from ..tune.run import TuneOptions


@app.command()
@from_fields(TuneOptions, "options")
def tune(
    args: Annotated[list[str], typer.Argument(help="[MODEL] OUT (MODEL defaults to the embedded model; OUT gets the "
                                                   "tuned folder OUT/model, report.md, pareto.png, tune.json and the "
                                                   "journal a re-run resumes from)")],
    options: TuneOptions,
) -> None:
    """Find the fastest sampler/steps x step cache x decoder x quantize recipe x profile within a quality bound,
    measured here; write the tuned folder (generate/serve run it as chosen) and a report."""
    from ..errors import UserError
    from ..tune import tune as run_tune

    if len(args) == 1:
        model, out = None, Path(args[0])
    elif len(args) == 2:
        model, out = Path(args[0]), Path(args[1])
    else:
        raise UserError("expected [MODEL] OUT")
    result = run_tune(model, out, options)
    print(f"{out / 'model'}: {result['speedup']['vs_default']:.2f}x the default, held-out "
          f"{result['holdout']['psnr']:.1f} dB; report {out / 'report.md'}")
