"""The Typer application every verb registers on, and what the verb modules share."""

from __future__ import annotations

import typer

from ..errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Export, quantize and run diffusion pipelines with ONNX Runtime. "
                  "Every verb accepts --debug (print the traceback of an internal error).")


def require(*modules: str, extra: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"{', '.join(missing)} not installed: pip install 'onnxdiffusion[{extra}]'")
