"""Qwen-Image-Edit and -Edit-Plus: Qwen-Image that edits by instruction (QwenImageEditPipeline,
QwenImageEditPlusPipeline).

What differs from Qwen-Image (qwenimage.py, reused):
- the picture(s) reach the text encoder too: the prompt template holds vision tokens (Edit-Plus: "Picture i: ..."
  per picture), each expanded to the picture's merged patch count, and the Qwen2.5-VL encoder runs its vision
  tower on the picture (resized by the folder's own processor: qwenimage_vision.py) and puts its tokens in
  their place; 64 template tokens are dropped (Qwen-Image: 34);
- each picture is resized to the 1-megapixel area at its aspect ratio (sides multiples of 32), VAE-encoded
  (posterior mode), normalized, packed, and joined after the noise tokens; its rotary ids are its own centred grid
  on frame i + 1 (diffusers' `img_shapes` with both grids); the backbone's output is cut back to the noise tokens.
  As for Kontext, the reference tokens and their ids are backbone inputs of their own (`reference_latents`,
  `reference_ids`), joined and cut inside the graph: conditioning like the text, a constant input of the Loop;
- Edit-Plus encodes the text's pictures at a 384 x 384 area (the VAE's at 1 megapixel), and takes several;
- true CFG rescaled per token and mu from the noise tokens only, as Qwen-Image already does.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from ..errors import UserError
from . import latents as lat
from . import qwenimage_vision as vision
from .base import ComponentSpec, TensorSpec
from .qwenimage import QwenImage, pad_tokens

REF_LATENTS, REF_IDS = "reference_latents", "reference_ids"
REF_TOKENS = ("batch_size", "reference_sequence_length")
VL_INPUTS = ("position_ids", "pixel_values", "vision_position_ids", "vision_window_ids", "vision_image_ids",
             "vision_merge_order")
# the pipelines' prompt templates (Edit's holds the one picture's vision tokens; Edit-Plus prefixes one per picture)
_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
           "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
           "image that meets the user's requirements while maintaining consistency with the original input where "
           "appropriate.<|im_end|>\n<|im_start|>user\n")
EDIT_TEMPLATE = _SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_TEMPLATE = _SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD, VISION_START = "<|image_pad|>", "<|vision_start|>"
DROP = 64
VAE_AREA, PLUS_CONDITION_AREA = 1024 * 1024, 384 * 384
PLUS_REFERENCES = 3  # Qwen-Image-Edit-2509's documented 1-3 pictures
# export validation: (batch, one picture grid (t, h, w) per row, text tokens beside the picture's) per shape
EXPORT_PROMPTS = ((2, (1, 4, 8), 20), (1, (1, 8, 4), 13))


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of `area` pixels at aspect `ratio` = w / h, each rounded to a multiple of 32 (the pipelines')."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


class _EditTokenizer:
    """The edit template around the prompt, each picture's pad token expanded to its merged patch count (what
    Qwen2VLProcessor does before tokenizing), padded to the longest row; no truncation, as the processor's call."""

    def __init__(self, folder, info: dict):
        from ..runtime.tokenizer import PaddedTokenizer

        self._tok = PaddedTokenizer(folder, None)
        self.info = info

    def __call__(self, prompts: list[str], grids: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        info = self.info
        unit = vision.VisionConfig.from_dict(info.setting("vision")).merge ** 2
        prefix = "".join(PLUS_PICTURE.format(i + 1) for i in range(len(grids))) if info.setting("edit_plus") else ""
        texts = []
        for p in prompts:
            parts = info.setting("prompt_template").format(prefix + p).split(IMAGE_PAD)
            if len(parts) != len(grids) + 1:
                raise UserError(f"the prompt holds {len(parts) - 1} picture tokens for {len(grids)} picture(s)")
            text = parts[0]
            for grid, rest in zip(grids, parts[1:]):
                text += IMAGE_PAD * (int(np.prod(grid)) // unit) + rest
            texts.append(text)
        return self._tok(texts, pad_to_max=False)


class QwenImageEdit(QwenImage):
    name: ClassVar[str] = "qwenimage_edit"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    image_role: ClassVar[str] = "reference"
    max_references: ClassVar[int] = PLUS_REFERENCES  # Edit takes one (pipeline_info's max_references)
    controlnet: ClassVar[Any] = None  # diffusers has no Qwen-Image-Edit ControlNet pipeline
    whole_refusal: ClassVar[str | None] = (
        "its text encoder reads the picture: the processor's resize, the vision tower's patches and the 3-axis rotary "
        "positions of the picture tokens are host-side (the whole graph takes token ids, not pictures)")
    # the source folder's JSON export reads beside the components' configs
    source_configs: ClassVar[tuple[str, ...]] = ("processor/preprocessor_config.json",)

    def check_source(self, src_name: str, model_index: dict, present: set[str]) -> None:
        super().check_source(src_name, model_index, present)
        if "processor" not in present:
            raise UserError(f"{src_name}: a {self.name} pipeline needs its 'processor' folder (preprocessor_config.json: "
                            "the picture's min/max pixels)")

    def diffusers_call(self, info: dict, guidance: float) -> dict[str, Any]:
        return {"true_cfg_scale": guidance, "negative_prompt": " "}

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        plus = configs["model_index"].get("_class_name") == "QwenImageEditPlusPipeline"
        tr = configs["transformer"]
        if tr.get("zero_cond_t"):
            raise UserError("transformer option zero_cond_t (Qwen-Image-Edit-2511) is not supported yet")
        info = super().pipeline_info(configs)
        te = configs["text_encoder"]
        pre = configs.get("processor/preprocessor_config")
        if not pre:
            raise UserError("processor/preprocessor_config.json is missing or empty")
        if "vision_config" not in te or "image_token_id" not in te or "vision_start_token_id" not in te:
            raise UserError("the text encoder's config has no vision tower (vision_config, image_token_id): "
                            "an editing pipeline reads the picture through it")
        multiple = 2 * 2 ** len(configs["vae"]["temperal_downsample"])  # 2x2 patches of the VAE's factor
        if multiple > 32 or 32 % multiple:
            raise UserError(f"the pipelines round reference sizes to 32 pixels; this VAE's size multiple is {multiple}")
        return {**info, "prompt_template": PLUS_TEMPLATE if plus else EDIT_TEMPLATE, "prompt_template_drop": DROP,
                "edit_plus": plus,
                "max_references": PLUS_REFERENCES if plus else 1,
                "vision": vision.vision_config(pre, te["vision_config"]),
                "image_token_id": int(te["image_token_id"]), "vision_start_token_id": int(te["vision_start_token_id"])}

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        c = 4 * int(info.latent_channels)
        return (*super().conditioning(info), TensorSpec(REF_LATENTS, "float32", (*REF_TOKENS, c)),
                TensorSpec(REF_IDS, "float32", (*REF_TOKENS, 3)))

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        specs = super().component_specs(info, present)
        if "text_encoder" in specs:
            ids = ("batch_size", "sequence_length")
            patches = vision.VisionConfig.from_dict(info.setting("vision")).patch_width
            inputs = (TensorSpec("input_ids", "int64", ids), TensorSpec("attention_mask", "int64", ids),
                      TensorSpec("position_ids", "int64", (3, *ids)),
                      TensorSpec("pixel_values", "float32", ("vision_patches", patches)),
                      TensorSpec("vision_position_ids", "int64", ("vision_patches", 2)),
                      TensorSpec("vision_window_ids", "int64", ("vision_patches",)),
                      TensorSpec("vision_image_ids", "int64", ("vision_patches",)),
                      TensorSpec("vision_merge_order", "int64", ("vision_tokens",)))
            old = specs["text_encoder"]
            specs["text_encoder"] = ComponentSpec(
                "text_encoder", inputs, old.outputs, atol=old.atol, kind="vl_text_encoder", source="text_encoder",
                options={k: info.setting(k) for k in ("vision", "image_token_id", "vision_start_token_id")})
        return specs

    def required_components(self, info: dict) -> tuple[str, ...]:
        return (*super().required_components(info), "vae_encoder")

    def export_dims(self, spec: ComponentSpec, info: dict) -> list[dict[str, int]]:
        if spec.kind == "vl_text_encoder":
            unit = vision.VisionConfig.from_dict(info.setting("vision")).merge ** 2
            return [{"batch_size": b, "sequence_length": int(np.prod(g)) // unit + text, "vision_patches": b * int(np.prod(g)),
                     "vision_tokens": b * int(np.prod(g)) // unit} for b, g, text in EXPORT_PROMPTS]
        dims = super().export_dims(spec, info)
        if spec.kind != self.backbone_kind:
            return dims
        # reference grids unlike the noise grids (3x2, then 2x4): a token count of their own
        return [{**d, "reference_sequence_length": r * c, "reference_rows": r, "reference_cols": c}
                for d, (r, c) in zip(dims, ((3, 2), (2, 4)))]

    # -- reference pictures (runtime/references.py hands them over) --------------------------------------
    def reference_size(self, info: dict, height: int, width: int) -> tuple[int, int]:
        w, h = calculate_dimensions(VAE_AREA, width / height)
        return h, w

    def default_size(self, info: dict, pictures: list) -> tuple[int, int]:
        """The output size when none is asked: the folder's default area at the (Edit: first, Edit-Plus: last)
        picture's aspect ratio, as the pipelines default to the reference's 1-megapixel size (a released folder's
        default is 1024 x 1024: the same sizes), rounded down to the size multiple."""
        w, h = pictures[-1 if info.setting("edit_plus") else 0].size
        cw, ch = calculate_dimensions(int(info.default_height) * int(info.default_width), w / h)
        m = int(info.size_multiple)
        return max(m, ch // m * m), max(m, cw // m * m)

    def reference_inputs(self, info: dict, latents: list[np.ndarray], batch: int) -> dict[str, np.ndarray]:
        limit = int(info.setting("max_references", 1))
        if not 1 <= len(latents) <= limit:
            kind = "an Edit-Plus" if info.setting("edit_plus") else "a Qwen-Image-Edit (not Plus)"
            raise UserError(f"{kind} model takes 1 to {limit} reference picture(s), got {len(latents)}")
        tokens, ids = [], []
        for i, ref in enumerate(latents):
            ref = np.asarray(ref, np.float32)
            tokens.append(lat.pack_patches(ref))
            ids.append(lat.image_ids(ref.shape[2] // 2, ref.shape[3] // 2, centred=True, frame=i + 1))
        tokens, ids = np.concatenate(tokens, axis=1), np.concatenate(ids, axis=0)
        return {REF_LATENTS: np.ascontiguousarray(np.repeat(tokens, batch, axis=0)),
                REF_IDS: np.ascontiguousarray(np.repeat(ids[None], batch, axis=0))}

    reads_pictures: ClassVar[bool] = True

    def reference_text(self, info: dict, pictures: list) -> list[tuple[np.ndarray, tuple[int, int, int]]]:
        """RGB PIL pictures -> what the text encoder's vision tower takes of each: the pipeline's resize (Edit: the
        reference size; Edit-Plus: a 384 x 384 area), then the processor's (qwenimage_vision.pixel_patches)."""
        from PIL import Image

        cfg = vision.VisionConfig.from_dict(info.setting("vision"))
        out = []
        for pic in pictures:
            w, h = pic.size
            if info.setting("edit_plus"):
                cw, ch = calculate_dimensions(PLUS_CONDITION_AREA, w / h)
            else:
                ch, cw = self.reference_size(info, h, w)
            if (cw, ch) != pic.size:
                pic = pic.resize((cw, ch), resample=Image.Resampling.LANCZOS)
            out.append(vision.pixel_patches(pic, cfg))
        return out

    def timing_feed(self, component: str, info: dict, batch: int, rng) -> dict[str, np.ndarray] | None:
        """The VL text encoder's vision inputs must agree with each other and with the picture tokens in the ids
        (the manifest's 1-sized dims do not): each row one random picture of the smallest grid and a short prompt."""
        if component != "text_encoder":
            return None
        cfg = vision.VisionConfig.from_dict(info.setting("vision"))
        grid = (1, 2 * cfg.merge, 2 * cfg.merge)
        rows = [(rng.standard_normal((4 * cfg.merge ** 2, cfg.patch_width), dtype=np.float32), grid)] * batch
        image, start = int(info.setting("image_token_id")), int(info.setting("vision_start_token_id"))
        ids = np.array([[1, 2, start, *[image] * 4, 3, 4, 5, 6, 7, 8]] * batch, np.int64)
        mask = np.ones_like(ids)
        return {"input_ids": ids, "attention_mask": mask, **vision.vision_feeds(rows, cfg),
                "position_ids": vision.rope_positions(ids, mask, [grid] * batch, image, start, cfg.merge)}

    # -- run time: the text encoder reads the pictures too --------------------------------------------
    def make_tokenizer(self, slot, folder, info: dict):
        from ..folder.manifest import confined

        return _EditTokenizer(confined(folder, slot.tokenizer, "tokenizer folder"), info)

    def encode_text(self, slot, tokenizer, session, prompts: list[str], info: dict, pictures=None) -> dict[str, Any]:
        """`pictures`: reference_text's list; None (the load-time probe): one blank picture of the smallest grid."""
        cfg = vision.VisionConfig.from_dict(info.setting("vision"))
        if pictures is None:
            pictures = [(np.zeros((4 * cfg.merge ** 2, cfg.patch_width), np.float32), (1, 2 * cfg.merge, 2 * cfg.merge))]
        grids = [g for _, g in pictures]
        ids, mask = tokenizer(prompts, grids)
        rows = list(pictures) * len(prompts)  # each row holds every picture; the tower runs per row
        feeds = vision.vision_feeds(rows, cfg)
        feeds["position_ids"] = vision.rope_positions(ids, mask, [g for _, g in rows], int(info.setting("image_token_id")),
                                                      int(info.setting("vision_start_token_id")), cfg.merge)
        hidden = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask, **feeds})[0]
        drop = int(info.prompt_template_drop)
        states, keep = pad_tokens([h[m.astype(bool)][drop:] for h, m in zip(hidden, mask)])
        return {"last_hidden_state": states, "mask": keep}
