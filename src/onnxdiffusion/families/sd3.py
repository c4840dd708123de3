"""Stable Diffusion 3 / 3.5: two CLIP-with-projection encoders, an optional T5, an MMDiT, flow matching.

Prompt encoding (diffusers' StableDiffusion3Pipeline.encode_prompt, clip_skip None): the CLIP
encoders' penultimate hidden states are concatenated on the feature axis and zero-padded to the
transformer's joint_attention_dim, then concatenated along the sequence with T5's last hidden
state (zeros of T5's length when the folder has no T5); the CLIP projections (text_embeds) are
concatenated into `pooled_projections`. A missing negative prompt is encoded as "".
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..errors import UserError
from . import control_sd3
from .base import (CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, Family, Ops, SizeLimits, TensorSpec, TextEncoderSlot,
                   tokenizer_max_length)
from .sd import CLIP_TOKENIZERS, latent_io, text_encoder_spec, unet_dims, vae_info, vae_specs

PENULTIMATE = "penultimate_hidden_state"
T5_LENGTH = 256  # diffusers' max_sequence_length default for SD3
POOLED = "pooled_projections"


class StableDiffusion3(Family):
    name: ClassVar[str] = "sd3"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("StableDiffusion3Pipeline",)
    backbone: ClassVar[str] = "transformer"
    backbone_classes: ClassVar[tuple[str, ...]] = ("SD3Transformer2DModel",)
    backbone_kind: ClassVar[str] = "transformer"
    predictions: ClassVar[tuple[str, ...]] = ("flow",)
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]] = (
        TextEncoderSlot("text_encoder", "tokenizer", ("CLIPTextModelWithProjection",), CLIP_TOKENIZERS,
                        (PENULTIMATE, "text_embeds")),
        TextEncoderSlot("text_encoder_2", "tokenizer_2", ("CLIPTextModelWithProjection",), CLIP_TOKENIZERS,
                        (PENULTIMATE, "text_embeds")),
        TextEncoderSlot("text_encoder_3", "tokenizer_3", ("T5EncoderModel",), ("T5Tokenizer", "T5TokenizerFast"),
                        ("last_hidden_state",), required=False, max_length=T5_LENGTH),
    )

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        tr, te1, te2 = configs["transformer"], configs["text_encoder"], configs["text_encoder_2"]
        joint = int(tr["joint_attention_dim"])
        widths = [int(te1["hidden_size"]), int(te2["hidden_size"])]
        projections = [int(te1["projection_dim"]), int(te2["projection_dim"])]
        if sum(widths) > joint:
            raise UserError(f"the CLIP encoders' widths {widths} exceed the transformer's joint_attention_dim {joint} "
                            f"(components of different models mixed?)")
        if sum(projections) != int(tr["pooled_projection_dim"]):
            raise UserError(f"the CLIP projections {projections} do not add up to the transformer's "
                            f"pooled_projection_dim {tr['pooled_projection_dim']} (components of different models mixed?)")
        t5 = configs.get("text_encoder_3")
        if t5 is not None and int(t5["d_model"]) != joint:
            raise UserError(f"the T5 encoder's width {t5['d_model']} is not the transformer's joint_attention_dim {joint}")
        clip_length = tokenizer_max_length(configs, self.text_encoders[0])
        if tokenizer_max_length(configs, self.text_encoders[1]) != clip_length:
            raise UserError("the two CLIP tokenizers pad to different lengths")
        vae = vae_info(configs)
        if int(configs["vae"]["latent_channels"]) != int(tr["in_channels"]):
            raise UserError(f"the VAE's {configs['vae']['latent_channels']} latent channels are not the transformer's "
                            f"{tr['in_channels']} (components of different models mixed?)")
        patch = int(tr["patch_size"])
        size = int(tr["sample_size"]) * vae["vae_scale_factor"]
        sched = configs["scheduler"]
        return {
            "prediction_type": "flow",
            "num_train_timesteps": int(sched.get("num_train_timesteps", 1000)),
            **vae,
            "patch_size": patch,
            "size_multiple": vae["vae_scale_factor"] * patch,
            "latent_channels": int(tr["in_channels"]),
            "default_height": size,
            "default_width": size,
            "model_max_length": clip_length,
            "max_lengths": {"text_encoder": clip_length, "text_encoder_2": clip_length, "text_encoder_3": T5_LENGTH},
            "context_length": clip_length + T5_LENGTH,
            "context_dim": joint,
            "encoder_widths": widths,
            "encoder_projections": projections,
            "pooled_dim": sum(projections),
            # the transformer's learned position table bounds the latent size it accepts
            "max_latent": int(tr["pos_embed_max_size"]) * patch if tr.get("pos_embed_max_size") else None,
            "t5": t5 is not None,
        }

    def required_components(self, info: dict) -> tuple[str, ...]:
        base = super().required_components(info)
        # a folder exported with T5 needs it at run time (dropping it would change the images)
        return (*base, "text_encoder_3") if info.setting("t5") else base

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        return (
            TensorSpec(CONTEXT, "float32", ("batch_size", "sequence_length", int(info.context_dim))),
            TensorSpec(POOLED, "float32", ("batch_size", int(info.pooled_dim))),
        )

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        c = int(info.latent_channels)
        w1, w2 = info.encoder_widths
        s1, s2, s3 = self.text_encoders
        p1, p2 = (int(p) for p in info.encoder_projections)
        specs = {
            "text_encoder": text_encoder_spec(s1, {PENULTIMATE: w1, "text_embeds": p1}),
            "text_encoder_2": text_encoder_spec(s2, {PENULTIMATE: w2, "text_embeds": p2}),
            "text_encoder_3": text_encoder_spec(s3, {"last_hidden_state": int(info.context_dim)}),
            "transformer": ComponentSpec(
                "transformer",
                (TensorSpec(SAMPLE, "float32", latent_io(c)), TensorSpec(TIMESTEP, "float32", ("batch_size",)),
                 *self.conditioning(info)),
                (TensorSpec(OUT, "float32", latent_io(c)),),
                atol=1e-3, kind="transformer", source="transformer"),
            **vae_specs(c),
        }
        return {k: v for k, v in specs.items() if v.source in present}

    def export_dims(self, spec: ComponentSpec, info: dict) -> list[dict[str, int]]:
        if spec.kind == "text_encoder":
            seq = self.sequence_length(spec.name, info)
            return [{"batch_size": 2, "sequence_length": seq}, {"batch_size": 1, "sequence_length": max(2, seq // 2)}]
        seq = int(info.context_length)
        first, second = unet_dims(info, 1)
        if info.max_latent and second["width_latent"] > int(info.max_latent):
            first, second = unet_dims(info, -1)  # one patch narrower: wider would leave the position table
        return [{**first, "sequence_length": seq}, {**second, "sequence_length": seq // 2}]

    def combine(self, ops: Ops, encoded: dict[str, dict[str, Any]], info: dict) -> dict[str, Any]:
        one, two = encoded["text_encoder"], encoded["text_encoder_2"]
        joint = int(info.context_dim)
        clip = ops.pad_last(ops.concat([one[PENULTIMATE], two[PENULTIMATE]], axis=-1), joint)
        if "text_encoder_3" in encoded:
            t5 = encoded["text_encoder_3"]["last_hidden_state"]
        else:
            t5 = ops.zeros(clip, (T5_LENGTH, joint))
        return {CONTEXT: ops.concat([clip, t5], axis=-2),
                POOLED: ops.concat([one["text_embeds"], two["text_embeds"]], axis=-1)}

    controlnet: ClassVar[Any] = control_sd3.SUPPORT

    def start_step(self, steps: int, strength: float) -> int:
        from .flux import flow_start_step

        return flow_start_step(steps, strength)

    def size_limits(self, info: dict) -> SizeLimits:
        """The learned position table (pos_embed_max_size patches a side) bounds the latent: pixels =
        max_latent (= pos_embed_max_size x patch) x the VAE factor; larger fails inside the graph's Add."""
        base = super().size_limits(info)
        if not info.max_latent:
            return base
        f, p = int(info.vae_scale_factor), int(info.patch_size)
        side = int(info.max_latent) * f
        why = (f"the transformer's position table: pos_embed_max_size {int(info.max_latent) // p} x patch {p} "
               f"x VAE factor {f}")
        return SizeLimits(base.multiple, min(side, base.max_height), min(side, base.max_width), why)

    def image_seq_len(self, info: dict, height: int, width: int) -> int:
        f = int(info.vae_scale_factor) * int(info.patch_size)
        return (height // f) * (width // f)
