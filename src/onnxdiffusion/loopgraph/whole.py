"""The whole-pipeline graph's ends: token ids -> backbone conditioning, latents -> uint8 image.

The text side inlines each text encoder once on the [uncond; cond] ids and combines their outputs
with the family's own `combine`, run here against `GraphOps` (ONNX nodes) instead of numpy: one
definition of how a family's encoders combine serves the host pipeline and this graph alike. An
encoder that reads an attention mask (an LLM's padding mask) takes it as a graph input beside its ids,
and the family's `text_outputs` (each row's kept tokens, `GraphOps.kept_tokens`) runs on its outputs.
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

    def kept_tokens(self, x: GVal, mask: GVal, drop: int, multiple: int) -> tuple[GVal, GVal]:
        """families.graph_ends.kept_tokens' twin on a right-padded mask (the tokenizer pads right only): a row's
        kept tokens are its first ones, so drop the first `drop` positions, zero the padding and cut or zero-pad
        the sequence to the longest row rounded up to `multiple`."""
        b, p = self.b, self._name("kept") + "/"
        keep = b.op("Cast", [mask.name], p + "mask_f", to=TensorProto.FLOAT)
        states = x.name
        if drop:
            starts, ends, axis = (b.const(p + n, np.array([v], np.int64)) for n, v in
                                  (("drop", drop), ("end", np.iinfo(np.int64).max), ("axis", 1)))
            states = b.op("Slice", [states, starts, ends, axis], p + "dropped")
            keep = b.op("Slice", [keep, starts, ends, axis], p + "mask_dropped")
        kept3 = b.op("Unsqueeze", [b.op("Cast", [keep], p + "mask_b", to=TensorProto.BOOL),
                                   b.const(p + "last", np.array([-1], np.int64))], p + "mask_b3")
        states = b.op("Where", [kept3, states, b.const(p + "zero", np.array(0.0, np.float32))], p + "zeroed")
        counts = b.op("ReduceSum", [keep, b.const(p + "seq_axis", np.array([1], np.int64))], p + "counts", keepdims=0)
        longest = b.op("ReduceMax", [counts], p + "longest", keepdims=1)
        if multiple > 1:
            m = b.const(p + "multiple", np.array(float(multiple), np.float32))
            longest = b.op("Mul", [b.op("Ceil", [b.op("Div", [longest, m], p + "blocks")], p + "blocks_up"), m], p + "rounded")
        target = b.op("Cast", [longest], p + "target", to=TensorProto.INT64)
        length = b.op("Slice", [b.op("Shape", [keep], p + "shape"), b.const(p + "one", np.array([1], np.int64)),
                                b.const(p + "two", np.array([2], np.int64))], p + "length")
        short = b.op("Max", [b.op("Sub", [target, length], p + "short_by"), b.const(p + "none", np.array([0], np.int64))],
                     p + "pad_by")
        zero = b.const(p + "z", np.zeros(1, np.int64))
        begin = b.const(p + "begin", np.array([0], np.int64))

        def fit(t: str, rank: int, tag: str) -> str:
            # pads: the begins (all 0) then the ends: `short` on the sequence axis (1) alone
            ends = [zero, short] + [zero] * (rank - 2)
            pads = b.op("Concat", [zero] * rank + ends, p + tag + "_pads", axis=0)
            padded = b.op("Pad", [t, pads], p + tag + "_padded")
            return b.op("Slice", [padded, begin, target, b.const(p + tag + "_axis", np.array([1], np.int64))],
                        p + tag + "_fit")

        return GVal(fit(states, 3, "states"), 3, x.width), GVal(fit(keep, 2, "mask"), 2, 0)


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


def _masked_ids(b, name: str, suffix: str, inputs: dict, guided: bool) -> tuple[str, str, list]:
    """An encoder that reads an attention mask: its ids and mask as graph inputs, in the encoder's own dtypes,
    [uncond; cond] when `guided`. Prompt and negative prompt may differ in length: the shorter is padded here with
    masked zeros (a masked token changes no kept token's state: the encoders are causal). A family whose padded
    tokens reach the backbone (FLUX.2) tokenizes both to its fixed length: nothing is padded here then."""
    types = {k: inputs[k].type.tensor_type.elem_type for k in ("input_ids", "attention_mask")}
    ids, mask = f"input_ids{suffix}", f"attention_mask{suffix}"
    vis = [helper.make_tensor_value_info(n, types[k], ["batch", f"sequence{suffix}"])
           for n, k in ((ids, "input_ids"), (mask, "attention_mask"))]
    if not guided:
        return ids, mask, vis
    un_ids, un_mask = f"uncond_{ids}", f"uncond_{mask}"
    vis += [helper.make_tensor_value_info(n, types[k], ["batch", f"uncond_sequence{suffix}"])
            for n, k in ((un_ids, "input_ids"), (un_mask, "attention_mask"))]
    p = f"{name}/ids/"
    one, two = b.const(p + "one", np.array([1], np.int64)), b.const(p + "two", np.array([2], np.int64))
    zero = b.const(p + "zero", np.zeros(1, np.int64))
    lengths = {x: b.op("Slice", [b.op("Shape", [x], f"{p}{x}_shape"), one, two], f"{p}{x}_length") for x in (ids, un_ids)}
    longest = b.op("Max", list(lengths.values()), p + "longest")

    def padded(x: str, like: str) -> str:
        pads = b.op("Concat", [zero, zero, zero, b.op("Sub", [longest, lengths[like]], f"{p}{x}_short_by")],
                    f"{p}{x}_pads", axis=0)
        return b.op("Pad", [x, pads], f"{p}{x}_padded")

    both_ids = b.op("Concat", [padded(un_ids, un_ids), padded(ids, ids)], f"{name}/all_input_ids", axis=0)
    both_mask = b.op("Concat", [padded(un_mask, un_ids), padded(mask, ids)], f"{name}/all_attention_mask", axis=0)
    return both_ids, both_mask, vis


def text_prologue(b, encoders: dict[str, tuple[onnx.ModelProto, tuple[str, ...]]], combine: Callable,
                  load_component, guided: bool = True, text_outputs: Callable | None = None,
                  ) -> tuple[dict[str, str], list, list, list[onnx.ValueInfoProto]]:
    """Inline every text encoder on [uncond; cond] ids (the prompt's ids alone when not `guided`), and on their
    attention masks where it reads one; `text_outputs(name, ops, outputs, mask)` (the family's) maps each encoder's
    outputs to what `combine` reads. Returns (conditioning name -> tensor, initializers, functions, the id inputs)."""
    inits, functions, inputs = [], [], []
    encoded: dict[str, dict[str, GVal]] = {}
    for name, (model, outputs) in encoders.items():
        suffix = name[len("text_encoder"):]
        graph_inputs = {i.name: i for i in model.graph.input}
        masked = "attention_mask" in graph_inputs
        io = {"ids": "input_ids", **({"mask": "attention_mask"} if masked else {}),
              **{f"out:{o}": o for o in outputs}, "out": outputs[0]}
        unbound = set(graph_inputs) - set(io.values()) - {t.name for t in model.graph.initializer}
        if unbound:
            raise ValueError(f"{name} takes inputs the whole graph cannot feed from token ids: {sorted(unbound)}")
        comp = load_component(model, io, f"{name}/")
        mask = None
        if masked:
            both, mask, vis = _masked_ids(b, name, suffix, graph_inputs, guided)
            inputs += vis
            inline(b, comp, {comp.io["ids"]: both, comp.io["mask"]: mask})
        else:
            ids, uncond_ids = f"input_ids{suffix}", f"uncond_input_ids{suffix}"
            inputs += [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", f"sequence{suffix}"])
                       for n in ((ids, uncond_ids) if guided else (ids,))]
            both = b.op("Concat", [uncond_ids, ids], f"{name}/all_input_ids", axis=0) if guided else ids
            inline(b, comp, {comp.io["ids"]: both})
        inits += comp.initializers
        functions += comp.functions
        encoded[name] = {o: GVal(comp.io[f"out:{o}"], *_output_dims(model, o)) for o in outputs}
        if text_outputs is not None:
            encoded[name] = text_outputs(name, GraphOps(b, f"{name}/outputs/"), encoded[name],
                                         None if mask is None else GVal(mask, 2, 0))
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


def decoder_tokens(b, tokens: str, decode) -> str:
    """A DecodeFeed's affine map on the packed tokens' channels (before unpacking); the tokens as they are without."""
    if decode is None or decode.token_mul is None:
        return tokens
    mul = b.const("decode_token_mul", np.asarray(decode.token_mul, np.float32))
    add = b.const("decode_token_add", np.asarray(decode.token_add, np.float32))
    return b.op("Add", [b.op("Mul", [tokens, mul], "decoder_tokens_scaled"), add], "decoder_tokens")


def image_epilogue(b, vae, latents: str, scale: float, shift: float, decode=None) -> None:
    """Latents -> uint8 NHWC image, exactly as the host pipeline's decode(); `decode` (a families.graph_ends.
    DecodeFeed) adds its per-channel map after scale and shift, and a video VAE's frames axis."""
    scaled = b.op("Mul", [latents, b.const("decode_scale", np.array(scale, np.float32))], "decoder_scaled")
    if shift:
        scaled = b.op("Add", [scaled, b.const("decode_shift", np.array(shift, np.float32))], "decoder_shifted")
    frames = None
    if decode is not None:
        if decode.channel_div is not None:
            shape = (1, -1, 1, 1)
            div = b.const("decode_channel_div", np.asarray(decode.channel_div, np.float32).reshape(shape))
            add = b.const("decode_channel_add", np.asarray(decode.channel_add, np.float32).reshape(shape))
            scaled = b.op("Add", [b.op("Div", [scaled, div], "decoder_channels_divided"), add], "decoder_channels")
        if decode.frames:
            frames = b.const("decode_frames_axis", np.array([2], np.int64))
            scaled = b.op("Unsqueeze", [scaled, frames], "decoder_one_frame")
    inline(b, vae, {vae.io["latents"]: scaled})
    img = vae.io["out"]
    if frames is not None:
        img = b.op("Squeeze", [img, frames], "decoded_frame")
    half = b.const("half_f", np.array(0.5, np.float32))
    img = b.op("Add", [b.op("Mul", [img, half], "img_half"), half], "img_01")
    img = b.op("Clip", [img, "zero_f", b.const("one_f", np.array(1.0, np.float32))], "img_clip")
    img = b.op("Round", [b.op("Mul", [img, b.const("f255", np.array(255.0, np.float32))], "img_255")], "img_round")
    img = b.op("Transpose", [img], "img_nhwc", perm=[0, 2, 3, 1])
    b.op("Cast", [img], "image", to=TensorProto.UINT8)
