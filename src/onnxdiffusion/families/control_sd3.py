"""ControlNet for Stable Diffusion 3: diffusers' `SD3ControlNetModel` and where its block samples join the
MMDiT graph.

The net is a copy of the transformer's first blocks fed the latent image plus a patch embedding of the
control image's VAE latents (StableDiffusion3ControlNetPipeline encodes the picture with the VAE and
applies (x - shift) x scaling, shift 0 for nets with force_zeros_for_pooled_projection, which are also fed
zero pooled projections). It returns one token sample (B, tokens, inner_dim) per block.
`SD3Transformer2DModel.forward` adds sample int(i / interval) to hidden_states after every block i that is
not context_pre_only (interval = len(blocks) / len(samples)): that edge is the block's hidden_states output,
read by the next block's norm1, so the graph cut puts an Add there for every reader.
"""

from __future__ import annotations

from ..errors import UserError
from .base import ComponentSpec, TensorSpec
from .control import ControlNetSupport, check_transformer_net, token_dims, transformer_net_spec

CLASS = "SD3ControlNetModel"


def block_name(k: int) -> str:
    return f"controlnet_block_sample_{k}"


def check_sd3_controlnet(config: dict, transformer: dict, info: dict, family: str) -> dict:
    where = "the ControlNet"
    if config.get("_class_name") == CLASS and config.get("joint_attention_dim") is None:
        raise UserError(f"{where} takes no text sequence (joint_attention_dim None, SD3.5-large style): not supported yet")
    width = check_transformer_net(config, transformer, family, CLASS,
                                  ("in_channels", "patch_size", "pooled_projection_dim", "joint_attention_dim"))
    if int(config.get("extra_conditioning_channels") or 0):
        raise UserError(f"{where} takes extra conditioning channels (an inpainting ControlNet): not supported yet")
    layers = int(config.get("num_layers", 0))
    if layers < 1:
        raise UserError(f"{where}'s config has no transformer blocks (num_layers {layers})")
    zero_pooled = bool(config.get("force_zeros_for_pooled_projection", True))
    return {"family": family, "class": CLASS, "condition": "latents", "blocks": layers, "width": width,
            "patch": int(config["patch_size"]), "latent_channels": int(config["in_channels"]),
            "zero_pooled": zero_pooled, "backbone_blocks": int(transformer["num_layers"]),
            # the VAE shift the pipeline subtracts from the control latents (none for the InstantX-style nets)
            "shift": 0.0 if zero_pooled else float(info.vae_shift_factor or 0.0)}


def sd3_residuals(record: dict, latent: tuple[int, int, int] | None = None) -> list[tuple[str, tuple]]:
    """The residual inputs (name, dims): symbolic, or concrete for a (batch, latent h, latent w)."""
    dims = token_dims(int(record["width"]), latent, int(record["patch"]), tokens="image_tokens")
    return [(block_name(k), dims) for k in range(int(record["blocks"]))]


def sd3_controlnet_spec(conditioning: tuple[TensorSpec, ...], record: dict) -> ComponentSpec:
    c = int(record["latent_channels"])
    latent = ("batch_size", c, "height_latent", "width_latent")
    return transformer_net_spec(latent, conditioning, sd3_residuals(record))


def sd3_joins(nodes, record: dict) -> list[tuple[str, str, int, bool]]:
    """(residual, node, input index, every reader) for each transformer block but the last (context_pre_only):
    the hidden_states edge block i hands to block i + 1 (its norm1 and residual Add)."""
    blocks = int(record["backbone_blocks"])
    interval = blocks / int(record["blocks"])
    produced = {}
    for n in nodes:
        for o in n.output:
            produced[o] = n.name
    joins = []
    for i in range(blocks - 1):
        # the next block's norm1 LayerNorm reads hidden_states (its modulation Gemm reads the shared SiLU(temb))
        inside, reader = f"/model/transformer_blocks.{i}/", f"/model/transformer_blocks.{i + 1}/norm1/norm/"
        found = [(n.name, 0) for n in nodes if n.name.startswith(reader) and n.op_type == "LayerNormalization"
                 and produced.get(n.input[0], "").startswith(inside)]
        if not found:
            raise UserError(f"the transformer graph has no edge from block {i} into block {i + 1}'s norm1 "
                            "(not a torch-exported diffusers SD3 transformer, or another block count)")
        joins.append((block_name(int(i / interval)), *found[0], True))
    return joins


def control_latents(info: dict, record: dict, latents):
    """The folder's scaled VAE latents ((mean - vae shift) x scaling) -> the net's control latents."""
    import numpy as np

    delta = (float(info.vae_shift_factor or 0.0) - float(record["shift"])) * float(info.vae_scaling_factor)
    return (latents + np.float32(delta)).astype(np.float32) if delta else latents


SUPPORT = ControlNetSupport(record=check_sd3_controlnet,
                            spec=sd3_controlnet_spec, residuals=sd3_residuals, joins=sd3_joins,
                            latents=control_latents)
