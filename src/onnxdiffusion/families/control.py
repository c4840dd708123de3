"""ControlNet for the UNet families: which ControlNets fit a folder's UNet, their exported I/O, and where
their residuals join the UNet graph.

A diffusers `ControlNetModel` is a copy of the UNet's encoder half: it returns one residual per skip
connection the UNet's up blocks read (`down_block_res_samples`: conv_in's output, then each down block's
layers and downsampler) and one for the mid block's output. `UNet2DConditionModel.forward` adds them to
exactly those tensors, so a folder's UNet takes them by graph surgery at load time (techniques/controlnet.py)
at the sites `unet_sites` names: the second input of each top-level `/model/up_blocks.i/Concat*` node (up
block 0 reads the last residual) and the mid block's output (the first input of up block 0's first Concat).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UserError
from .base import SAMPLE, TIMESTEP, ComponentSpec, TensorSpec

COND, SCALE = "controlnet_cond", "conditioning_scale"  # the control image (B, 3, H, W) in [0, 1]; its weight
MID = "mid_block_res_sample"


@dataclass(frozen=True)
class ControlNetSupport:
    """A family's ControlNet support: the functions `Family`'s ControlNet methods delegate to, one table per
    control module, so a family declares its support in one line (`controlnet = control_x.SUPPORT`)."""

    record: Callable[[dict, dict, dict, str], dict]  # (net config, backbone config, folder info, family name)
    spec: Callable[[tuple[TensorSpec, ...], dict], ComponentSpec]  # (backbone conditioning, record)
    residuals: Callable[..., list[tuple[str, tuple]]]  # (record, latent=None)
    joins: Callable[[Any, dict], list[tuple[str, str, int, bool]]]  # (backbone NodeProtos, record)
    latents: Callable[..., Any]  # (info, record, scaled VAE latents[, inpainting parts]) -> the net's controlnet_cond


def down_name(k: int) -> str:
    return f"down_block_res_sample_{k}"


def _layers(cfg: dict, n: int) -> list[int]:
    layers = cfg.get("layers_per_block", 2)
    return [int(layers)] * n if isinstance(layers, int) else [int(v) for v in layers]


def unet_residuals(cfg: dict) -> list[list[int]]:
    """[channels, latent downscale] of each down residual of a UNet-shaped config (the UNet's skip path
    or a ControlNet's outputs), in diffusers' order, then the mid block's."""
    blocks = [int(c) for c in cfg["block_out_channels"]]
    out, f = [[blocks[0], 1]], 1
    for i, (c, n) in enumerate(zip(blocks, _layers(cfg, len(blocks)))):
        out += [[c, f]] * n
        if i < len(blocks) - 1:  # diffusers: every down block but the last downsamples
            f *= 2
            out.append([c, f])
    return out + [[blocks[-1], f]]


def check_controlnet(config: dict, unet: dict, info: dict, family: str, text_time: bool) -> dict:
    """The record of a ControlNetModel config that fits this UNet; one line naming the first mismatch."""
    where = "the ControlNet"
    if config.get("_class_name") != "ControlNetModel":
        raise UserError(f"{where} is {config.get('_class_name')!r}; a {family} folder takes a diffusers ControlNetModel")
    kind = config.get("addition_embed_type")
    if (kind == "text_time") != text_time:
        other = "sdxl" if kind == "text_time" else "sd"
        raise UserError(f"{where} is for a {other} UNet (addition_embed_type {kind!r}); this folder is {family}")
    for key in ("in_channels", "cross_attention_dim", "addition_time_embed_dim", "projection_class_embeddings_input_dim"):
        if config.get(key) != unet.get(key):
            raise UserError(f"{where}'s {key} {config.get(key)!r} is not the folder's UNet's {unet.get(key)!r} "
                            "(a ControlNet of another model size)")
    try:
        mine, theirs = unet_residuals(config), unet_residuals(unet)
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}'s config has no usable block_out_channels / layers_per_block") from None
    if mine != theirs:
        raise UserError(f"{where}'s residuals ({[c for c, _ in mine]} channels) do not fit the folder's UNet's skip "
                        f"connections ({[c for c, _ in theirs]}): a ControlNet of another model size")
    emb = config.get("conditioning_embedding_out_channels") or (16, 32, 96, 256)
    factor = 2 ** (len(emb) - 1)
    if factor != int(info.vae_scale_factor):
        raise UserError(f"{where} downscales its control image {factor}x, the folder's VAE {info.vae_scale_factor}x")
    if config.get("time_cond_proj_dim") or info.time_cond_proj_dim:
        raise UserError("ControlNet with a guidance-embedding (LCM-distilled) UNet is not supported yet")
    return {"family": family, "class": "ControlNetModel", "residuals": mine[:-1], "mid": mine[-1],
            "cross_attention_dim": int(config["cross_attention_dim"]),
            "conditioning_channels": int(config.get("conditioning_channels", 3)),
            "image_factor": factor, "controlnet_conditioning_channel_order": config.get(
                "controlnet_conditioning_channel_order", "rgb")}


def controlnet_spec(conditioning: tuple[TensorSpec, ...], record: dict, latent_channels: int) -> ComponentSpec:
    """sample, timestep, the UNet's conditioning, the control image and its scale -> the residuals."""

    def res(name: str, channels: int, f: int) -> TensorSpec:
        h, w = ("height_latent", "width_latent") if f == 1 else (f"height_latent_{f}", f"width_latent_{f}")
        return TensorSpec(name, "float32", ("batch_size", channels, h, w))

    outs = [res(down_name(k), c, f) for k, (c, f) in enumerate(record["residuals"])]
    outs.append(res(MID, *record["mid"]))
    ins = (TensorSpec(SAMPLE, "float32", ("batch_size", latent_channels, "height_latent", "width_latent")),
           TensorSpec(TIMESTEP, "float32", ("batch_size",)), *conditioning,
           TensorSpec(COND, "float32", ("batch_size", int(record["conditioning_channels"]), "height", "width")),
           TensorSpec(SCALE, "float32", (1,)))
    return ComponentSpec("controlnet", ins, tuple(outs), atol=1e-3, kind="controlnet", source="controlnet")


def unet_sites(node_names: list[str]) -> tuple[list[str], tuple[str, int]]:
    """The top-level skip Concats of a UNet graph in down-residual order, and the edge that carries the mid
    block's output (input 0 of up block 0's first Concat)."""
    pat = re.compile(r"^/model/up_blocks\.(\d+)/Concat(?:_(\d+))?$")
    found = sorted(((int(m.group(1)), int(m.group(2) or 0)), n) for n in node_names if (m := pat.match(n)))
    if not found or not any(n.startswith("/model/mid_block/") for n in node_names):
        raise UserError("the UNet graph has no /model/up_blocks.*/Concat skip joins or no mid block "
                        "(not a torch-exported diffusers UNet?)")
    return [n for _, n in reversed(found)], (found[0][1], 0)


def unet_residuals_io(record: dict, latent: tuple[int, int, int] | None = None) -> list[tuple[str, tuple]]:
    """The residual inputs (name, dims) of a UNet record: symbolic, or concrete for (batch, latent h, w)."""
    out = []
    for name, (c, f) in zip([*map(down_name, range(len(record["residuals"]))), MID],
                            [*record["residuals"], record["mid"]]):
        if latent is not None:
            out.append((name, (latent[0], int(c), latent[1] // int(f), latent[2] // int(f))))
        else:
            h, w = ("height_latent", "width_latent") if f == 1 else (f"height_latent_{f}", f"width_latent_{f}")
            out.append((name, ("batch_size", int(c), h, w)))
    return out


def unet_joins(nodes, record: dict) -> list[tuple[str, str, int, bool]]:
    """(residual, node, input index, every reader): down residual k on input 1 of the k-th skip join only
    (the edge also feeds the next down block), the mid residual for every reader of the mid block's output."""
    sites, (mid_node, mid_input) = unet_sites([n.name for n in nodes])
    if len(sites) != len(record["residuals"]):
        raise UserError(f"the backbone graph has {len(sites)} skip joins, the ControlNet gives "
                        f"{len(record['residuals'])} down residuals (a ControlNet of another model size)")
    return [(down_name(k), s, 1, False) for k, s in enumerate(sites)] + [(MID, mid_node, mid_input, True)]


def check_transformer_net(config: dict, transformer: dict, family: str, cls_name: str,
                          same: tuple[str, ...] = ()) -> int:
    """A transformer ControlNet's class, width and the `same` config keys against the folder's transformer;
    returns the width (heads x head dim)."""
    where = "the ControlNet"
    cls = config.get("_class_name")
    if cls != cls_name:
        raise UserError(f"{where} is {cls!r}; a {family} folder takes a diffusers {cls_name}")
    inner = [int(c.get("num_attention_heads", 0)) * int(c.get("attention_head_dim", 0)) for c in (config, transformer)]
    if inner[0] != inner[1]:
        raise UserError(f"{where}'s width {inner[0]} is not the folder's transformer's {inner[1]} (a ControlNet of "
                        "another model size)")
    for key in same:
        if config.get(key) != transformer.get(key):
            raise UserError(f"{where}'s {key} {config.get(key)!r} is not the folder's transformer's "
                            f"{transformer.get(key)!r} (a ControlNet of another model size)")
    return inner[0]


def token_dims(width: int, latent: tuple[int, int, int] | None = None, patch: int = 2,
               tokens: str = "image_sequence_length") -> tuple:
    """(batch, image tokens, width) of a transformer net's block samples: symbolic, or concrete for a (batch,
    latent height, latent width) cut into patch x patch tokens."""
    if latent is None:
        return ("batch_size", tokens, width)
    return (latent[0], (latent[1] // patch) * (latent[2] // patch), width)


def transformer_net_spec(sample: tuple, conditioning: tuple[TensorSpec, ...],
                         residuals: list[tuple[str, tuple]]) -> ComponentSpec:
    """A transformer ControlNet's I/O: sample, timestep, the backbone's conditioning, the control latents (laid out
    as the sample) and the scale -> its block samples."""
    ins = (TensorSpec(SAMPLE, "float32", sample), TensorSpec(TIMESTEP, "float32", ("batch_size",)), *conditioning,
           TensorSpec(COND, "float32", sample), TensorSpec(SCALE, "float32", (1,)))
    outs = tuple(TensorSpec(n, "float32", d) for n, d in residuals)
    return ComponentSpec("controlnet", ins, outs, atol=1e-3, kind="controlnet", source="controlnet")


def packed_control_latents(info: dict, record: dict, latents):
    """The folder's VAE latents of the control picture (scaled, or normalized per channel, as the family's VAE
    does) -> packed 2x2 tokens, as the Flux and Qwen-Image ControlNet pipelines pack them."""
    from . import latents as lat

    return lat.pack_patches(latents)
