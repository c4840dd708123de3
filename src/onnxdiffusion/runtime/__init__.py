"""Run-time side: ONNX Runtime, numpy, tokenizers and Pillow only (never torch)."""

from .pipeline import GenerationResult, Pipeline, StepEvent

__all__ = ["GenerationResult", "Pipeline", "StepEvent"]
