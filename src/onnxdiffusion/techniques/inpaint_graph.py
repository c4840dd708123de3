"""img2img's and inpainting's Loop twin: the sampling graph's image inputs (the start row, the picture's latents,
the kept region; loopgraph/builder.py's docstring) and the inpainting blend after each step, the twin of
inpaint.blend_step (tests/runtime/test_inpaint.py runs both)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto, helper

from ..loopgraph.state import GraphState

# image inputs (module docstring): name -> default; a default makes the input optional to feed
LATENT_SHAPED = ("image_latents", "keep")
IMAGE_INPUTS = {"start": np.array(0, np.int64), "image_latents": np.zeros((1,), np.float32),
                "image_scale": np.array(0.0, np.float32), "keep": np.zeros((1,), np.float32),
                "blend": np.zeros((1, 2), np.float32)}


def image_defaults(b, latent_rank: int) -> None:
    """Each image input's default as an overridable initializer (latent-shaped ones all-ones dims: a
    broadcast zero), so a text-to-image feed need not name them."""
    for name, value in IMAGE_INPUTS.items():
        b.const(name, value.reshape((1,) * (1 + latent_rank)) if name in LATENT_SHAPED else value)


def image_inputs(latent_rank: int) -> list:
    f = TensorProto.FLOAT
    return [helper.make_tensor_value_info("start", TensorProto.INT64, []),
            helper.make_tensor_value_info("image_latents", f, [f"image_{k}" for k in range(1 + latent_rank)]),
            helper.make_tensor_value_info("image_scale", f, []),
            helper.make_tensor_value_info("keep", f, [f"keep_{k}" for k in range(1 + latent_rank)]),
            helper.make_tensor_value_info("blend", f, ["blend_rows", 2])]


def blend_step(b, pre: GraphState, j: str, x_new: str, n: Callable[[str], str]) -> str:
    """x = keep * (blend[j, 0] * image_latents + blend[j, 1] * latents) + (1 - keep) * x (keep = 0: x as is)."""
    bl = b.op("Gather", ["blend", b.op("Min", [j, pre.blend_last], n("blend_idx"))], n("blend_row"), axis=0)
    target = b.op("Add", [b.op("Mul", ["image_latents", b.op("Gather", [bl, "blend_col0"], n("blend_s"), axis=0)],
                                n("blend_img")),
                          b.op("Mul", ["latents", b.op("Gather", [bl, "blend_col1"], n("blend_n"), axis=0)],
                               n("blend_noise"))], n("blend_target"))
    return b.op("Add", [b.op("Mul", ["keep", target], n("kept")), b.op("Mul", [pre.inv_keep, x_new], n("free"))],
                n("x_blended"))
