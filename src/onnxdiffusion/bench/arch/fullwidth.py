#!/usr/bin/env python
"""Full-width random-weight pipelines of the new families (SDXL, SD3, Flux, Qwen-Image), built offline.

Every component has the released model's widths (hidden sizes, heads, channels; configs below are the
published config.json values); only depth (transformer blocks / layers) is reduced so the pipeline fits
a 24 GB CPU machine. Vocabularies are the scene words (tokenizers built here, nothing from the hub), so
embedding tables are small; the Qwen2.5-VL vision tower, unused for text-to-image, is kept tiny.

Two depth profiles per arch (``DEPTHS``):
  memory  a backbone of ~7 GiB (SD3: 4.3 GiB) whose export peaks near 9 GiB, the most this shared machine
          could give one measurement (export_memory.py); at the measured 1.2-1.4x, the released SD3-medium
          (7.6 GiB) would peak near 10 GiB and SDXL's UNet (9.6 GiB) near 12 GiB. Text encoders at one
          layer (not exported in that measurement, only config-checked)
  bench   backbone and encoders shallow enough that diffusers and ONNX Runtime pipelines are loaded
          side by side (bench --arch)

    python -m onnxdiffusion.bench.arch.fullwidth build ARCH FOLDER [--profile memory|bench] [--depth N]
    python -m onnxdiffusion.bench.arch.fullwidth params ARCH [--profile P]     # parameter counts (meta device, no memory)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import release

ARCHES = ("sdxl", "sd3", "flux", "qwenimage", "zimage", "flux2_klein")
# built at release size by release.py (random bf16 shards written tensor by tensor, Qwen3-4B text encoder)
RELEASE_ARCHES = ("zimage", "flux2_klein")

# the backbone's depth knob per arch and profile; the released depth for reference
DEPTHS = {
    # SDXL: transformer blocks per attention level (released: 1, 2, 10; the mid block uses the last)
    "sdxl": {"full": (1, 2, 10), "memory": (1, 2, 7), "bench": (1, 1, 1)},
    # SD3-medium: 24 joint blocks
    "sd3": {"full": 24, "memory": 13, "bench": 6},
    # FLUX.1-dev: 19 double-stream + 38 single-stream blocks
    "flux": {"full": (19, 38), "memory": (3, 6), "bench": (1, 1)},
    # Qwen-Image: 60 blocks
    "qwenimage": {"full": 60, "memory": 6, "bench": 1},
    # Z-Image-Turbo: 30 main + 2 refiner layers; FLUX.2 [klein] 4B: 5 double + 20 single blocks (bench: release)
    "zimage": {"full": (30, 2), "memory": (30, 2), "bench": (30, 2)},
    "flux2_klein": {"full": (5, 20), "memory": (5, 20), "bench": (5, 20)},
}
# text-encoder layers per profile (released: CLIP-L 12, OpenCLIP-bigG 32, T5-XXL 24, Qwen2.5-VL-7B 28)
ENCODER_LAYERS = {"memory": 1, "bench": 1}


def clip_l(tok, layers: int, projection: bool) -> dict:
    """CLIP ViT-L/14's text tower (SD1.5/SDXL/SD3/Flux text_encoder)."""
    return dict(vocab_size=len(tok), hidden_size=768, intermediate_size=3072, num_hidden_layers=layers,
                num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                projection_dim=768, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def clip_g(tok, layers: int) -> dict:
    """OpenCLIP ViT-bigG/14's text tower (SDXL/SD3 text_encoder_2)."""
    return dict(vocab_size=len(tok), hidden_size=1280, intermediate_size=5120, num_hidden_layers=layers,
                num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", projection_dim=1280,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def t5_xxl(tok, layers: int) -> dict:
    return dict(vocab_size=len(tok), d_model=4096, d_kv=64, d_ff=10240, num_layers=layers, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False)


def vae_kl(latent_channels: int, scaling: float, shift: float | None, quant_conv: bool) -> dict:
    """The SD-family KL autoencoder (SDXL / SD3 / Flux: 128-256-512-512, factor 8)."""
    return dict(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=scaling,
                shift_factor=shift, use_quant_conv=quant_conv, use_post_quant_conv=quant_conv)


def backbone_config(arch: str, depth) -> tuple[str, dict]:
    """(diffusers class, config) of the backbone at the released widths with `depth`."""
    configs = {
        "sdxl": lambda d: ("UNet2DConditionModel", dict(
            sample_size=128, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=tuple(d), attention_head_dim=(5, 10, 20), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
            cross_attention_dim=2048, norm_num_groups=32)),
        "sd3": lambda d: ("SD3Transformer2DModel", dict(
            sample_size=128, patch_size=2, in_channels=16, num_layers=int(d), attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
            out_channels=16, pos_embed_max_size=192)),
        "flux": lambda d: ("FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=int(d[0]), num_single_layers=int(d[1]), attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))),
        "qwenimage": lambda d: ("QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=int(d), attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))),
    }
    if arch in RELEASE_ARCHES:
        return release.backbone_config(arch, depth)
    return configs[arch](depth)


def count_params(arch: str, depth) -> int:
    import diffusers
    import torch

    name, cfg = backbone_config(arch, depth)
    with torch.device("meta"):
        model = getattr(diffusers, name)(**cfg)
    return sum(p.numel() for p in model.parameters())


def _clip_tokenizer(folder: Path, pad_token: str | None = None):
    from ...evaluate import scenes
    from . import tokenizers as tokenizer_build

    return tokenizer_build.clip_tokenizer(folder, scenes.vocabulary() + ["photo", "cat"], 77, pad_token)


def _t5_tokenizer(folder: Path, max_length: int):
    from ...evaluate import scenes
    from . import tokenizers as tokenizer_build

    return tokenizer_build.t5_tokenizer(folder, scenes.vocabulary(), max_length)


def _qwen_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    from ...evaluate import scenes

    template = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
                "a red circle<|im_end|>\n<|im_start|>assistant\n")
    words = scenes.vocabulary()
    corpus = [" ".join(words[i:i + 6]) for i in range(0, len(words), 3)] + [template, "a photo of a cat"]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = Qwen2TokenizerFast(tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                              pad_token="<|endoftext|>", model_max_length=2048)
    fast.save_pretrained(folder)
    return Qwen2TokenizerFast.from_pretrained(folder)


def _backbone(arch: str, depth):
    import diffusers

    name, cfg = backbone_config(arch, depth)
    return getattr(diffusers, name)(**cfg)


def _sdxl(tmp: Path, depth, layers: int):
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tok1, tok2 = _clip_tokenizer(tmp / "tok1"), _clip_tokenizer(tmp / "tok2", pad_token="!")
    te1 = CLIPTextModel(CLIPTextConfig(**clip_l(tok1, layers, False)))
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_g(tok2, layers)))
    vae = AutoencoderKL(**vae_kl(4, 0.13025, None, True))
    # stable-diffusion-xl-base-1.0's scheduler_config.json
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
                                   timestep_spacing="leading", prediction_type="epsilon", interpolation_type="linear")
    return StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok1, tokenizer_2=tok2,
                                     unet=_backbone("sdxl", depth), scheduler=sched, add_watermarker=False)


def _sd3(tmp: Path, depth, layers: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tok1, tok2 = _clip_tokenizer(tmp / "tok1"), _clip_tokenizer(tmp / "tok2", pad_token="!")
    tok3 = _t5_tokenizer(tmp / "tok3", 256)
    te1 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_l(tok1, layers, True)))
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_g(tok2, layers)))
    te3 = T5EncoderModel(T5Config(**t5_xxl(tok3, layers)))
    vae = AutoencoderKL(**vae_kl(16, 1.5305, 0.0609, False))
    return StableDiffusion3Pipeline(transformer=_backbone("sd3", depth), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=vae, text_encoder=te1, tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2,
                                    text_encoder_3=te3, tokenizer_3=tok3)


def _flux(tmp: Path, depth, layers: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok1, tok2 = _clip_tokenizer(tmp / "tok1"), _t5_tokenizer(tmp / "tok2", 512)
    te1 = CLIPTextModel(CLIPTextConfig(**clip_l(tok1, layers, False)))
    te2 = T5EncoderModel(T5Config(**t5_xxl(tok2, layers)))
    vae = AutoencoderKL(**vae_kl(16, 0.3611, 0.1159, False))
    # FLUX.1-dev's scheduler_config.json
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                            base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                            max_image_seq_len=4096)
    return FluxPipeline(scheduler=sched, vae=vae, text_encoder=te1, tokenizer=tok1, text_encoder_2=te2,
                        tokenizer_2=tok2, transformer=_backbone("flux", depth))


def _qwenimage(tmp: Path, depth, layers: int):
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = _qwen_tokenizer(tmp / "tok")
    vocab = len(tok)
    config = Qwen2_5_VLConfig(  # Qwen2.5-VL-7B's language model widths; a tiny vision tower
        text_config={"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": layers,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                     "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0, "vocab_size": vocab + 3},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 3584},
        hidden_size=3584, vocab_size=vocab + 3, vision_start_token_id=vocab, vision_end_token_id=vocab + 1,
        vision_token_id=vocab + 2, image_token_id=vocab + 2)
    te = Qwen2_5_VLForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    vae = AutoencoderKLQwenImage(  # Qwen-Image's VAE widths; per-channel statistics drawn here
        base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True],
        latents_mean=[round(float(v), 4) for v in torch.randn(16, generator=gen) * 0.5],
        latents_std=[round(float(v), 4) for v in torch.rand(16, generator=gen) * 2 + 0.5])
    sched = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler_config.json
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return QwenImagePipeline(scheduler=sched, vae=vae, text_encoder=te, tokenizer=tok,
                             transformer=_backbone("qwenimage", depth))


BUILDERS = {"sdxl": _sdxl, "sd3": _sd3, "flux": _flux, "qwenimage": _qwenimage}


def describe(arch: str, profile: str, depth=None) -> dict:
    if arch in RELEASE_ARCHES:
        return {"arch": arch, "profile": "release", "backbone_depth": DEPTHS[arch]["full"] if depth is None else depth}
    depth = DEPTHS[arch][profile] if depth is None else depth
    name, cfg = backbone_config(arch, depth)
    return {"arch": arch, "profile": profile, "backbone_class": name, "backbone_depth": depth,
            "released_depth": DEPTHS[arch]["full"], "encoder_layers": ENCODER_LAYERS[profile],
            "backbone_config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}}


def build(arch: str, folder: Path, profile: str, depth=None, encoder_layers: int | None = None) -> dict:
    """Write a diffusers pipeline folder at `folder` (seeded random weights); returns describe()."""
    if arch in RELEASE_ARCHES:  # release size: never instantiated, written shard by shard
        return release.build(arch, folder, depth, encoder_layers)
    import shutil
    import tempfile

    import torch

    desc = describe(arch, profile, depth)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="fullwidth-tok-") as tmp:
        pipe = BUILDERS[arch](Path(tmp), desc["backbone_depth"], ENCODER_LAYERS[profile])
        staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        # small shards: safetensors copies a shard's tensors into bytes before writing it
        pipe.save_pretrained(staging, safe_serialization=True, max_shard_size="1GB")
    del pipe
    (staging / "fullwidth.json").write_text(json.dumps(desc, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return desc


def _depth_arg(text: str | None):
    if text is None:
        return None
    parts = tuple(int(p) for p in text.split(","))
    return parts[0] if len(parts) == 1 else parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("verb", choices=("build", "params"))
    ap.add_argument("arch", choices=ARCHES)
    ap.add_argument("folder", nargs="?", type=Path)
    ap.add_argument("--profile", default="bench", choices=("memory", "bench"))
    ap.add_argument("--depth", help="backbone depth: N, or a,b(,c) (SDXL: blocks per level; Flux, klein: double,single; "
                                    "Z-Image: main,refiner)")
    ap.add_argument("--encoder-layers", type=int, default=None,
                    help="zimage / flux2_klein: N narrow text-encoder layers at the release width (proof runs; "
                         "default: Qwen3-4B at release size)")
    args = ap.parse_args()
    depth = _depth_arg(args.depth)
    if args.verb == "params":
        d = DEPTHS[args.arch][args.profile] if depth is None else depth
        n = count_params(args.arch, d)
        print(json.dumps({"arch": args.arch, "depth": d, "params": n, "fp32_gib": round(n * 4 / 2**30, 2),
                          "released_params": count_params(args.arch, DEPTHS[args.arch]["full"])}))
        return
    if args.folder is None:
        ap.error("build needs FOLDER")
    print(json.dumps(build(args.arch, args.folder, args.profile, depth, args.encoder_layers)))


if __name__ == "__main__":
    main()
