"""The whole-pipeline graph's ends: token ids -> backbone conditioning, latents -> uint8 image.

The text side inlines each text encoder once on the [uncond; cond] ids and combines their outputs
with the family's own `combine`, run here against `GraphOps` (ONNX nodes) instead of numpy: one
definition of how a family's encoders combine serves the host pipeline and this graph alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper


@dataclass(frozen=True)
class GVal:
    """A graph tensor as `combine` sees it: its name, rank and (static) last dimension."""

    name: str
    rank: int
    width: int


class GraphOps:
    """`families.base.Ops` emitting ONNX nodes into a builder."""

    def __init__(self, b, prefix: str = "text/"):
        self.b = b
        self.prefix = prefix
        self.count = 0

    def _name(self, hint: str) -> str:
        self.count += 1
        return f"{self.prefix}{hint}_{self.count}"

    def concat(self, xs: list[GVal], axis: int) -> GVal:
        rank = xs[0].rank
        width = sum(x.width for x in xs) if axis in (-1, rank - 1) else xs[0].width
        return GVal(self.b.op("Concat", [x.name for x in xs], self._name("concat"), axis=axis), rank, width)

    def pad_last(self, x: GVal, width: int) -> GVal:
        if width == x.width:
            return x
        pads = np.zeros(2 * x.rank, np.int64)
        pads[2 * x.rank - 1] = width - x.width
        name = self._name("pad")
        self.b.const(name + "/pads", pads)
        return GVal(self.b.op("Pad", [x.name, name + "/pads"], name), x.rank, width)

    def zeros(self, like: GVal, tail: tuple[int, ...]) -> GVal:
        name = self._name("zeros")
        shape = self.b.op("Shape", [like.name], name + "/like_shape")
        batch = self.b.op("Slice", [shape, "slice0_start", "slice0_end"], name + "/batch")
        self.b.const(name + "/tail", np.array(tail, np.int64))
        full = self.b.op("Concat", [batch, name + "/tail"], name + "/shape", axis=0)
        value = helper.make_tensor(name + "/value", TensorProto.FLOAT, [1], [0.0])
        return GVal(self.b.op("ConstantOfShape", [full], name, value=value), 1 + len(tail), tail[-1])


def inline(b, comp, remap: dict[str, str]) -> None:
    for node in comp.nodes:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        for k, x in enumerate(new.input):
            if x in remap:
                new.input[k] = remap[x]
        b.nodes.append(new)


def _output_dims(model: onnx.ModelProto, name: str) -> tuple[int, int]:
    out = next(o for o in model.graph.output if o.name == name)
    dims = out.type.tensor_type.shape.dim
    return len(dims), dims[-1].dim_value


def text_prologue(b, encoders: dict[str, tuple[onnx.ModelProto, tuple[str, ...]]], combine: Callable,
                  load_component, guided: bool = True) -> tuple[dict[str, str], list, list, list[onnx.ValueInfoProto]]:
    """Inline every text encoder on [uncond; cond] ids (the prompt's ids alone when not `guided`);
    returns (conditioning name -> tensor, initializers, functions, the id graph inputs)."""
    inits, functions, inputs = [], [], []
    encoded: dict[str, dict[str, GVal]] = {}
    for name, (model, outputs) in encoders.items():
        suffix = name[len("text_encoder"):]
        ids, uncond_ids = f"input_ids{suffix}", f"uncond_input_ids{suffix}"
        inputs += [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", f"sequence{suffix}"])
                   for n in ((ids, uncond_ids) if guided else (ids,))]
        both = b.op("Concat", [uncond_ids, ids], f"{name}/all_input_ids", axis=0) if guided else ids
        io = {"ids": "input_ids", **{f"out:{o}": o for o in outputs}, "out": outputs[0]}
        comp = load_component(model, io, f"{name}/")
        inline(b, comp, {comp.io["ids"]: both})
        inits += comp.initializers
        functions += comp.functions
        encoded[name] = {o: GVal(comp.io[f"out:{o}"], *_output_dims(model, o)) for o in outputs}
    combined = combine(GraphOps(b), encoded)
    return {k: v.name for k, v in combined.items()}, inits, functions, inputs


def unpack_patches(b, tokens: str, channels: int, patch: int) -> str:
    """[B, rows*cols, C*p*p] -> [B, C, rows*p, cols*p] (families/latents.unpack_patches' twin);
    rows and cols are the graph's int64 inputs `grid_rows`, `grid_cols`."""
    one = b.const("unpack_one", np.array([1], np.int64))
    rows = b.op("Reshape", ["grid_rows", one], "unpack_rows")
    cols = b.op("Reshape", ["grid_cols", one], "unpack_cols")
    b.const("unpack_lead", np.array([-1], np.int64))
    b.const("unpack_tail", np.array([channels, patch, patch], np.int64))
    b.const("unpack_c", np.array([channels], np.int64))
    p = b.const("unpack_p", np.array([patch], np.int64))
    six = b.op("Concat", ["unpack_lead", rows, cols, "unpack_tail"], "unpack_shape6", axis=0)
    x = b.op("Reshape", [tokens, six], "unpack_6d")
    x = b.op("Transpose", [x], "unpack_perm", perm=[0, 3, 1, 4, 2, 5])
    four = b.op("Concat", ["unpack_lead", "unpack_c", b.op("Mul", [rows, p], "unpack_h"),
                           b.op("Mul", [cols, p], "unpack_w")], "unpack_shape4", axis=0)
    return b.op("Reshape", [x, four], "unpacked")


def image_epilogue(b, vae, latents: str, scale: float, shift: float) -> None:
    """Latents -> uint8 NHWC image, exactly as the host pipeline's decode()."""
    scaled = b.op("Mul", [latents, b.const("decode_scale", np.array(scale, np.float32))], "decoder_scaled")
    if shift:
        scaled = b.op("Add", [scaled, b.const("decode_shift", np.array(shift, np.float32))], "decoder_shifted")
    inline(b, vae, {vae.io["latents"]: scaled})
    img = vae.io["out"]
    half = b.const("half_f", np.array(0.5, np.float32))
    img = b.op("Add", [b.op("Mul", [img, half], "img_half"), half], "img_01")
    img = b.op("Clip", [img, "zero_f", b.const("one_f", np.array(1.0, np.float32))], "img_clip")
    img = b.op("Round", [b.op("Mul", [img, b.const("f255", np.array(255.0, np.float32))], "img_255")], "img_round")
    img = b.op("Transpose", [img], "img_nhwc", perm=[0, 2, 3, 1])
    b.op("Cast", [img], "image", to=TensorProto.UINT8)
