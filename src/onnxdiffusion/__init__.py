"""onnxdiffusion: export, quantize and run diffusion pipelines with ONNX Runtime."""

__version__ = "0.1.0"
