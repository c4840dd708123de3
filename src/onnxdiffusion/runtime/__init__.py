"""Run-time side: ONNX Runtime, numpy, tokenizers and Pillow only (never torch).

The names below load on first use: the CLI imports `runtime.options` at start-up (the typed options its verbs are
built from) without paying for ONNX Runtime."""

__all__ = ["GenerationResult", "Pipeline", "StepEvent"]


def __getattr__(name: str):
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
