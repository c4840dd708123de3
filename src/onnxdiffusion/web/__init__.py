"""The browser: `export-web` writes a static page running a model folder's whole pipeline on onnxruntime-web."""

from .export import export_web

__all__ = ["export_web"]
