"""Z-Image (Z-Image-Turbo and its base): a Qwen3 text encoder read at its second-to-last hidden state through
the tokenizer's chat template, a single-stream DiT over 2x2 latent patches (image tokens first, then the
caption, each padded to a multiple of 32 with learned pad tokens), flow matching, an SD-style AutoencoderKL.

Text encoding follows ZImagePipeline._encode_prompt in numpy: the prompt goes through the folder's chat
template (rendered once at export, enable_thinking on as the pipeline asks), is tokenized and truncated to
512 tokens, and only the tokens the attention mask keeps reach the transformer. diffusers pads every prompt
to 512 before the encoder; a causal encoder's states for the kept tokens do not depend on the right padding,
so the exported encoder runs on the prompt's own length (KV-free, one pass). The caption rows are padded
here to a common multiple of 32 under a mask (`text_outputs`: numpy on the host, ONNX nodes in the `--whole`
graph, which takes the template's ids and their mask); the transformer graph turns each row's own padding into
its pad token and masks the rest, as diffusers' per-sample lists do.

The sampler state is the unpacked latent image (B, C, h, w): the transformer graph patchifies it. Its
timestep input is the table's t = 1000 sigma, fed to the model as (1000 - t) / 1000, and its output is
negated inside the graph, so the backbone predicts the flow velocity like every flow family. Guidance:
the pipeline's `pos + g (pos - neg)` is CFG at scale g + 1 (`cfg_scale`), so `guidance` means diffusers'
guidance_scale and 0 runs without the negative batch.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import UserError
from ..folder.manifest import confined
from . import control_zimage
from .base import (CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, Family, NumpyOps, Ops, SizeLimits, TensorSpec,
                   TextEncoderSlot)
from .flux import flow_scheduler_info, flow_sigmas, flow_start_step, flow_vae_info
from .gguf_names import Z_IMAGE
from .qwenimage import MASK, QwenImage

PENULTIMATE = "penultimate_hidden_state"
MAX_PROMPT_TOKENS = 512  # ZImagePipeline's max_sequence_length
SEQ_MULTIPLE = 32  # the transformer pads image and caption tokens to multiples of this (SEQ_MULTI_OF)
# ZImagePipeline renders the chat template with these (apply_chat_template keyword arguments)
CHAT = (("add_generation_prompt", True), ("enable_thinking", True))


class _ChatTokenizer:
    def __init__(self, folder, info):
        from ..runtime.tokenizer import PaddedTokenizer

        template = (info.setting("chat_templates") or {}).get("text_encoder")
        try:  # str.format with one positional field (literal braces escaped)
            ok = isinstance(template, str) and template.format("\0").count("\0") == 1
        except (ValueError, IndexError, KeyError):
            ok = False
        if not ok:
            raise UserError("the manifest's pipeline.chat_templates.text_encoder must be one template with one {} "
                            "(export it again)")
        self._tok = PaddedTokenizer(folder, None, template)
        self.limit = int(info.max_prompt_tokens)

    def __call__(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return self._tok(prompts, pad_to_max=False, truncate_to=self.limit)

    def page_spec(self) -> dict:
        return self._tok.page_spec(pad_to_max=False, truncate_to=self.limit)


class ZImage(Family):
    name: ClassVar[str] = "zimage"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("ZImagePipeline",)
    backbone: ClassVar[str] = "transformer"
    backbone_classes: ClassVar[tuple[str, ...]] = ("ZImageTransformer2DModel",)
    backbone_kind: ClassVar[str] = "zimage_transformer"
    latent_image_input: ClassVar[bool] = True
    # the main single-stream layers (the refiners before them run every step)
    cache_block_pattern: ClassVar[str] = r"^(/model/layers\.\d+/)"
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]] = (
        TextEncoderSlot("text_encoder", "tokenizer", ("Qwen3Model",), ("Qwen2Tokenizer", "Qwen2TokenizerFast"),
                        (PENULTIMATE,), chat_template=CHAT),
    )
    predictions: ClassVar[tuple[str, ...]] = ("flow",)
    gguf_names: ClassVar[Any] = Z_IMAGE  # ComfyUI-GGUF files: label lumina2, the release's tensor names
    controlnet: ClassVar[Any] = control_zimage.SUPPORT

    def cfg_scale(self, guidance: float) -> float:
        return float(guidance) + 1.0

    def diffusers_call(self, info: dict, guidance: float) -> dict[str, Any]:
        return {"guidance_scale": guidance, "negative_prompt": ""}

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        tr, te = configs["transformer"], configs["text_encoder"]
        width = int(te["hidden_size"])
        if int(tr.get("cap_feat_dim", 2560)) != width:
            raise UserError(f"text encoder width {width} does not match the transformer's cap_feat_dim "
                            f"{tr.get('cap_feat_dim', 2560)} (components of different models mixed?)")
        if tr.get("siglip_feat_dim") is not None:
            raise UserError("a Z-Image transformer with siglip_feat_dim (Z-Image-Omni) is not supported")
        if list(tr.get("all_patch_size", [2])) != [2] or list(tr.get("all_f_patch_size", [1])) != [1]:
            raise UserError(f"transformer patch sizes {tr.get('all_patch_size')}/{tr.get('all_f_patch_size')} are not "
                            "supported (2x2 patches, one frame)")
        vae = flow_vae_info(configs["vae"])
        if int(tr.get("in_channels", 16)) != vae["latent_channels"]:
            raise UserError(f"the VAE's {vae['latent_channels']} latent channels are not the transformer's "
                            f"in_channels {tr.get('in_channels', 16)}")
        lens = [int(v) for v in tr.get("axes_lens", [1024, 512, 512])]
        if lens[0] < MAX_PROMPT_TOKENS + 2:
            raise UserError(f"the transformer's axes_lens[0] {lens[0]} cannot number a {MAX_PROMPT_TOKENS}-token caption")
        f = vae["vae_scale_factor"]
        return {
            **flow_scheduler_info(configs["scheduler"]),
            **vae,
            "size_multiple": 2 * f,
            "default_height": 1024,  # ZImagePipeline's default size
            "default_width": 1024,
            "model_max_length": MAX_PROMPT_TOKENS,
            "max_prompt_tokens": MAX_PROMPT_TOKENS,
            "context_dim": width,
            "max_latent": 2 * min(lens[1], lens[2]),  # rows/columns of 2x2 patches the rotary table numbers
        }

    def size_limits(self, info: dict) -> SizeLimits:
        side = int(info.max_latent) * int(info.vae_scale_factor)
        return SizeLimits(int(info.size_multiple), side, side, "the transformer's rotary position table")

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        return (TensorSpec(CONTEXT, "float32", ("batch_size", "sequence_length", int(info.context_dim))),
                TensorSpec(MASK, "float32", ("batch_size", "sequence_length")))

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        from .sd import latent_io, vae_specs

        ids = ("batch_size", "sequence_length")
        specs = {
            "text_encoder": ComponentSpec(
                "text_encoder", (TensorSpec("input_ids", "int64", ids), TensorSpec("attention_mask", "int64", ids)),
                (TensorSpec(PENULTIMATE, "float32", (*ids, int(info.context_dim))),), atol=1e-4,
                kind="decoder_text_encoder", source="text_encoder", options={"layers": (-2,), "positions": "arange"}),
            "transformer": ComponentSpec(
                "transformer",
                (TensorSpec(SAMPLE, "float32", latent_io(int(info.latent_channels))),
                 TensorSpec(TIMESTEP, "float32", ("batch_size",)), *self.conditioning(info)),
                (TensorSpec(OUT, "float32", latent_io(int(info.latent_channels))),), atol=1e-3,
                kind=self.backbone_kind, source="transformer"),
            **vae_specs(int(info.latent_channels)),
        }
        return {k: v for k, v in specs.items() if v.source in present}

    def export_dims(self, spec: ComponentSpec, info: dict) -> list[dict[str, int]]:
        if spec.kind == "decoder_text_encoder":
            return [{"batch_size": 2, "sequence_length": 40}, {"batch_size": 1, "sequence_length": 23}]
        f = int(info.vae_scale_factor)
        # latent grids of 12 and 33 tokens: both need the image pad tokens; captions of one and two blocks of 32
        dims = []
        for b, (h, w), text in ((2, (6, 8), 64), (1, (6, 22), 32)):
            dims.append({"batch_size": b, "sequence_length": text, "height_latent": h, "width_latent": w,
                         "height": h * f, "width": w * f})
        return dims

    # -- run time ---------------------------------------------------------------------------------
    def make_tokenizer(self, slot: TextEncoderSlot, folder, info: dict):
        return _ChatTokenizer(confined(folder, slot.tokenizer, "tokenizer folder"), info)

    def encode_text(self, slot: TextEncoderSlot, tokenizer, session, prompts: list[str], info: dict) -> dict[str, Any]:
        ids, mask = tokenizer(prompts)
        hidden = session.run([PENULTIMATE], {"input_ids": ids, "attention_mask": mask})[0]
        return self.text_outputs(NumpyOps(), slot, {PENULTIMATE: hidden}, mask, info)

    def text_outputs(self, ops: Ops, slot: TextEncoderSlot, outputs: dict[str, Any], mask: Any, info: dict) -> dict[str, Any]:
        """The kept tokens of each row, zero-padded to a common multiple of 32 under a float mask."""
        states, keep = ops.kept_tokens(outputs[PENULTIMATE], mask, 0, SEQ_MULTIPLE)
        return {PENULTIMATE: states, "mask": keep}

    def combine(self, ops: Ops, encoded: dict[str, dict[str, Any]], info: dict) -> dict[str, Any]:
        te = encoded["text_encoder"]
        return {CONTEXT: te[PENULTIMATE], MASK: te["mask"]}

    # prompt and negative prompt differ in length: the shorter is zero-padded, masked out (both stay multiples of 32)
    align = QwenImage.align

    def image_seq_len(self, info: dict, height: int, width: int) -> int | None:
        f = 2 * int(info.vae_scale_factor)
        return (height // f) * (width // f)

    def start_step(self, steps: int, strength: float) -> int:
        return flow_start_step(steps, strength)

    def base_sigmas(self, steps: int) -> np.ndarray | None:
        return flow_sigmas(steps)  # get_default_z_image_sigmas
