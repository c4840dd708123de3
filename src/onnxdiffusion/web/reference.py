"""An editing page's fourth graph: the picture to edit -> the whole graph's reference latents.

An editing family (image_role "reference", FLUX.1 Kontext) conditions every step on the picture's VAE latents,
packed as the backbone takes them; the host computes them in runtime/references.py (resize to the family's
reference size, [-1, 1] pixels, the VAE encoder's posterior mean, (mean - shift) * scale, the family's packing).
The page does the same in one graph on a uint8 RGB picture of the reference size its settings name: the folder's
own vae_encoder with those steps before and after it. The ids of the reference tokens depend on the size alone:
they are baked into the whole graph (reference_constants). export-web checks this graph against the host's
encoding on a random picture before it writes a page.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import UserError
from ..folder.artifacts import confined

PICTURE = "picture"


def reference_size(pipe, height: int, width: int) -> tuple[int, int]:
    """The size the page's pictures are encoded at: the family's reference size for a picture of the page's own
    output size (another picture is resized to it in the browser)."""
    return pipe.family.reference_size(pipe.info, height, width)


def _latents(pipe, rh: int, rw: int, value: float) -> list[np.ndarray]:
    f = int(pipe.info.vae_scale_factor)
    return [np.full((1, int(pipe.info.latent_channels), rh // f, rw // f), value, np.float32)]


def reference_split(pipe, rh: int, rw: int, inputs: set[str]) -> tuple[dict, list[str]]:
    """({whole-graph input: constant} for the reference inputs fixed by the size (token ids), [the whole-graph
    inputs the reference graph's latents feed]), on both halves of the guidance batch where the graph has them."""
    zeros = pipe.family.reference_inputs(pipe.info, _latents(pipe, rh, rw, 0.0), 1)
    ones = pipe.family.reference_inputs(pipe.info, _latents(pipe, rh, rw, 1.0), 1)
    fixed, fed = {}, []
    for key, value in zeros.items():
        names = [n for n in (f"cond_{key}", f"uncond_{key}") if n in inputs]
        if np.array_equal(value, ones[key]):
            fixed |= {n: value for n in names}
        else:
            fed += names
    if len(set(n.split("_", 1)[1] for n in fed)) != 1:
        raise UserError(f"the page cannot run {pipe.family.name} folders yet: it takes more than one kind of "
                        f"reference latents ({', '.join(fed) or 'none'})")
    return fixed, fed


def reference_graph(pipe, model: Path, rh: int, rw: int) -> onnx.ModelProto:
    """uint8 (1, rh, rw, 3) RGB -> the packed reference latents (1, tokens, channels), as runtime/references.py
    computes them from a picture of that size."""
    entry = pipe.manifest.components.get("vae_encoder")
    if entry is None:
        raise UserError(f"the page cannot edit with {model}: it has no vae_encoder (export it without "
                        "`--skip vae_encoder`)")
    enc = onnx.load(str(confined(model, entry.path, "vae_encoder")))
    g = enc.graph
    _check_attention(pipe, g, rh, rw)
    sample, params = g.input[0].name, g.output[0].name
    info, patch = pipe.info, pipe.family.latent_patch
    c, f = int(info.latent_channels), int(info.vae_scale_factor)
    h, w = rh // f, rw // f

    def const(name, value, dtype=np.float32):
        g.initializer.append(numpy_helper.from_array(np.asarray(value, dtype), "ref/" + name))
        return "ref/" + name

    def op(kind, inputs, out, **attrs):
        g.node.append(helper.make_node(kind, inputs, ["ref/" + out], **attrs))
        return "ref/" + out

    encoder_nodes = list(g.node)
    del g.node[:]
    # [-1, 1] pixels in image_pixels' order of operations (/255, *2, -1), NCHW: what the encoder's nodes read
    x = op("Div", [op("Cast", [PICTURE], "picture_f", to=TensorProto.FLOAT), const("v255", 255.0)], "unit")
    x = op("Sub", [op("Mul", [x, const("two", 2.0)], "twice"), const("one", 1.0)], "signed")
    g.node.append(helper.make_node("Transpose", [x], [sample], perm=[0, 3, 1, 2]))
    g.node.extend(encoder_nodes)
    # the posterior mean (the first half of the moments' channels), then encoder_latents' (mean - shift) * scale
    mean = op("Slice", [params, const("c0", [0], np.int64), const("c1", [c], np.int64), const("ax1", [1], np.int64)],
              "mean")
    shift = np.float32(info.vae_shift_factor or 0.0)
    lat = op("Mul", [op("Sub", [mean, const("shift", shift)], "shifted"), const("scale", np.float32(info.vae_scaling_factor))],
             "latents")
    if patch:  # packed p x p patch tokens: (1, C, h, w) -> (1, h/p * w/p, C * p * p), lat.pack_patches' order
        p = int(patch)
        six = op("Reshape", [lat, const("patch_shape", [1, c, h // p, p, w // p, p], np.int64)], "patches")
        moved = op("Transpose", [six], "patches_moved", perm=[0, 2, 4, 1, 3, 5])
        lat = op("Reshape", [moved, const("token_shape", [1, (h // p) * (w // p), c * p * p], np.int64)], "tokens")
    del g.input[:]
    g.input.append(helper.make_tensor_value_info(PICTURE, TensorProto.UINT8, [1, rh, rw, 3]))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(lat, TensorProto.FLOAT, None))
    return enc


# onnxruntime-web's WASM build fails a VAE attention whose score matrix (tokens^2 float32) passes 256 MiB ("Integer
# overflow", ORT-web 1.2x in node): measured on a tiny VAE, 7744 tokens run, 9216 fail. A 1-megapixel reference
# picture (Kontext's preferred resolutions) is 16384 latent tokens at the mid-block.
MAX_ATTENTION_SCORES = 1 << 26
ATTENTION_OPS = ("MultiHeadAttention", "Attention", "Softmax")


def _check_attention(pipe, g, rh: int, rw: int) -> None:
    f = int(pipe.info.vae_scale_factor)
    tokens = (rh // f) * (rw // f)  # the encoder's mid-block runs on the latent grid
    if tokens * tokens > MAX_ATTENTION_SCORES and any(n.op_type in ATTENTION_OPS for n in g.node):
        raise UserError(f"the page cannot run {pipe.family.name} folders yet: their VAE encoder's attention over the "
                        f"{tokens} latent tokens of a {rh}x{rw} reference picture takes {tokens}^2 scores, past what "
                        "onnxruntime-web's WASM build allocates")


def check_reference_graph(pipe, graph: onnx.ModelProto, rh: int, rw: int) -> str:
    """The graph's latents on a random picture against the host's encoding of it (reference_latents + the family's
    reference_inputs): refuses the page if they differ; returns the graph's output name."""
    import onnxruntime

    from ..runtime.image_input import image_pixels

    picture = np.random.default_rng(0).integers(0, 256, (1, rh, rw, 3), dtype=np.uint8)
    sess = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {PICTURE: picture})[0]
    mean = pipe.encode_pixels(image_pixels(picture[0], rh, rw))
    want = [v for k, v in pipe.family.reference_inputs(pipe.info, [mean], 1).items()
            if v.shape == got.shape and v.dtype == np.float32]
    if not want or not any(np.allclose(got, v, rtol=1e-4, atol=1e-4) for v in want):
        raise UserError(f"the page cannot run {pipe.family.name} folders yet: its reference encoding in one graph "
                        "does not reproduce the host's")
    return graph.graph.output[0].name
