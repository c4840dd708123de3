"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, a UNet2DConditionModel, epsilon or v prediction."""

from __future__ import annotations

from typing import Any, ClassVar

from ..errors import UserError
from .base import (CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, Family, Ops, TensorSpec, TextEncoderSlot,
                   tokenizer_max_length)

CLIP_TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")


def latent_io(latent_channels: int) -> tuple[str | int, ...]:
    return ("batch_size", latent_channels, "height_latent", "width_latent")


def vae_specs(latent_channels: int) -> dict[str, ComponentSpec]:
    """The VAE halves every family shares (names follow optimum's ONNX diffusion layout)."""
    lat = latent_io(latent_channels)
    img = ("batch_size", 3, "height", "width")
    return {
        "vae_decoder": ComponentSpec(
            "vae_decoder", (TensorSpec("latent_sample", "float32", lat),), (TensorSpec("sample", "float32", img),),
            atol=2e-3, kind="vae_decoder", source="vae"),
        "vae_encoder": ComponentSpec(
            "vae_encoder", (TensorSpec("sample", "float32", img),),
            (TensorSpec("latent_parameters", "float32",
                        ("batch_size", 2 * latent_channels, "height_latent", "width_latent")),),
            atol=2e-3, kind="vae_encoder", source="vae"),
    }


def text_encoder_spec(slot: TextEncoderSlot, width: dict[str, int]) -> ComponentSpec:
    """A text encoder exporting the outputs its slot reads; `width` gives each output's last dim."""
    seq = ("batch_size", "sequence_length")
    outs = tuple(TensorSpec(o, "float32", ("batch_size", width[o]) if o in ("pooler_output", "text_embeds")
                            else (*seq, width[o])) for o in slot.outputs)
    return ComponentSpec(slot.name, (TensorSpec("input_ids", "int32", seq),), outs, atol=1e-4,
                         kind="text_encoder", source=slot.name, options={"outputs": slot.outputs})


def vae_info(configs: dict[str, dict]) -> dict:
    vae = configs["vae"]
    if vae.get("latents_mean") is not None or vae.get("latents_std") is not None:
        raise UserError("VAE configs with per-channel latents_mean/latents_std are not supported yet")
    return {
        "vae_scaling_factor": float(vae.get("scaling_factor", 0.18215)),
        "vae_shift_factor": float(vae.get("shift_factor") or 0.0),
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
    }


def scheduler_info(configs: dict[str, dict]) -> dict:
    sched = configs["scheduler"]
    return {
        "prediction_type": sched.get("prediction_type") or "epsilon",
        "num_train_timesteps": int(sched.get("num_train_timesteps", 1000)),
    }


def unet_dims(info: dict, steps: int) -> list[dict[str, int]]:
    """Latent-space validation shapes: square at export, then one step wider with batch 1."""
    lat = min(int(info.default_height) // int(info.vae_scale_factor), 32)
    m = int(info.size_multiple) // int(info.vae_scale_factor)
    lat = max(lat - lat % m, m)
    f = int(info.vae_scale_factor)
    return [
        {"batch_size": 2, "height_latent": lat, "width_latent": lat, "height": lat * f, "width": lat * f},
        {"batch_size": 1, "height_latent": lat, "width_latent": lat + steps * m,
         "height": lat * f, "width": (lat + steps * m) * f},
    ]


class StableDiffusion(Family):
    name: ClassVar[str] = "sd"
    # an inpainting pipeline's folder: the same components, its UNet taking mask + masked-image latents too
    pipeline_classes: ClassVar[tuple[str, ...]] = ("StableDiffusionPipeline", "StableDiffusionInpaintPipeline")
    backbone: ClassVar[str] = "unet"
    latent_image_input: ClassVar[bool] = True
    backbone_classes: ClassVar[tuple[str, ...]] = ("UNet2DConditionModel",)
    backbone_kind: ClassVar[str] = "unet"
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]] = (
        TextEncoderSlot("text_encoder", "tokenizer", ("CLIPTextModel",), CLIP_TOKENIZERS,
                        ("last_hidden_state", "pooler_output")),
    )

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        unet, te = configs["unet"], configs["text_encoder"]
        hidden = int(te["hidden_size"])
        if unet.get("cross_attention_dim") != hidden:
            raise UserError(f"text encoder width {hidden} does not match the UNet's cross_attention_dim "
                            f"{unet.get('cross_attention_dim')} (components of different models mixed?)")
        if unet.get("addition_embed_type") is not None:
            raise UserError(f"this UNet expects added conditioning ({unet['addition_embed_type']}), "
                            f"which a {self.name} pipeline does not provide")
        vae = vae_info(configs)
        unet_factor = 2 ** (len(unet["block_out_channels"]) - 1)
        size = int(unet["sample_size"]) * vae["vae_scale_factor"]
        c, unet_in = int(configs["vae"].get("latent_channels", unet["in_channels"])), int(unet["in_channels"])
        if unet_in not in (c, 2 * c + 1):
            raise UserError(f"the UNet takes {unet_in} input channels; the VAE's latents have {c} "
                            f"(an inpainting UNet takes {2 * c + 1})")
        extra = {"backbone_in_channels": unet_in} if unet_in != c else {}
        return {
            **scheduler_info(configs),
            **vae,
            **extra,
            "size_multiple": vae["vae_scale_factor"] * unet_factor,
            "latent_channels": c,
            "default_height": size,
            "default_width": size,
            "model_max_length": tokenizer_max_length(configs, self.text_encoders[0]),
            "context_dim": hidden,
            **_time_cond(unet),
        }

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        specs = (TensorSpec(CONTEXT, "float32", ("batch_size", "sequence_length", _context_dim(info))),)
        return (*specs, TensorSpec(GUIDANCE, "float32", ("batch_size",))) if info.time_cond_proj_dim else specs

    def cache_span(self, method: str, node_names: list[str], branch: int = 1,
                   layers: int = 0, all_blocks: bool = False) -> tuple[tuple[str, ...], str | None]:
        """DeepCache: the UNet's deep path is skipped on cached steps, the shallow part around it always runs.
        `branch` down/up block pairs are shallow (down blocks from `branch` on, the mid block, the up blocks
        but the last `branch` are the deep path); or, `layers` > 0, at DeepCache's layer granularity: conv_in,
        the next `layers` - 1 down layers (resnets, downsamplers) and the last `layers` up resnets always run,
        and the cached feature is what enters the first of those up resnets."""
        import re

        if method != "deepcache":
            raise ValueError(f"{method} caches transformer blocks; use deepcache on a UNet backbone")
        if layers:
            return _layer_span(node_names, layers), None
        idx = {kind: sorted({int(m.group(1)) for n in node_names if (m := re.match(rf"^/model/{kind}\.(\d+)/", n))})
               for kind in ("down_blocks", "up_blocks")}
        downs, ups = idx["down_blocks"], idx["up_blocks"]
        if not downs or len(downs) != len(ups) or branch >= len(downs):
            raise ValueError(f"deepcache branch {branch} needs more than {branch} down/up block pairs "
                             f"(this UNet has {len(downs)})")
        span = [f"/model/down_blocks.{i}/" for i in downs[branch:]] + ["/model/mid_block/"]
        span += [f"/model/up_blocks.{i}/" for i in ups[:len(ups) - branch]]
        return tuple(span), None

    added_text_time: ClassVar[bool] = False  # the UNet's addition_embed_type is text_time (SDXL)

    def controlnet_record(self, config: dict, backbone_config: dict, info: dict) -> dict:
        from .control import check_controlnet

        return check_controlnet(config, backbone_config, info, self.name, text_time=self.added_text_time)

    def controlnet_spec(self, info: dict, record: dict) -> ComponentSpec:
        from .control import controlnet_spec

        return controlnet_spec(self.conditioning(info), record, int(info.latent_channels))

    def control_residuals(self, record: dict, latent=None) -> list[tuple[str, tuple]]:
        from .control import unet_residuals_io

        return unet_residuals_io(record, latent)

    def control_joins(self, nodes, record: dict) -> list[tuple[str, str, int, bool]]:
        from .control import unet_joins

        return unet_joins(nodes, record)

    def guidance_input_for(self, info: dict) -> str | None:
        # an LCM-distilled UNet (time_cond_proj_dim) embeds the guidance scale and runs without CFG,
        # as diffusers' pipelines do for it; the export wrapper turns the scale into timestep_cond
        return GUIDANCE if info.time_cond_proj_dim else None

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        hidden = _context_dim(info)
        c = int(info.latent_channels)
        specs = {"text_encoder": text_encoder_spec(self.text_encoders[0],
                                                   {"last_hidden_state": hidden, "pooler_output": hidden})}
        specs["unet"] = ComponentSpec(
            "unet",
            (TensorSpec(SAMPLE, "float32", latent_io(int(info.setting("backbone_in_channels", c)))),
             TensorSpec(TIMESTEP, "float32", ("batch_size",)),
             *self.conditioning(info)),
            (TensorSpec(OUT, "float32", latent_io(c)),),
            atol=1e-3, kind=self.backbone_kind, source="unet")
        specs.update(vae_specs(c))
        return {k: v for k, v in specs.items() if v.source in present}

    def export_dims(self, spec: ComponentSpec, info: dict) -> list[dict[str, int]]:
        seq = int(info.model_max_length)
        if spec.kind == "text_encoder":
            return [{"batch_size": 2, "sequence_length": seq}, {"batch_size": 1, "sequence_length": max(2, seq // 2)}]
        return [{**d, "sequence_length": seq} for d in unet_dims(info, 1)]

    def combine(self, ops: Ops, encoded: dict[str, dict[str, Any]], info: dict) -> dict[str, Any]:
        return {CONTEXT: encoded["text_encoder"]["last_hidden_state"]}


GUIDANCE = "guidance"


def _unet_layers(node_names: list[str]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """The UNet's skip layers as node-name prefixes: the down layers after conv_in in order (each resnet with
    its attention, each downsampler: each gives one skip feature) and the up resnets in order (each with its
    attention, the last of a block with the block's upsampler: each reads one skip feature)."""
    import re

    found: dict[tuple[str, int], dict[int, set[str]]] = {}
    for n in node_names:
        if m := re.match(r"^/model/(down|up)_blocks\.(\d+)/(resnets|attentions|downsamplers|upsamplers)\.(\d+)/", n):
            found.setdefault((m.group(1), int(m.group(2))), {}).setdefault(int(m.group(4)), set()).add(m.group(3))
    downs: list[tuple[str, ...]] = []
    ups: list[tuple[str, ...]] = []
    for (kind, i), layer in sorted(found.items(), key=lambda kv: (kv[0][0] == "up", kv[0][1])):
        base = f"/model/{kind}_blocks.{i}/"
        resnets = [j for j in sorted(layer) if "resnets" in layer[j]]
        for j in resnets:
            unit = [f"{base}resnets.{j}/"] + ([f"{base}attentions.{j}/"] if "attentions" in layer[j] else [])
            if kind == "up" and j == resnets[-1]:
                unit += [f"{base}upsamplers.{k}/" for k in sorted(layer) if "upsamplers" in layer[k]]
            (downs if kind == "down" else ups).append(tuple(unit))
        if kind == "down":
            downs += [(f"{base}downsamplers.{k}/",) for k in sorted(layer) if "downsamplers" in layer[k]]
    return downs, ups


def _layer_span(node_names: list[str], layers: int) -> tuple[str, ...]:
    downs, ups = _unet_layers(node_names)
    # conv_in's feature is the first skip: one more up resnet than down layers after it
    if not ups or len(ups) != len(downs) + 1 or not 1 <= layers < len(ups):
        raise ValueError(f"deepcache layer branch L{layers} needs 1 <= L < {max(len(ups), 2)} "
                         f"(this UNet's up path has {len(ups)} skip layers)")
    span = [p for unit in downs[layers - 1:] for p in unit] + ["/model/mid_block/"]
    return tuple(span + [p for unit in ups[:len(ups) - layers] for p in unit])


def _time_cond(unet: dict) -> dict:
    dim = unet.get("time_cond_proj_dim")
    return {"time_cond_proj_dim": int(dim)} if dim else {}


def _context_dim(info: dict) -> int | str:
    # folders exported before families recorded no width: a named axis serves the run time
    return int(info.context_dim) if info.context_dim is not None else "context_dim"
