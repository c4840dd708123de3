"""A linear layer whose weight stays in low-bit blocks: in PyTorch it dequantizes one layer at a time (what
diffusers' GGUF loading computes), in ONNX it is one `com.microsoft.MatMulNBits` node whose weight inputs are the
blocks themselves (export/gguf_blocks.py), so no float copy of the weight is ever written or held.

Export bounded by memory: the layer holds no weight. Its blocks are made from the GGUF file's memory map when a
forward needs them (and dropped after), and the graph is traced over 16-byte placeholders that say which layer
they stand for; `write_streamed` then writes each layer's blocks into the external-data file one layer at a time
(issue 43: peak RSS of export well under the backbone's fp32 bytes).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..onnxio.aligned import AlignedData
from .gguf_blocks import BLOCK, NBits

DOMAIN_OP = "com.microsoft::MatMulNBits"
CHANNEL_OP = "com.microsoft::DynamicQuantizeMatMul"  # --gguf-layout int8-channel (ChannelInt8Linear)
# int8 compute of the activations: ONNX Runtime's fast CPU path for block-wise int4/int8 weights (ORT issue 23004)
ACCURACY_LEVEL = 4
_MAGIC = b"ODNBITS"  # + one byte (0: blocks, 1: scales) + the layer's u64 index: a placeholder's 16 bytes
DATA_NAME = "model.onnx_data"


def dequantize(b: torch.Tensor, scales: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    if bits == 8:
        q = b.to(torch.int16) - 128
    else:
        q = torch.stack([b & 0x0F, b >> 4], dim=-1).to(torch.int16) - 8
    return (q.reshape(n, k // BLOCK, BLOCK).to(scales.dtype) * scales.reshape(n, k // BLOCK, 1)).reshape(n, k)


class _MatMulNBits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, b, scales, bits: int, n: int, k: int):
        if b.numel() == len(_MAGIC) + 9:  # traced over placeholders: only the shape matters
            return x.new_zeros((*x.shape[:-1], n))
        return x @ dequantize(b, scales, bits, n, k).T

    @staticmethod
    def symbolic(g, x, b, scales, bits: int, n: int, k: int):
        y = g.op(DOMAIN_OP, x, b, scales, K_i=k, N_i=n, bits_i=bits, block_size_i=BLOCK,
                 accuracy_level_i=ACCURACY_LEVEL)
        sizes = x.type().varyingSizes()  # the exporter's shape inference knows no contrib op: say [..., N]
        if sizes is not None:
            y.setType(x.type().with_sizes([*sizes[:-1], n]))
        return y


def _dynamic_uint8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ONNX's DynamicQuantizeLinear rounds it (uint8, one scale and zero point for the whole tensor, its
    range widened to hold 0), dequantized: the eager twin of the run-time activation quantization."""
    lo, hi = torch.clamp(x.min(), max=0.0), torch.clamp(x.max(), min=0.0)
    scale = (hi - lo) / 255.0
    if float(scale) == 0.0:
        return x
    zero = torch.clamp(torch.round(-lo / scale), 0, 255)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


class _DynamicQuantizeMatMul(torch.autograd.Function):
    """x @ (b * scales): b int8 [K, N], one scale per output channel; in ONNX the activations are quantized to
    uint8 per tensor at run time and the int32 accumulator runs over the whole K (MLAS' int8 GEMM)."""

    @staticmethod
    def forward(ctx, x, b, scales, n: int):
        if b.numel() == len(_MAGIC) + 9:
            return x.new_zeros((*x.shape[:-1], n))
        return _dynamic_uint8(x) @ (b.to(scales.dtype) * scales)

    @staticmethod
    def symbolic(g, x, b, scales, n: int):
        y = g.op(CHANNEL_OP, x, b, scales)
        sizes = x.type().varyingSizes()
        if sizes is not None:
            y.setType(x.type().with_sizes([*sizes[:-1], n]))
        return y


def _placeholder(index: int, which: int, dtype) -> torch.Tensor:
    raw = _MAGIC + bytes([which]) + struct.pack("<Q", index)
    return torch.from_numpy(np.frombuffer(raw, np.uint8).copy().view(dtype))


class NBitsLinear(torch.nn.Module):
    """nn.Linear's interface (in_features, out_features, bias) over MatMulNBits blocks that `load()` makes."""

    def __init__(self, load: Callable[[], NBits], bits: int, index: int, out_features: int, in_features: int,
                 bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features, self.bits, self.index, self.load = in_features, out_features, bits, index, load
        self.register_buffer("qweight", _placeholder(index, 0, np.uint8))
        self.register_buffer("scales", _placeholder(index, 1, np.float32))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in for modules that read their Linear's weight dtype or shape (Z-Image's timestep embedder): no
        data (the meta device), so any computation with it fails loudly rather than silently."""
        return torch.empty((self.out_features, self.in_features), device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            b, s = self.qweight, self.scales
        else:
            nb = self.load()
            b, s = torch.from_numpy(nb.b), torch.from_numpy(nb.scales)
        y = self._matmul(x, b, s)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _MatMulNBits.apply(x, b, s, self.bits, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class ChannelInt8Linear(NBitsLinear):
    """An NBitsLinear whose `load()` makes gguf_blocks.Channel8 (int8 [K, N], a scale per output channel): one
    DynamicQuantizeMatMul node in ONNX (export --gguf-layout int8-channel); the same placeholders and writer."""

    def __init__(self, load: Callable, index: int, out_features: int, in_features: int, bias: torch.Tensor | None):
        super().__init__(load, 8, index, out_features, in_features, bias)
        self.register_buffer("qweight", _placeholder(index, 0, np.int8))

    def _matmul(self, x: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _DynamicQuantizeMatMul.apply(x, b, s, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def streamed_layers(module: torch.nn.Module) -> dict[int, Callable[[], NBits]]:
    """The loaders of a module's NBitsLinear layers by placeholder index (taken before the module is let go)."""
    return {m.index: m.load for m in module.modules() if isinstance(m, NBitsLinear)}


def write_streamed(model_path: Path, layers: dict[int, Callable[[], NBits]]) -> None:
    """Replace every placeholder in the exported graph by its layer's blocks, written to the external-data file
    beside it one layer at a time (page-aligned, as external_data.consolidate lays files out)."""
    import onnx

    from ..onnxio.files import write
    from .external_data import consolidate

    model_path = Path(model_path)
    consolidate(model_path, DATA_NAME)  # the exporter's own external files (a > 2 GB graph) into one, first
    model = onnx.load(str(model_path), load_external_data=False)
    slots: dict[int, list] = {}
    for init in model.graph.initializer:
        raw = init.raw_data
        if len(raw) == len(_MAGIC) + 9 and raw.startswith(_MAGIC):
            slots.setdefault(struct.unpack("<Q", raw[-8:])[0], [None, None])[raw[len(_MAGIC)]] = init
    missing = sorted(set(layers) - set(slots))
    if missing:  # a dead layer (its output unused) is pruned from the graph; every other one must be there
        layers = {i: f for i, f in layers.items() if i in slots}
    data = model_path.parent / DATA_NAME
    with open(data, "ab") as out:
        aligned = AlignedData(out, DATA_NAME)
        for index, (b_init, s_init) in sorted(slots.items()):
            nb = layers[index]()
            for init, array in ((b_init, nb.b), (s_init, nb.scales)):
                aligned.put(init, np.ascontiguousarray(array))
                init.ClearField("dims")
                init.dims.extend(array.shape)
            del nb
    tmp = model_path.with_name(model_path.name + ".tmp")
    write(model, tmp)
    os.replace(tmp, model_path)
