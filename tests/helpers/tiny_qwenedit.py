"""Tiny random-weight Qwen-Image-Edit and -Edit-Plus pipelines, built offline (nothing from the hub).

The text encoder is a Qwen2.5-VL WITH its vision tower (2 blocks, window attention in one, full in the other),
the processor a Qwen2VLProcessor made of the image processor and the tokenizer alone: transformers 4.57's
processor wants a video processor, which wants torchvision, which does not load beside torch 2.13 CPU. The
image processor's min/max pixels are small (the picture reaches the vision tower as a few dozen patches).
The VAE downsamples 16x (four stages), so the 1-megapixel reference the pipelines make is 32 x 32 tokens.
"""

from __future__ import annotations

from pathlib import Path

VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 140  # the folder's preprocessor_config.json (released: 3136, 12845056)


def edit_tokenizer():
    """tiny_families' Qwen2 tokenizer with Qwen2.5-VL's vision special tokens."""
    from tiny_families import qwen2_tokenizer

    tok = qwen2_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION})
    return tok


def _no_video_class():
    from transformers import Qwen2VLProcessor

    class ImageTextProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without its video half (pictures and text are all the pipelines hand it)."""

        attributes = ["image_processor", "tokenizer"]

        def __init__(self, image_processor, tokenizer):
            super().__init__(image_processor, tokenizer)

    return ImageTextProcessor


def load_processor(folder: Path):
    """The saved processor without a video processor (what the exporter must do too)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    return _no_video_class()(Qwen2VLImageProcessor.from_pretrained(folder / "processor"),
                             AutoTokenizer.from_pretrained(folder / "tokenizer"))


def _text_encoder(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION}
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0, "vocab_size": len(tokenizer),
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "fullatt_block_indexes": [1], "window_size": 56, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "in_chans": 3},
        hidden_size=16, vocab_size=len(tokenizer),
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        vision_token_id=ids["<|image_pad|>"], image_token_id=ids["<|image_pad|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_qwenedit(folder: Path, plus: bool = False) -> Path:
    """QwenImageEditPipeline (or -Plus): the VL text encoder above, a 2-layer MMDiT, a 16x 3D VAE with per-channel
    latents_mean/latents_std, Qwen-Image-Edit's scheduler config."""
    import json

    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
                           QwenImageEditPlusPipeline, QwenImageTransformer2DModel)

    torch.manual_seed(0)
    tokenizer = edit_tokenizer()
    text_encoder = _text_encoder(tokenizer)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    )
    gen = torch.Generator().manual_seed(2)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True, True],
        latents_mean=[round(float(v), 4) for v in torch.randn(4, generator=gen) * 0.5],
        latents_std=[round(float(v), 4) for v in torch.rand(4, generator=gen) * 2 + 0.5],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = cls(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, processor=None,
               transformer=transformer)
    out = folder / ("qwenedit_plus" if plus else "qwenedit")
    pipe.save_pretrained(out, safe_serialization=True)
    # the processor folder as released (image processor config + tokenizer), written without a video processor
    from transformers import Qwen2VLImageProcessor

    Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out / "processor")
    tokenizer.save_pretrained(out / "processor")
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


def load_pipeline(folder: Path):
    """The saved pipeline, loaded with the processor made without torchvision."""
    import json

    import diffusers

    cls = getattr(diffusers, json.loads((folder / "model_index.json").read_text())["_class_name"])
    return cls.from_pretrained(folder, processor=load_processor(folder))
