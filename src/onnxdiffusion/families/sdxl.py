"""Stable Diffusion XL: two CLIP text encoders, a UNet with text_time added conditioning.

Prompt encoding (diffusers' StableDiffusionXLPipeline.encode_prompt, clip_skip None): both
encoders' penultimate hidden states, concatenated on the feature axis, are the cross-attention
context; encoder 2's projected pooled output is `text_embeds`; `time_ids` is
(original h, w, crop top, left, target h, w) = (H, W, 0, 0, H, W). With no negative prompt and
`force_zeros_for_empty_prompt` (the default), the unconditional embeddings are zeros.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import UserError
from .base import CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, Ops, TensorSpec, TextEncoderSlot, tokenizer_max_length
from .sd import (CLIP_TOKENIZERS, GUIDANCE, StableDiffusion, _time_cond, latent_io, scheduler_info, text_encoder_spec,
                 vae_info, vae_specs)

PENULTIMATE = "penultimate_hidden_state"


class StableDiffusionXL(StableDiffusion):
    name: ClassVar[str] = "sdxl"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("StableDiffusionXLPipeline",)
    added_text_time: ClassVar[bool] = True
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]] = (
        TextEncoderSlot("text_encoder", "tokenizer", ("CLIPTextModel",), CLIP_TOKENIZERS, (PENULTIMATE,)),
        TextEncoderSlot("text_encoder_2", "tokenizer_2", ("CLIPTextModelWithProjection",), CLIP_TOKENIZERS,
                        (PENULTIMATE, "text_embeds")),
    )

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        unet, te1, te2 = configs["unet"], configs["text_encoder"], configs["text_encoder_2"]
        h1, h2, proj = int(te1["hidden_size"]), int(te2["hidden_size"]), int(te2["projection_dim"])
        if unet.get("addition_embed_type") != "text_time":
            raise UserError(f"an {self.name} UNet needs addition_embed_type 'text_time', this one has "
                            f"{unet.get('addition_embed_type')!r} (components of different models mixed?)")
        if unet.get("cross_attention_dim") != h1 + h2:
            raise UserError(f"the UNet's cross_attention_dim {unet.get('cross_attention_dim')} is not the two text "
                            f"encoders' widths {h1} + {h2} (components of different models mixed?)")
        time_dim = int(unet["addition_time_embed_dim"])
        if unet.get("projection_class_embeddings_input_dim") != 6 * time_dim + proj:
            raise UserError(f"the UNet's added-conditioning width {unet.get('projection_class_embeddings_input_dim')} "
                            f"is not 6 time ids x {time_dim} + pooled {proj}")
        lengths = [tokenizer_max_length(configs, s) for s in self.text_encoders]
        if lengths[0] != lengths[1]:
            raise UserError(f"the two tokenizers pad to different lengths {lengths}")
        vae = vae_info(configs)
        unet_factor = 2 ** (len(unet["block_out_channels"]) - 1)
        size = int(unet["sample_size"]) * vae["vae_scale_factor"]
        return {
            **scheduler_info(configs),
            **vae,
            "size_multiple": vae["vae_scale_factor"] * unet_factor,
            "latent_channels": int(unet["in_channels"]),
            "default_height": size,
            "default_width": size,
            "model_max_length": lengths[0],
            "context_dim": h1 + h2,
            "encoder_widths": [h1, h2],
            "pooled_dim": proj,
            "force_zeros_for_empty_prompt": bool(configs["model_index"].get("force_zeros_for_empty_prompt", True)),
            **_time_cond(unet),
        }

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        specs = (
            TensorSpec(CONTEXT, "float32", ("batch_size", "sequence_length", int(info.context_dim))),
            TensorSpec("text_embeds", "float32", ("batch_size", int(info.pooled_dim))),
            TensorSpec("time_ids", "float32", ("batch_size", 6)),
        )
        return (*specs, TensorSpec(GUIDANCE, "float32", ("batch_size",))) if info.time_cond_proj_dim else specs

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        c = int(info.latent_channels)
        w1, w2 = info.encoder_widths
        slot1, slot2 = self.text_encoders
        specs = {
            "text_encoder": text_encoder_spec(slot1, {PENULTIMATE: w1}),
            "text_encoder_2": text_encoder_spec(slot2, {PENULTIMATE: w2, "text_embeds": int(info.pooled_dim)}),
            "unet": ComponentSpec(
                "unet",
                (TensorSpec(SAMPLE, "float32", latent_io(c)), TensorSpec(TIMESTEP, "float32", ("batch_size",)),
                 *self.conditioning(info)),
                (TensorSpec(OUT, "float32", latent_io(c)),),
                atol=1e-3, kind="unet", source="unet"),
            **vae_specs(c),
        }
        return {k: v for k, v in specs.items() if v.source in present}

    def combine(self, ops: Ops, encoded: dict[str, dict[str, Any]], info: dict) -> dict[str, Any]:
        one, two = encoded["text_encoder"], encoded["text_encoder_2"]
        return {CONTEXT: ops.concat([one[PENULTIMATE], two[PENULTIMATE]], axis=-1),
                "text_embeds": two["text_embeds"]}

    def size_conditioning(self, info: dict, batch: int, height: int, width: int) -> dict[str, np.ndarray]:
        ids = np.array([height, width, 0, 0, height, width], np.float32)
        return {"time_ids": np.tile(ids, (batch, 1))}

    def zero_negative(self, info: dict) -> bool:
        return bool(info.setting("force_zeros_for_empty_prompt", True))
