"""export-web's options, apart from web/export.py so the CLI reads them without importing onnx."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import option


@dataclass(frozen=True)
class WebExportOptions:
    """export_web's options (the export-web verb's, made from these fields): `export_web(model, out, **vars(o))`."""
    max_steps: int = option(50, "the page offers 1..MAX_STEPS steps (one sampler table each)")
    samplers: tuple[str, ...] | None = option(None, "samplers the page offers (repeatable; default: all the model's)",
                                              flags=("--sampler",))
    webgpu: bool = option(True, "also ship onnxruntime-web's WebGPU build (+27 MB), used when the browser offers "
                                "WebGPU")
    overwrite: bool = option(False, "replace a page folder written by export-web")
    allow_drift: bool = option(False, "export an int8-static rounding=cpu folder anyway (its page's images land "
                                      "30-55 dB from generate's; quantize with -O rounding=portable for generate's "
                                      "image)")
