"""A linear layer whose weight stays in low-bit blocks: in PyTorch it dequantizes one layer at a time (what
diffusers' GGUF loading computes), in ONNX it is one `com.microsoft.MatMulNBits` node whose weight inputs are the
blocks themselves (export/gguf_blocks.py), so no float copy of the weight is ever written or held."""

from __future__ import annotations

import torch

from .gguf_blocks import BLOCK, NBits

DOMAIN_OP = "com.microsoft::MatMulNBits"
# int8 compute of the activations: ONNX Runtime's fast CPU path for block-wise int4/int8 weights (ORT issue 23004)
ACCURACY_LEVEL = 4


def dequantize(b: torch.Tensor, scales: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    if bits == 8:
        q = b.to(torch.int16) - 128
    else:
        q = torch.stack([b & 0x0F, b >> 4], dim=-1).to(torch.int16) - 8
    return (q.reshape(n, k // BLOCK, BLOCK).to(scales.dtype) * scales.reshape(n, k // BLOCK, 1)).reshape(n, k)


class _MatMulNBits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, b, scales, bits: int, n: int, k: int):
        return x @ dequantize(b, scales, bits, n, k).T

    @staticmethod
    def symbolic(g, x, b, scales, bits: int, n: int, k: int):
        y = g.op(DOMAIN_OP, x, b, scales, K_i=k, N_i=n, bits_i=bits, block_size_i=BLOCK,
                 accuracy_level_i=ACCURACY_LEVEL)
        sizes = x.type().varyingSizes()  # the exporter's shape inference knows no contrib op: say [..., N]
        if sizes is not None:
            y.setType(x.type().with_sizes([*sizes[:-1], n]))
        return y


class NBitsLinear(torch.nn.Module):
    """nn.Linear's interface (in_features, out_features, bias) over MatMulNBits blocks."""

    def __init__(self, nb: NBits, out_features: int, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features, self.bits = in_features, out_features, nb.bits
        self.register_buffer("qweight", torch.from_numpy(nb.b))
        self.register_buffer("scales", torch.from_numpy(nb.scales))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _MatMulNBits.apply(x, self.qweight, self.scales, self.bits, self.out_features, self.in_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"
