"""Export side (needs the `export` extra: torch, diffusers, transformers)."""

from .pipeline import ExportOptions, export_pipeline

__all__ = ["ExportOptions", "export_pipeline"]
