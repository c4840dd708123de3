"""Module swaps that make diffusers' transformer-family models exportable at opset 17.

RMSNorm: `torch.nn.RMSNorm` (used by diffusers' Flux/SD3/Qwen attention q/k norms)
traces to `aten::rms_norm`, which the TorchScript exporter cannot write below opset 23.

Each one is swapped for the same arithmetic in elementary ops (Pow, ReduceMean, Add, Sqrt, Div,
Mul). ONNX Runtime's optimizer recognises that pattern and fuses it into its
SimplifiedLayerNormalization kernel, so nothing is lost against ONNX's opset-23
`RMSNormalization` (which ONNX Runtime 1.32 also runs), and the graph stays at the project's opset.

Nearest-exact upsampling (Qwen-Image's 3D VAE): `aten::_upsample_nearest_exact2d` has no opset-17
symbolic. For integer scale factors "nearest-exact" (source index floor((i + 0.5) / s)) picks the
same pixels as "nearest" (floor(i / s)), so such layers are switched to "nearest".
"""

from __future__ import annotations

import torch


class DecomposedRMSNorm(torch.nn.Module):
    def __init__(self, norm: torch.nn.RMSNorm):
        super().__init__()
        self.eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        self.weight = norm.weight  # None without elementwise_affine
        shape = norm.normalized_shape if hasattr(norm, "normalized_shape") else norm.dim  # torch's / diffusers'
        self.dims = tuple(range(-len(shape), 0))

    def forward(self, x):
        # casts only where the dtype changes (a float->float Cast would sit between ORT's fused nodes)
        x32 = x if x.dtype == torch.float32 else x.to(torch.float32)
        y = x32 / torch.sqrt(x32.pow(2).mean(self.dims, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight
        return y if y.dtype == x.dtype else y.to(x.dtype)


def decompose_rms_norms(module: torch.nn.Module) -> int:
    """Replace every `torch.nn.RMSNorm` inside `module` in place; returns how many."""
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if isinstance(child, torch.nn.RMSNorm)]
    for parent, name, child in swaps:
        setattr(parent, name, DecomposedRMSNorm(child))
    return len(swaps)


def decompose_diffusers_rms_norms(module: torch.nn.Module) -> int:
    """Replace diffusers' own RMSNorm (models/normalization.py; without bias) inside `module` in place; returns how
    many. Its float32 -> float32 `.to()` traces to a Cast that the block's residual Add then reads (the tracer maps
    the same tensor object to the Cast's output): on a norm at the head of a block (Z-Image's), that Cast sits on
    the residual stream itself and hides it from step caching's cut (runtime/backbone_split.py)."""
    from diffusers.models.normalization import RMSNorm

    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if isinstance(child, RMSNorm) and child.bias is None]
    for parent, name, child in swaps:
        setattr(parent, name, DecomposedRMSNorm(child))
    return len(swaps)


def exact_nearest_upsamples(module: torch.nn.Module) -> int:
    """Switch `nn.Upsample(mode="nearest-exact")` layers with integer scale factors to "nearest"
    (identical output, exportable); returns how many. Non-integer factors are left alone."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, torch.nn.Upsample) and sub.mode == "nearest-exact" and sub.scale_factor is not None:
            factors = sub.scale_factor if isinstance(sub.scale_factor, tuple) else (sub.scale_factor,)
            if all(float(f).is_integer() for f in factors):
                sub.mode = "nearest"
                count += 1
    return count
