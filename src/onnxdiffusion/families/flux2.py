"""FLUX.2: [klein] (Flux2KleinPipeline: a Qwen3 causal LM, true CFG against "") and [dev] (Flux2Pipeline: a
Mistral-3 language model behind a system prompt, the guidance scale embedded), one MMDiT over 2x2 latent patches
with 4-axis rotary ids, and a VAE whose latents are batch-normalized in the patch space.

What the two pipelines share and this module follows:
  - the prompt goes through the tokenizer's chat template (rendered once at export with a placeholder, kept in
    the manifest as `prompt_template`), padded to a fixed length; the language model reads it under the padding
    mask and three of its hidden states, stacked on channels, are the transformer's text tokens (the text
    encoder's ONNX graph does the stacking: one output, `prompt_embeds`). Every padded token reaches the
    transformer (no text mask), so the text length is fixed.
  - text ids are (0, 0, 0, k), image ids (0, row, column, 0); the transformer makes the text ids itself.
  - latents are drawn as patches (B, 4C, h/2, w/2), packed row-major into tokens: the same layout as Flux's 2x2
    packing, so the sampler state is Flux's. Before decoding, the VAE's batch-norm running statistics are undone
    in that patch space (`vae_bn_mean`, `vae_bn_std`, read from the VAE's weights at export).
  - mu of the dynamic shift comes from `compute_empirical_mu(tokens, steps)`, not from the scheduler's line.
  - `image` is optional and means reference pictures (several): each is VAE-encoded (mode), batch-normalized
    in the patch space and packed; their tokens follow the noise tokens with ids (10 + 10 i, row, column, 0).
    As for Kontext they are two backbone inputs of their own (`reference_latents`, `reference_ids`) joined and
    cut in the exported graph, so the sampler state stays the noise tokens; without a picture they hold no token.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import UserError
from ..folder.manifest import confined
from . import graph_ends
from . import latents as lat
from .base import CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, Ops, TensorSpec, TextEncoderSlot
from .flux import GUIDANCE, TOKENS, PackedFlowFamily, flow_scheduler_info, grid_dims, token_grid
from .gguf_names import FLUX2
from .sd import vae_specs

IMG_IDS, PROMPT_EMBEDS = "img_ids", "prompt_embeds"
REF_LATENTS, REF_IDS = "reference_latents", "reference_ids"
REF_TOKENS = ("batch_size", "reference_sequence_length")
MAX_SEQUENCE_LENGTH = 512  # both pipelines' default max_sequence_length
MAX_REFERENCE_AREA = 1024 * 1024  # pixels: a larger reference picture is scaled down to this area first
MIN_REFERENCE_SIDE, MAX_REFERENCE_ASPECT = 64, 8  # Flux2ImageProcessor.check_image_input's limits
REFERENCE_TIME_STEP = 10  # reference picture i has time coordinate 10 + 10 i (`_prepare_image_ids`)


def empirical_mu(image_seq_len: int, steps: int) -> float:
    """Flux2 pipelines' `compute_empirical_mu`: mu fitted at 10 and 200 steps, linear in the step count between
    (past 4300 tokens, the 200-step line alone)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + (m_200 - 200.0 * a))


def image_ids_4d(rows: int, cols: int, time: int = 0) -> np.ndarray:
    """(time, row, column, layer=0) per token, rows outer: [rows*cols, 4] float32 (`_prepare_latent_ids`)."""
    ids = lat.image_ids(rows, cols)
    ids[:, 0] = time
    return np.concatenate([ids, np.zeros((len(ids), 1), np.float32)], axis=1)


class _TemplateTokenizer:
    """The prompt through the chat template the export rendered, padded to the folder's fixed length."""

    def __init__(self, folder, info: dict, strip: tuple[str, ...], special_tokens: bool):
        from ..runtime.tokenizer import PaddedTokenizer

        self.length = int(info.setting("max_lengths")["text_encoder"])
        self._tok = PaddedTokenizer(folder, self.length, info.setting("prompt_template"), special_tokens=special_tokens)
        self.strip = strip

    def __call__(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        for s in self.strip:
            prompts = [p.replace(s, "") for p in prompts]
        return self._tok(prompts, pad_to_max=True, truncate_to=self.length)

    def page_spec(self) -> dict:
        return self._tok.page_spec(pad_to_max=True, truncate_to=self.length, strip=self.strip)


class Flux2Base(PackedFlowFamily):
    """What [klein] and [dev] share; each subclass names its text encoder and whether guidance is embedded."""

    backbone: ClassVar[str] = "transformer"
    backbone_classes: ClassVar[tuple[str, ...]] = ("Flux2Transformer2DModel",)
    backbone_kind: ClassVar[str] = "flux2_transformer"
    gguf_names: ClassVar[Any] = FLUX2  # city96's / sd.cpp's files: the release's names, fused qkv
    vae_classes: ClassVar[tuple[str, ...]] = ("AutoencoderKLFlux2",)
    predictions: ClassVar[tuple[str, ...]] = ("flow",)
    latent_patch: ClassVar[int | None] = 2
    tiny_vae: ClassVar[bool] = False  # no TAESD of this VAE's 32 batch-normalized channels here
    text_layers: ClassVar[tuple[int, ...]]  # the pipeline's text_encoder_out_layers
    embedded_guidance: ClassVar[bool]
    prompt_strip: ClassVar[tuple[str, ...]] = ()  # substrings the pipeline removes from prompts
    special_tokens: ClassVar[bool] = True  # whether tokenizing adds the tokenizer's own special tokens

    def text_width(self, config: dict) -> int:
        """The language model's hidden size, from the text encoder's config.json."""
        return int((config.get("text_config") or config)["hidden_size"])

    def text_depth(self, config: dict) -> int:
        return int((config.get("text_config") or config)["num_hidden_layers"])

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        tr, te, vae = configs["transformer"], configs["text_encoder"], configs["vae"]
        width, depth = self.text_width(te), self.text_depth(te)
        if max(self.text_layers) > depth:
            raise UserError(f"the text encoder has {depth} layers; a {self.name} pipeline reads hidden states "
                            f"{list(self.text_layers)}")
        if int(tr["joint_attention_dim"]) != len(self.text_layers) * width:
            raise UserError(f"the transformer's joint_attention_dim {tr['joint_attention_dim']} is not "
                            f"{len(self.text_layers)} x the text encoder's width {width} (components of different models mixed?)")
        if bool(tr.get("guidance_embeds", True)) != self.embedded_guidance:
            raise UserError(f"transformer guidance_embeds={tr.get('guidance_embeds', True)} does not fit a {self.name} "
                            f"pipeline (FLUX.2 [dev] embeds guidance, [klein] does not)")
        c = int(vae["latent_channels"])
        if tuple(vae.get("patch_size", (2, 2))) != (2, 2):
            raise UserError(f"VAE patch_size {vae.get('patch_size')} is not (2, 2)")
        tr_in = int(tr["in_channels"])
        if tr_in != 4 * c or int(tr.get("patch_size", 1)) != 1 or int(tr.get("out_channels") or tr_in) != tr_in:
            raise UserError(f"transformer in/out channels {tr_in}/{tr.get('out_channels')} are not 4x the VAE's "
                            f"latent channels {c} (2x2 patches)")
        if len(tr.get("axes_dims_rope", (32, 32, 32, 32))) != 4:
            raise UserError("the transformer's rotary embedding must have 4 axes (time, row, column, layer)")
        f = 2 ** (len(vae["block_out_channels"]) - 1)
        tok_len = (configs.get("tokenizer/tokenizer_config") or {}).get("model_max_length", MAX_SEQUENCE_LENGTH)
        length = min(int(tok_len) if isinstance(tok_len, (int, float)) else MAX_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH)
        size = 128 * f  # the pipelines' default_sample_size
        return {
            **flow_scheduler_info(configs["scheduler"]),
            "vae_scaling_factor": 1.0,
            "vae_scale_factor": f,
            "vae_batch_norm_eps": float(vae.get("batch_norm_eps", 1e-4)),
            "latent_channels": c,
            "size_multiple": 2 * f,
            "default_height": size,
            "default_width": size,
            "model_max_length": length,
            "max_lengths": {"text_encoder": length},
            "context_dim": int(tr["joint_attention_dim"]),
            "text_layers": list(self.text_layers),
            "guidance_embeds": self.embedded_guidance,
        }

    image_role: ClassVar[str] = "reference"
    references_optional: ClassVar[bool] = True
    max_references: ClassVar[int] = 10

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        specs = (TensorSpec(CONTEXT, "float32", ("batch_size", "sequence_length", int(info.context_dim))),
                 TensorSpec(IMG_IDS, "float32", (*TOKENS, 4)))
        if self.embedded_guidance:
            specs = (*specs, TensorSpec(GUIDANCE, "float32", ("batch_size",)))
        return (*specs, TensorSpec(REF_LATENTS, "float32", (*REF_TOKENS, 4 * int(info.latent_channels))),
                TensorSpec(REF_IDS, "float32", (*REF_TOKENS, 4)))

    def guidance_input_for(self, info: dict) -> str | None:
        return GUIDANCE if self.embedded_guidance else None

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        c = 4 * int(info.latent_channels)
        ids = ("batch_size", "sequence_length")
        specs = {
            "text_encoder": ComponentSpec(
                "text_encoder", (TensorSpec("input_ids", "int64", ids), TensorSpec("attention_mask", "int64", ids)),
                (TensorSpec(PROMPT_EMBEDS, "float32", (*ids, int(info.context_dim))),), atol=1e-4,
                kind="decoder_text_encoder", source="text_encoder",
                # positions 0..L-1, padding included: every padded token's state reaches the transformer
                options={"layers": tuple(self.text_layers), "positions": "arange"}),
            "transformer": ComponentSpec(
                "transformer",
                (TensorSpec(SAMPLE, "float32", (*TOKENS, c)), TensorSpec(TIMESTEP, "float32", ("batch_size",)),
                 *self.conditioning(info)),
                (TensorSpec(OUT, "float32", (*TOKENS, c)),), atol=1e-3, kind=self.backbone_kind, source="transformer"),
            **vae_specs(int(info.latent_channels)),
        }
        return {k: v for k, v in specs.items() if v.source in present}

    def export_dims(self, spec: ComponentSpec, info: dict) -> list[dict[str, int]]:
        text = self.sequence_length("text_encoder", info)
        if spec.kind == "decoder_text_encoder":
            return [{"batch_size": 2, "sequence_length": text}, {"batch_size": 1, "sequence_length": max(8, text // 2)}]
        f = int(info.vae_scale_factor)
        dims = []
        # reference grids unlike the noise grids (2x3, then two pictures, 2x2 and 1x3): token counts of their own
        refs = (((2, 3),), ((2, 2), (1, 3)))
        for g, seq, ref in zip(grid_dims(info), (text, 7), refs):
            h, w = 2 * g["rows"], 2 * g["cols"]
            dims.append({**g, "image_sequence_length": g["rows"] * g["cols"], "sequence_length": seq,
                         "height_latent": h, "width_latent": w, "height": h * f, "width": w * f,
                         "reference_grids": [list(r) for r in ref], "reference_sequence_length": sum(r * c for r, c in ref)})
        return dims

    def diffusers_call(self, info: dict, guidance: float) -> dict[str, Any]:
        return {"guidance_scale": guidance, "max_sequence_length": self.sequence_length("text_encoder", info)}

    def diffusers_latents(self, info: dict, latents: np.ndarray, height: int, width: int) -> np.ndarray:
        """Tokens -> the (B, 4C, h/2, w/2) patches the pipelines draw and pack themselves."""
        rows, cols = token_grid(info, height, width)
        return np.ascontiguousarray(latents.transpose(0, 2, 1).reshape(latents.shape[0], -1, rows, cols))

    # -- run time ---------------------------------------------------------------------------------
    def make_tokenizer(self, slot: TextEncoderSlot, folder, info: dict):
        return _TemplateTokenizer(confined(folder, slot.tokenizer, "tokenizer folder"), info, self.prompt_strip,
                                  self.special_tokens)

    def encode_text(self, slot: TextEncoderSlot, tokenizer, session, prompts: list[str], info: dict) -> dict[str, Any]:
        ids, mask = tokenizer(prompts)
        return {PROMPT_EMBEDS: session.run([PROMPT_EMBEDS], {"input_ids": ids, "attention_mask": mask})[0]}

    def combine(self, ops: Ops, encoded: dict[str, dict[str, Any]], info: dict) -> dict[str, Any]:
        return {CONTEXT: encoded["text_encoder"][PROMPT_EMBEDS]}

    def size_conditioning(self, info: dict, batch: int, height: int, width: int) -> dict[str, np.ndarray]:
        """The noise tokens' ids, and reference inputs holding no token: what every caller that knows nothing of
        reference pictures (calibration, bench, the web page) feeds; a generation with pictures replaces them."""
        rows, cols = token_grid(info, height, width)
        return {IMG_IDS: np.repeat(image_ids_4d(rows, cols)[None], batch, axis=0), **self.reference_inputs(info, [], batch)}

    def reference_size(self, info: dict, height: int, width: int) -> tuple[int, int]:
        """The pipelines' size for a reference picture: scaled down to 1024^2 pixels of area when larger (aspect
        kept), then each side rounded down to the size multiple. Like the pipelines, it refuses a side under 64
        pixels or an aspect ratio over 8."""
        if min(height, width) < MIN_REFERENCE_SIDE or max(height / width, width / height) > MAX_REFERENCE_ASPECT:
            raise UserError(f"a reference picture of {height}x{width} pixels is refused: a {self.name} model takes "
                            f"sides of at least {MIN_REFERENCE_SIDE} and an aspect ratio up to {MAX_REFERENCE_ASPECT}")
        if height * width > MAX_REFERENCE_AREA:
            scale = (MAX_REFERENCE_AREA / (height * width)) ** 0.5
            height, width = int(height * scale), int(width * scale)
        m = int(info.size_multiple)
        return height // m * m, width // m * m

    def reference_inputs(self, info: dict, latents: list[np.ndarray], batch: int) -> dict[str, np.ndarray]:
        c = 4 * int(info.latent_channels)
        tokens = [lat.pack_patches(np.asarray(x, np.float32))[0] for x in latents]
        ids = [image_ids_4d(x.shape[2] // 2, x.shape[3] // 2, time=REFERENCE_TIME_STEP * (i + 1))
               for i, x in enumerate(latents)]
        joined = np.concatenate(tokens, axis=0) if tokens else np.zeros((0, c), np.float32)
        joined_ids = np.concatenate(ids, axis=0) if ids else np.zeros((0, 4), np.float32)
        return {REF_LATENTS: np.ascontiguousarray(np.repeat(joined[None], batch, axis=0)),
                REF_IDS: np.ascontiguousarray(np.repeat(joined_ids[None], batch, axis=0))}

    def schedule_mu(self, info: dict, height: int, width: int, steps: int) -> float | None:
        rows, cols = token_grid(info, height, width)
        return empirical_mu(rows * cols, steps)

    def _bn(self, info: dict) -> tuple[np.ndarray, np.ndarray]:
        mean, var = info.setting("vae_bn_mean"), info.setting("vae_bn_var")
        if mean is None or var is None:
            raise UserError("this FLUX.2 folder's manifest has no VAE batch-norm statistics (vae_bn_mean/vae_bn_var)")
        eps = np.float32(info.setting("vae_batch_norm_eps", 1e-4))
        shape = (1, -1, 1, 1)
        # torch.sqrt(running_var + eps) in float32, as the pipelines compute it
        return (np.asarray(mean, np.float32).reshape(shape),
                np.sqrt(np.asarray(var, np.float32) + eps).reshape(shape))

    def decoder_feed(self, info: dict, latents: np.ndarray, height: int, width: int) -> np.ndarray:
        rows, cols = token_grid(info, height, width)
        b, _, d = latents.shape
        patches = np.ascontiguousarray(latents.transpose(0, 2, 1)).reshape(b, d, rows, cols)
        mean, std = self._bn(info)
        patches = patches * std + mean
        # un-patchify: channel (c, dy, dx) of patch (r, k) -> pixel (2r + dy, 2k + dx) of channel c
        c = d // 4
        x = patches.reshape(b, c, 2, 2, rows, cols).transpose(0, 1, 4, 2, 5, 3).reshape(b, c, 2 * rows, 2 * cols)
        return np.ascontiguousarray(x, dtype=np.float32)

    def graph_decode(self, info: dict) -> graph_ends.DecodeFeed:
        """decoder_feed's batch norm undone on the packed tokens' channels (the patch space's channels, in order)."""
        mean, std = self._bn(info)
        scale, shift = self.decode_scale_shift(info)
        return graph_ends.DecodeFeed(scale=scale, shift=shift, token_mul=tuple(float(v) for v in std.ravel()),
                                     token_add=tuple(float(v) for v in mean.ravel()))

    def encoder_latents(self, info: dict, mean: np.ndarray) -> np.ndarray:
        """The posterior mode (B, C, h, w) -> batch-normalized in the patch space, returned un-patchified."""
        b, c, h, w = mean.shape
        patches = mean.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)
        m, std = self._bn(info)
        patches = (patches - m) / std
        x = patches.reshape(b, c, 2, 2, h // 2, w // 2).transpose(0, 1, 4, 2, 5, 3).reshape(b, c, h, w)
        return np.ascontiguousarray(x, dtype=np.float32)


class Flux2Klein(Flux2Base):
    name: ClassVar[str] = "flux2_klein"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("Flux2KleinPipeline",)
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]] = (
        TextEncoderSlot("text_encoder", "tokenizer", ("Qwen3ForCausalLM",), ("Qwen2Tokenizer", "Qwen2TokenizerFast"),
                        (PROMPT_EMBEDS,)),
    )
    text_layers: ClassVar[tuple[int, ...]] = (9, 18, 27)
    embedded_guidance: ClassVar[bool] = False

    def true_cfg(self, info: dict) -> bool:
        # a step-distilled [klein] (model_index is_distilled) ignores the guidance scale: no CFG, as the pipeline
        return not info.setting("is_distilled", False)


class Flux2Dev(Flux2Base):
    name: ClassVar[str] = "flux2"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("Flux2Pipeline",)
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]] = (
        TextEncoderSlot("text_encoder", "tokenizer", ("Mistral3ForConditionalGeneration",),
                        ("PixtralProcessor", "LlamaTokenizerFast", "PreTrainedTokenizerFast"), (PROMPT_EMBEDS,)),
    )
    text_layers: ClassVar[tuple[int, ...]] = (10, 20, 30)
    embedded_guidance: ClassVar[bool] = True
    prompt_strip: ClassVar[tuple[str, ...]] = ("[IMG]",)  # format_input drops image placeholders from prompts
    special_tokens: ClassVar[bool] = False  # apply_chat_template tokenizes the rendered text, BOS included, as is
