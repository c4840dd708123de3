"""ControlNet for Qwen-Image: diffusers' `QwenImageControlNetModel` and where its block samples join the
Qwen-Image transformer graph.

QwenImageControlNetPipeline encodes the control picture with the video VAE as one frame (posterior; here its
mean), normalizes it with latents_mean / latents_std, packs it 2x2 like the latents, and runs the net on
the conditional batch only: the negative-prompt prediction of true CFG reuses the same block samples. The
net returns one image-token sample (B, tokens, inner_dim) per block; `QwenImageTransformer2DModel.forward`
adds sample i // ceil(len(blocks) / len(samples)) to the image hidden_states after every block i, the last
one included (its output is what norm_out reads).
"""

from __future__ import annotations

import math

from ..errors import UserError
from .base import ComponentSpec, TensorSpec
from .control import (ControlNetSupport, check_transformer_net, packed_control_latents, token_dims,
                      transformer_net_spec)

CLASS = "QwenImageControlNetModel"


def block_name(k: int) -> str:
    return f"controlnet_block_sample_{k}"


def check_qwen_controlnet(config: dict, transformer: dict, family: str) -> dict:
    width = check_transformer_net(config, transformer, family, CLASS,
                                  ("in_channels", "joint_attention_dim", "patch_size"))
    where = "the ControlNet"
    if list(config.get("axes_dims_rope") or ()) != list(transformer.get("axes_dims_rope") or ()):
        raise UserError(f"{where}'s axes_dims_rope {config.get('axes_dims_rope')} is not the folder's transformer's "
                        f"{transformer.get('axes_dims_rope')}")
    if int(config.get("extra_condition_channels") or 0):
        raise UserError(f"{where} takes extra condition channels (an inpainting ControlNet): not supported yet")
    layers = int(config.get("num_layers", 0))
    if layers < 1:
        raise UserError(f"{where}'s config has no transformer blocks (num_layers {layers})")
    return {"family": family, "class": CLASS, "condition": "latents", "blocks": layers, "width": width,
            "latent_channels": int(config["in_channels"]), "backbone_blocks": int(transformer["num_layers"]),
            # the net runs on the conditional half of the guidance batch; both halves take its samples
            "cond_only": True}


def qwen_residuals(record: dict, latent: tuple[int, int, int] | None = None) -> list[tuple[str, tuple]]:
    dims = token_dims(int(record["width"]), latent)
    return [(block_name(k), dims) for k in range(int(record["blocks"]))]


def qwen_controlnet_spec(conditioning: tuple[TensorSpec, ...], record: dict) -> ComponentSpec:
    tokens = ("batch_size", "image_sequence_length", int(record["latent_channels"]))
    return transformer_net_spec(tokens, conditioning, qwen_residuals(record))


def qwen_joins(nodes, record: dict) -> list[tuple[str, str, int, bool]]:
    """The image hidden_states block i hands on, for every reader: the edge from inside block i that block
    i + 1's img_norm1 reads (the text stream goes to its txt_norm1), or for the last block norm_out's."""
    produced = {o: n.name for n in nodes for o in n.output}
    # the wrapper calls the blocks itself: their scopes may lack the /model prefix
    top = "/model" if any(n.name.startswith("/model/transformer_blocks.") for n in nodes) else ""
    blocks = int(record["backbone_blocks"])
    step = math.ceil(blocks / int(record["blocks"]))
    joins = []
    for i in range(blocks):
        inside = f"{top}/transformer_blocks.{i}/"
        reader = f"{top}/transformer_blocks.{i + 1}/img_norm1/" if i + 1 < blocks else f"{top}/norm_out/norm/"
        found = [(n.name, 0) for n in nodes if n.name.startswith(reader) and n.op_type == "LayerNormalization"
                 and produced.get(n.input[0], "").startswith(inside)]
        if len(found) != 1:
            raise UserError(f"the transformer graph has no image edge from block {i} into {reader} (not a "
                            "torch-exported diffusers Qwen-Image transformer, or another block count)")
        joins.append((block_name(i // step), *found[0], True))
    return joins


SUPPORT = ControlNetSupport(
    record=lambda config, transformer, info, family: check_qwen_controlnet(config, transformer, family),
    spec=qwen_controlnet_spec, residuals=qwen_residuals, joins=qwen_joins, latents=packed_control_latents)  # the normalized VAE latents, packed 2x2
