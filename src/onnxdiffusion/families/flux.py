"""Flux (FLUX.1-dev/-schnell style): CLIP pooled + T5 sequence, an MMDiT over packed 2x2 latent
patches with rotary position ids, flow-matching velocity, guidance embedding instead of CFG.

The sampler state is the packed token sequence [B, (H/2f)(W/2f), 4C] diffusers' FluxPipeline
keeps; it is unpacked (numpy) only for the VAE.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import UserError
from . import control_flux
from . import latents as lat
from .base import CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, Family, Ops, TensorSpec, TextEncoderSlot
from .sd import CLIP_TOKENIZERS, text_encoder_spec, vae_specs

POOLED, IMG_IDS, GUIDANCE = "pooled_projections", "img_ids", "guidance"
T5_TOKENIZERS = ("T5Tokenizer", "T5TokenizerFast")
TOKENS = ("batch_size", "image_sequence_length")


def flow_vae_info(vae: dict) -> dict:
    if vae.get("latents_mean") is not None or vae.get("latents_std") is not None:
        raise UserError("this VAE has per-channel latents_mean/latents_std, which a Flux pipeline does not use")
    return {
        "vae_scaling_factor": float(vae.get("scaling_factor", 1.0)),
        "vae_shift_factor": float(vae.get("shift_factor") or 0.0),
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
        "latent_channels": int(vae["latent_channels"]),
    }


def flow_scheduler_info(sched: dict) -> dict:
    if sched.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        raise UserError(f"a flow-matching pipeline needs FlowMatchEulerDiscreteScheduler, the folder has "
                        f"{sched.get('_class_name')!r}")
    return {"prediction_type": "flow", "num_train_timesteps": int(sched.get("num_train_timesteps", 1000))}


def packed_shape(info: dict, batch: int, height: int, width: int) -> tuple[int, int, int]:
    f = 2 * int(info.vae_scale_factor)
    return batch, (height // f) * (width // f), 4 * int(info.latent_channels)


def token_grid(info: dict, height: int, width: int) -> tuple[int, int]:
    f = 2 * int(info.vae_scale_factor)
    return height // f, width // f


def grid_dims(info: dict) -> list[dict[str, int]]:
    """Two token grids for export validation: square with batch 2, then a wider one with batch 1."""
    return [{"batch_size": 2, "rows": 4, "cols": 4}, {"batch_size": 1, "rows": 3, "cols": 5}]


def flow_start_step(steps: int, strength: float) -> int:
    """Steps an img2img run skips, as the SD3/Flux/Qwen-Image pipelines count them (kept steps not rounded)."""
    return int(max(steps - min(steps * strength, steps), 0))


def flow_sigmas(steps: int) -> np.ndarray:
    """linspace(1, 1/steps, steps): the base sigmas FluxPipeline and QwenImagePipeline pass."""
    return np.linspace(1.0, 1.0 / steps, steps)


class PackedFlowFamily(Family):
    """What Flux and Qwen-Image share: 2x2-packed latent tokens and the pipelines' own base sigmas."""

    def latent_shape(self, info: dict, batch: int, height: int, width: int) -> tuple[int, ...]:
        return packed_shape(info, batch, height, width)

    def image_seq_len(self, info: dict, height: int, width: int) -> int | None:
        rows, cols = token_grid(info, height, width)
        return rows * cols

    def start_step(self, steps: int, strength: float) -> int:
        return flow_start_step(steps, strength)

    def pack_latents(self, info: dict, latents: np.ndarray) -> np.ndarray:
        return lat.pack_patches(np.asarray(latents, np.float32))

    def base_sigmas(self, steps: int) -> np.ndarray | None:
        return flow_sigmas(steps)


class Flux(PackedFlowFamily):
    name: ClassVar[str] = "flux"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("FluxPipeline", "FluxFillPipeline")
    backbone: ClassVar[str] = "transformer"
    backbone_classes: ClassVar[tuple[str, ...]] = ("FluxTransformer2DModel",)
    backbone_kind: ClassVar[str] = "flux_transformer"
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]] = (
        TextEncoderSlot("text_encoder", "tokenizer", ("CLIPTextModel",), CLIP_TOKENIZERS, ("pooler_output",)),
        TextEncoderSlot("text_encoder_2", "tokenizer_2", ("T5EncoderModel",), T5_TOKENIZERS, ("last_hidden_state",)),
    )
    predictions: ClassVar[tuple[str, ...]] = ("flow",)
    guidance_input: ClassVar[str | None] = GUIDANCE
    latent_patch: ClassVar[int | None] = 2

    def diffusers_call(self, info: dict, guidance: float) -> dict[str, Any]:
        # guidance is embedded (no CFG); T5 is fed the folder's length, as export and run time do
        return {"guidance_scale": guidance, "max_sequence_length": self.sequence_length("text_encoder_2", info)}

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        tr, clip, t5 = configs["transformer"], configs["text_encoder"], configs["text_encoder_2"]
        if int(tr["joint_attention_dim"]) != int(t5["d_model"]):
            raise UserError(f"T5 width {t5['d_model']} does not match the transformer's joint_attention_dim "
                            f"{tr['joint_attention_dim']} (components of different models mixed?)")
        if int(tr["pooled_projection_dim"]) != int(clip["hidden_size"]):
            raise UserError(f"CLIP width {clip['hidden_size']} does not match the transformer's pooled_projection_dim "
                            f"{tr['pooled_projection_dim']} (components of different models mixed?)")
        vae = flow_vae_info(configs["vae"])
        packed, tr_in = 4 * vae["latent_channels"], int(tr["in_channels"])
        fill = 2 * packed + 4 * vae["vae_scale_factor"] ** 2  # Flux Fill: + masked-image latents + the 2x2-packed fxf mask
        if tr_in not in (packed, fill) or int(tr.get("patch_size", 1)) != 1:
            raise UserError(f"transformer in_channels {tr_in} is neither 4x the VAE's latent channels "
                            f"{vae['latent_channels']} (2x2 packing) nor Flux Fill's {fill}")
        if int(tr.get("out_channels") or tr_in) != packed:
            raise UserError(f"transformer out_channels {tr.get('out_channels') or tr_in} is not the packed latents' {packed}")
        clip_len = int((configs.get("tokenizer/tokenizer_config") or {}).get("model_max_length", 77))
        t5_len = min(int((configs.get("tokenizer_2/tokenizer_config") or {}).get("model_max_length", 512)), 512)
        size = 128 * vae["vae_scale_factor"]  # FluxPipeline.default_sample_size
        return {
            **flow_scheduler_info(configs["scheduler"]),
            **vae,
            "size_multiple": 2 * vae["vae_scale_factor"],
            "default_height": size,
            "default_width": size,
            "model_max_length": clip_len,
            "max_lengths": {"text_encoder": clip_len, "text_encoder_2": t5_len},
            "context_dim": int(tr["joint_attention_dim"]),
            "pooled_dim": int(tr["pooled_projection_dim"]),
            "guidance_embeds": bool(tr.get("guidance_embeds", False)),
            **({"backbone_in_channels": tr_in} if tr_in != packed else {}),
        }

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        specs = (TensorSpec(CONTEXT, "float32", ("batch_size", "sequence_length", int(info.context_dim))),
                 TensorSpec(POOLED, "float32", ("batch_size", int(info.pooled_dim))),
                 TensorSpec(IMG_IDS, "float32", (*TOKENS, 3)))
        return (*specs, TensorSpec(GUIDANCE, "float32", ("batch_size",))) if info.setting("guidance_embeds") else specs

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        c = 4 * int(info.latent_channels)
        clip, t5 = self.text_encoders
        specs = {
            "text_encoder": text_encoder_spec(clip, {"pooler_output": int(info.pooled_dim)}),
            "text_encoder_2": text_encoder_spec(t5, {"last_hidden_state": int(info.context_dim)}),
            "transformer": ComponentSpec(
                "transformer",
                (TensorSpec(SAMPLE, "float32", (*TOKENS, int(info.setting("backbone_in_channels", c)))),
                 TensorSpec(TIMESTEP, "float32", ("batch_size",)),
                 *self.conditioning(info)),
                (TensorSpec(OUT, "float32", (*TOKENS, c)),), atol=1e-3, kind=self.backbone_kind, source="transformer"),
            **vae_specs(int(info.latent_channels)),
        }
        return {k: v for k, v in specs.items() if v.source in present}

    def export_dims(self, spec: ComponentSpec, info: dict) -> list[dict[str, int]]:
        if spec.kind == "text_encoder":
            seq = self.sequence_length(spec.name, info)
            return [{"batch_size": 2, "sequence_length": seq}, {"batch_size": 1, "sequence_length": max(2, seq // 2)}]
        f = int(info.vae_scale_factor)
        dims = []
        for g, text in zip(grid_dims(info), (self.sequence_length("text_encoder_2", info), 7)):
            h, w = 2 * g["rows"], 2 * g["cols"]  # latent size
            dims.append({**g, "image_sequence_length": g["rows"] * g["cols"], "sequence_length": text,
                         "height_latent": h, "width_latent": w, "height": h * f, "width": w * f})
        return dims

    controlnet: ClassVar[Any] = control_flux.SUPPORT

    def combine(self, ops: Ops, encoded: dict[str, dict[str, Any]], info: dict) -> dict[str, Any]:
        return {CONTEXT: encoded["text_encoder_2"]["last_hidden_state"],
                POOLED: encoded["text_encoder"]["pooler_output"]}

    def size_conditioning(self, info: dict, batch: int, height: int, width: int) -> dict[str, np.ndarray]:
        rows, cols = token_grid(info, height, width)
        return {IMG_IDS: np.repeat(lat.image_ids(rows, cols)[None], batch, axis=0)}

    def inpaint_inputs(self, info: dict, mask: np.ndarray, masked: np.ndarray) -> np.ndarray:
        """Flux Fill's extra token channels (FluxFillPipeline.prepare_mask_latents): the packed masked-image
        latents, then the pixel mask with each latent pixel's f x f block as channels, packed the same way."""
        f = int(info.vae_scale_factor)
        b, _, hp, wp = mask.shape
        blocks = mask[:, 0].reshape(b, hp // f, f, wp // f, f).transpose(0, 2, 4, 1, 3).reshape(b, f * f, hp // f, wp // f)
        return np.concatenate([lat.pack_patches(masked), lat.pack_patches(blocks)], axis=-1).astype(np.float32)

    def decoder_feed(self, info: dict, latents: np.ndarray, height: int, width: int) -> np.ndarray:
        rows, cols = token_grid(info, height, width)
        return super().decoder_feed(info, lat.unpack_patches(latents, 2 * rows, 2 * cols), height, width)
