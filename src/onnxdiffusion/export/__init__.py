"""Export side (needs the `export` extra: torch, diffusers, transformers).

The names below load on first use: the CLI reads `export.options` (the typed options its `export` verb is built
from) at start-up without importing torch."""

__all__ = ["ExportOptions", "export_pipeline"]


def __getattr__(name: str):
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
