"""ControlNet for Flux: diffusers' `FluxControlNetModel` (InstantX-style: the control picture's packed VAE
latents, no union modes, no XLabs hint block) and where its samples join the Flux transformer graph.

FluxControlNetPipeline encodes the picture with the VAE ((x - shift) x scaling), packs it 2x2 like the
latents, and runs the net on the latent batch (Flux has no CFG), with the guidance only if the net embeds
it. The net returns one image-token sample (B, tokens, inner_dim) per double block and per single block.
`FluxTransformer2DModel.forward` adds double sample i // ceil(len(blocks) / len(samples)) to the image
hidden_states after double block i, and the single samples after each single block by the same rule.
"""

from __future__ import annotations

import math

from ..errors import UserError
from .base import ComponentSpec, TensorSpec
from .control import (ControlNetSupport, check_transformer_net, packed_control_latents, token_dims,
                      transformer_net_spec)

CLASS = "FluxControlNetModel"


def double_name(k: int) -> str:
    return f"controlnet_block_sample_{k}"


def single_name(k: int) -> str:
    return f"controlnet_single_block_sample_{k}"


def check_flux_controlnet(config: dict, transformer: dict, family: str) -> dict:
    width = check_transformer_net(config, transformer, family, CLASS,
                                  ("in_channels", "joint_attention_dim", "pooled_projection_dim"))
    where = "the ControlNet"
    if config.get("num_mode") is not None:
        raise UserError(f"{where} is a union ControlNet (num_mode {config['num_mode']}): control modes are not supported yet")
    if config.get("conditioning_embedding_channels") is not None:
        raise UserError(f"{where} has an XLabs-style hint block (conditioning_embedding_channels): not supported yet")
    doubles, singles = int(config.get("num_layers", 0)), int(config.get("num_single_layers", 0))
    if doubles + singles < 1:
        raise UserError(f"{where}'s config has no transformer blocks")
    return {"family": family, "class": CLASS, "condition": "latents", "blocks": doubles, "single_blocks": singles,
            "width": width, "latent_channels": int(config["in_channels"]),
            "guidance": bool(config.get("guidance_embeds", False)),
            "backbone_blocks": int(transformer["num_layers"]),
            "backbone_single_blocks": int(transformer["num_single_layers"])}


def flux_residuals(record: dict, latent: tuple[int, int, int] | None = None) -> list[tuple[str, tuple]]:
    dims = token_dims(int(record["width"]), latent)
    return ([(double_name(k), dims) for k in range(int(record["blocks"]))]
            + [(single_name(k), dims) for k in range(int(record["single_blocks"]))])


def flux_controlnet_spec(conditioning: tuple[TensorSpec, ...], record: dict) -> ComponentSpec:
    tokens = ("batch_size", "image_sequence_length", int(record["latent_channels"]))
    cond = tuple(t for t in conditioning if t.name != "guidance" or record["guidance"])
    return transformer_net_spec(tokens, cond, flux_residuals(record))


def _image_edge(nodes, produced: dict, block: str, reader: str, op: str, slot: int) -> tuple[str, int]:
    """(node, input) of the `op` node under `reader` whose input `slot` comes from inside `block`."""
    for n in nodes:
        if n.name.startswith(reader) and n.op_type == op and len(n.input) > slot \
                and produced.get(n.input[slot], "").startswith(block):
            return n.name, slot
    raise UserError(f"the transformer graph has no image edge from {block} into {reader} (not a torch-exported "
                    "diffusers Flux transformer, or another block count)")


def flux_joins(nodes, record: dict) -> list[tuple[str, str, int, bool]]:
    """The image hidden_states each block hands on: a double block's to the next double block's norm1
    LayerNorm (the last one's to single block 0's text+image Concat, input 1), a single block's to the next
    single block's Concat (the last one's to norm_out's LayerNorm)."""
    produced = {o: n.name for n in nodes for o in n.output}
    d, s = int(record["backbone_blocks"]), int(record["backbone_single_blocks"])
    single0 = ("/model/single_transformer_blocks.0/", "Concat", 1) if s else ("/model/norm_out/", "LayerNormalization", 0)
    joins = []
    if int(record["blocks"]):
        step = math.ceil(d / int(record["blocks"]))
        for i in range(d):
            reader = (f"/model/transformer_blocks.{i + 1}/norm1/", "LayerNormalization", 0) if i + 1 < d else single0
            edge = _image_edge(nodes, produced, f"/model/transformer_blocks.{i}/", *reader)
            joins.append((double_name(i // step), *edge, True))
    if int(record["single_blocks"]) and s:
        step = math.ceil(s / int(record["single_blocks"]))
        for j in range(s):
            reader = ((f"/model/single_transformer_blocks.{j + 1}/", "Concat", 1) if j + 1 < s
                      else ("/model/norm_out/", "LayerNormalization", 0))
            edge = _image_edge(nodes, produced, f"/model/single_transformer_blocks.{j}/", *reader)
            joins.append((single_name(j // step), *edge, True))
    return joins


SUPPORT = ControlNetSupport(
    record=lambda config, transformer, info, family: check_flux_controlnet(config, transformer, family),
    spec=flux_controlnet_spec, residuals=flux_residuals, joins=flux_joins, latents=packed_control_latents)  # the scaled VAE latents, packed 2x2
