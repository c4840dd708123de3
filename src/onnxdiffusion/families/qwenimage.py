"""Qwen-Image: a Qwen2.5-VL text encoder read through a chat prompt template, an MMDiT over
packed 2x2 latent patches with centred rotary ids and a text mask, true CFG rescaled to the
conditional prediction's norm, and a 3D (video-style) VAE with per-channel latent normalization.

Text encoding follows QwenImagePipeline._get_qwen_prompt_embeds: the template is tokenized (padded
to the longest prompt), the encoder's last hidden state is read under the padding mask, each row
keeps its valid tokens minus the template's first `drop` tokens, and rows are padded again to the
longest with a mask the transformer attends under (`text_outputs`: numpy on the host, ONNX nodes in
the `--whole` graph, which takes the template's ids and their mask).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import UserError
from ..folder.manifest import confined
from . import control_qwen, graph_ends
from . import latents as lat
from .base import CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, NumpyOps, Ops, TensorSpec, TextEncoderSlot
from .flux import TOKENS, PackedFlowFamily, flow_scheduler_info, grid_dims, token_grid
from .gguf_names import GgufNames

MASK, IMG_IDS = "encoder_hidden_states_mask", "img_ids"
# QwenImagePipeline's prompt template, the count of its leading tokens dropped, and its prompt length
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP = 34
MAX_PROMPT_TOKENS = 1024


class _TemplateTokenizer:
    def __init__(self, folder, info: dict):
        from ..runtime.tokenizer import PaddedTokenizer

        self._tok = PaddedTokenizer(folder, None, info.setting("prompt_template"))
        self.limit = int(info.max_prompt_tokens) + int(info.prompt_template_drop)

    def __call__(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return self._tok(prompts, pad_to_max=False, truncate_to=self.limit)

    def page_spec(self) -> dict:
        return self._tok.page_spec(pad_to_max=False, truncate_to=self.limit)


pad_tokens = graph_ends.pad_rows  # (the name Qwen-Image-Edit imports)


class QwenImage(PackedFlowFamily):
    name: ClassVar[str] = "qwenimage"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImagePipeline",)
    backbone: ClassVar[str] = "transformer"
    backbone_classes: ClassVar[tuple[str, ...]] = ("QwenImageTransformer2DModel",)
    backbone_kind: ClassVar[str] = "qwenimage_transformer"
    # the exporter names this backbone's block nodes without the /model scope (step caching's span)
    cache_block_pattern: ClassVar[str] = r"^((?:/model)?/transformer_blocks\.\d+/)"
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]] = (
        TextEncoderSlot("text_encoder", "tokenizer", ("Qwen2_5_VLForConditionalGeneration",),
                        ("Qwen2Tokenizer", "Qwen2TokenizerFast"), ("last_hidden_state",)),
    )
    vae_classes: ClassVar[tuple[str, ...]] = ("AutoencoderKLQwenImage",)
    predictions: ClassVar[tuple[str, ...]] = ("flow",)
    cfg_rescale: ClassVar[bool] = True
    latent_patch: ClassVar[int | None] = 2
    tiny_vae: ClassVar[bool] = False  # its VAE is a video VAE (frames axis, per-channel mean/std)
    # ComfyUI-GGUF's label; its files keep diffusers' names (diffusers maps them 1:1)
    gguf_names: ClassVar[Any] = GgufNames(architectures=("qwen_image",))

    def diffusers_call(self, info: dict, guidance: float) -> dict[str, Any]:
        # QwenImagePipeline guides with true_cfg_scale and only when given a negative prompt; `generate`
        # encodes an absent one as ""
        return {"true_cfg_scale": guidance, "negative_prompt": ""}

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        tr, te, vae = configs["transformer"], configs["text_encoder"], configs["vae"]
        width = int((te.get("text_config") or te).get("hidden_size"))
        if int(tr["joint_attention_dim"]) != width:
            raise UserError(f"text encoder width {width} does not match the transformer's joint_attention_dim "
                            f"{tr['joint_attention_dim']} (components of different models mixed?)")
        for key in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope", "guidance_embeds"):
            if tr.get(key):
                raise UserError(f"transformer option {key} is not supported (Qwen-Image text-to-image only)")
        z = int(vae["z_dim"])
        if int(tr["in_channels"]) != 4 * z or int(tr.get("patch_size", 2)) != 2:
            raise UserError(f"transformer in_channels {tr['in_channels']} is not 4x the VAE's z_dim {z} (2x2 packing)")
        mean, std = vae.get("latents_mean"), vae.get("latents_std")
        if mean is None or std is None or len(mean) != z or len(std) != z:
            raise UserError("the VAE config needs latents_mean and latents_std with one value per latent channel")
        f = 2 ** len(vae["temperal_downsample"])
        size = 128 * f  # QwenImagePipeline.default_sample_size
        return {
            **flow_scheduler_info(configs["scheduler"]),
            "vae_scaling_factor": 1.0,
            "vae_scale_factor": f,
            "vae_latents_mean": [float(v) for v in mean],
            "vae_latents_std": [float(v) for v in std],
            "latent_channels": z,
            "out_channels": int(tr.get("out_channels") or z),
            "size_multiple": 2 * f,
            "default_height": size,
            "default_width": size,
            "model_max_length": MAX_PROMPT_TOKENS + DROP,
            "max_prompt_tokens": MAX_PROMPT_TOKENS,
            "prompt_template": TEMPLATE,
            "prompt_template_drop": DROP,
            "context_dim": width,
        }

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        return (TensorSpec(CONTEXT, "float32", ("batch_size", "sequence_length", int(info.context_dim))),
                TensorSpec(MASK, "float32", ("batch_size", "sequence_length")),
                TensorSpec(IMG_IDS, "float32", (*TOKENS, 3)))

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        c, out = 4 * int(info.latent_channels), 4 * int(info.out_channels)
        z = int(info.latent_channels)
        ids = ("batch_size", "sequence_length")
        specs = {
            "text_encoder": ComponentSpec(
                "text_encoder", (TensorSpec("input_ids", "int64", ids), TensorSpec("attention_mask", "int64", ids)),
                (TensorSpec("last_hidden_state", "float32", (*ids, int(info.context_dim))),), atol=1e-4,
                kind="decoder_text_encoder", source="text_encoder", options={"rope_axes": 3}),
            "transformer": ComponentSpec(
                "transformer",
                (TensorSpec(SAMPLE, "float32", (*TOKENS, c)), TensorSpec(TIMESTEP, "float32", ("batch_size",)),
                 *self.conditioning(info)),
                (TensorSpec(OUT, "float32", (*TOKENS, out)),), atol=1e-3, kind=self.backbone_kind, source="transformer"),
            "vae_decoder": ComponentSpec(
                "vae_decoder", (TensorSpec("latent_sample", "float32", ("batch_size", z, 1, "height_latent", "width_latent")),),
                (TensorSpec("sample", "float32", ("batch_size", 3, 1, "height", "width")),), atol=2e-3,
                kind="vae_decoder", source="vae"),
            # a picture in, one frame out: the video VAE's frames axis stays inside the graph
            "vae_encoder": ComponentSpec(
                "vae_encoder", (TensorSpec("sample", "float32", ("batch_size", 3, "height", "width")),),
                (TensorSpec("latent_parameters", "float32", ("batch_size", 2 * z, 1, "height_latent", "width_latent")),),
                atol=2e-3, kind="vae_encoder", source="vae", options={"frames": True}),
        }
        return {k: v for k, v in specs.items() if v.source in present}

    def export_dims(self, spec: ComponentSpec, info: dict) -> list[dict[str, int]]:
        if spec.kind == "decoder_text_encoder":
            return [{"batch_size": 2, "sequence_length": 48}, {"batch_size": 1, "sequence_length": 40}]
        f = int(info.vae_scale_factor)
        dims = []
        for g, text in zip(grid_dims(info), (12, 7)):
            h, w = 2 * g["rows"], 2 * g["cols"]
            dims.append({**g, "image_sequence_length": g["rows"] * g["cols"], "sequence_length": text,
                         "height_latent": h, "width_latent": w, "height": h * f, "width": w * f})
        return dims

    controlnet: ClassVar[Any] = control_qwen.SUPPORT

    # -- run time ---------------------------------------------------------------------------------
    def make_tokenizer(self, slot: TextEncoderSlot, folder, info: dict):
        return _TemplateTokenizer(confined(folder, slot.tokenizer, "tokenizer folder"), info)

    def encode_text(self, slot: TextEncoderSlot, tokenizer, session, prompts: list[str], info: dict) -> dict[str, Any]:
        ids, mask = tokenizer(prompts)
        hidden = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask})[0]
        return self.text_outputs(NumpyOps(), slot, {"last_hidden_state": hidden}, mask, info)

    def text_outputs(self, ops: Ops, slot: TextEncoderSlot, outputs: dict[str, Any], mask: Any, info: dict) -> dict[str, Any]:
        """Each row's valid tokens minus the template's first `drop`, padded again to the longest under a mask."""
        states, keep = ops.kept_tokens(outputs["last_hidden_state"], mask, int(info.prompt_template_drop), 1)
        return {"last_hidden_state": states, "mask": keep}

    def combine(self, ops: Ops, encoded: dict[str, dict[str, Any]], info: dict) -> dict[str, Any]:
        te = encoded["text_encoder"]
        return {CONTEXT: te["last_hidden_state"], MASK: te["mask"]}

    def align(self, cond: dict[str, Any], uncond: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Prompt and negative prompt differ in length: zero-pad the shorter, masked out."""
        length = max(cond[CONTEXT].shape[1], uncond[CONTEXT].shape[1])

        def pad(c: dict) -> dict:
            extra = length - c[CONTEXT].shape[1]
            if not extra:
                return c
            return {**c, CONTEXT: np.pad(c[CONTEXT], ((0, 0), (0, extra), (0, 0))),
                    MASK: np.pad(c[MASK], ((0, 0), (0, extra)))}

        return pad(cond), pad(uncond)

    def size_conditioning(self, info: dict, batch: int, height: int, width: int) -> dict[str, np.ndarray]:
        rows, cols = token_grid(info, height, width)
        return {IMG_IDS: np.repeat(lat.image_ids(rows, cols, centred=True)[None], batch, axis=0)}

    def decoder_feed(self, info: dict, latents: np.ndarray, height: int, width: int) -> np.ndarray:
        rows, cols = token_grid(info, height, width)
        x = lat.unpack_patches(latents, 2 * rows, 2 * cols)[:, :, None]
        shape = (1, -1, 1, 1, 1)
        mean = np.asarray(info.vae_latents_mean, np.float32).reshape(shape)
        inv_std = (np.float32(1.0) / np.asarray(info.vae_latents_std, np.float32)).reshape(shape)
        return (x / inv_std + mean).astype(np.float32)  # diffusers' arithmetic, in its order

    def graph_decode(self, info: dict) -> graph_ends.DecodeFeed:
        inv_std = np.float32(1.0) / np.asarray(info.vae_latents_std, np.float32)
        return graph_ends.DecodeFeed(channel_div=tuple(float(v) for v in inv_std),
                                     channel_add=tuple(float(v) for v in np.asarray(info.vae_latents_mean, np.float32)),
                                     frames=True)

    def decoded_images(self, sample: np.ndarray) -> np.ndarray:
        return sample[:, :, 0]  # the one frame

    def encoder_latents(self, info: dict, mean: np.ndarray) -> np.ndarray:
        """(B, C, 1, h, w) or (B, C, h, w) posterior mean -> (B, C, h, w), normalized as the pipeline does."""
        x = mean[:, :, 0] if mean.ndim == 5 else mean
        shape = (1, -1, 1, 1)
        m = np.asarray(info.vae_latents_mean, np.float32).reshape(shape)
        inv_std = (np.float32(1.0) / np.asarray(info.vae_latents_std, np.float32)).reshape(shape)
        return ((x - m) * inv_std).astype(np.float32)
