"""Stable Diffusion v1.5's architecture at full size (or `tiny`: the same block types, narrow), seeded random
weights: a diffusers folder, then `onnxdiffusion export` of it. What `bench --arch sd15 | sd15-tiny` builds.

The configs are runwayml/stable-diffusion-v1-5's, except the default size: `sample_size` 32 latents (256x256
images, the bench size), so that what reads the folder's default size (the exporter's validation, quantize's
calibration and its latency feed) works at the size the bench measures. The weights do not depend on it
(the committed full-size figures used a copy of the 512-default folder whose manifest said 256: the same graphs).
The tokenizer is the scene vocabulary's (nothing from the hub).

`--lcm` builds the FastSD CPU recipe's model instead: an LCM-distilled UNet (`time_cond_proj_dim`, the guidance
scale embedded, no CFG) with an LCMScheduler, 512x512 by default (128x128 with --tiny), and a tiny autoencoder (TAESD's AutoencoderTiny
config, random weights) in WORK/diffusers/vae_tiny, exported beside the VAE as vae_decoder_tiny (`--decoder tiny`;
the OpenVINO peer converts the same folder).

    python -m onnxdiffusion.bench.arch.sd15 build WORK [--tiny] [--lcm] [--seed 0]   # WORK/diffusers
    python -m onnxdiffusion.bench.arch.sd15 export WORK [--threads 1]                # WORK/onnx
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from ..variants import TINY_VAE_DIR

UNET_CONFIG = {
    "sample_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
}
VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 256,
    "scaling_factor": 0.18215,
}
TEXT_ENCODER_CONFIG = {  # CLIP ViT-L/14's text tower
    "vocab_size": 49408,  # raised to len(tokenizer) if that is larger
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "initializer_range": 0.02,
    "initializer_factor": 1.0,
}
SCHEDULER_CONFIG = {  # SD1.5 ships a PNDMScheduler with these values; the runtime reads the same keys
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "trained_betas": None,
    "skip_prk_steps": True,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
}
LCM_SCHEDULER_CONFIG = {  # LCM-distilled SD1.5 checkpoints ship an LCMScheduler with these values
    "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "trained_betas": None, "set_alpha_to_one": True, "steps_offset": 1, "prediction_type": "epsilon",
    "original_inference_steps": 50, "clip_sample": False, "timestep_spacing": "leading", "timestep_scaling": 10.0,
}
LCM_TIME_COND_DIM = 256  # LCM-Dreamshaper-v7's w-embedding width
TINY_VAE = TINY_VAE_DIR  # where --lcm puts the AutoencoderTiny folder, inside WORK/diffusers
TOKENIZER_MAX_LENGTH = 77
# the same block types, narrow: builds and exports in seconds (tests, a non-editable install's smoke run)
TINY = {"backbone": {"block_out_channels": (32, 64, 64, 64), "layers_per_block": 1, "norm_num_groups": 8,
                 "cross_attention_dim": 32, "attention_head_dim": 4},
        "vae": {"block_out_channels": (8, 16, 16, 16), "layers_per_block": 1, "norm_num_groups": 8},
        "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "projection_dim": 32, "num_hidden_layers": 2,
                         "num_attention_heads": 4}}


LCM_TINY_SIZE = 128  # `--arch sd15-lcm-tiny`'s default image size


def configs(tiny: bool = False, lcm: bool = False) -> dict[str, dict]:
    out = {"backbone": dict(UNET_CONFIG), "vae": dict(VAE_CONFIG), "text_encoder": dict(TEXT_ENCODER_CONFIG)}
    if tiny:
        for name, change in TINY.items():
            out[name].update(change)
    if lcm:  # the FastSD recipe's size, 512x512; the narrow smoke model's 128x128 (TAESD's 512 decode was most of it)
        side = LCM_TINY_SIZE if tiny else 512
        out["backbone"].update(sample_size=side // 8, time_cond_proj_dim=LCM_TIME_COND_DIM)
        out["vae"].update(sample_size=side)
    return out


def _log(msg: str) -> None:
    print(f"sd15: {msg}", file=sys.stderr, flush=True)


def build(work: Path, tiny: bool = False, seed: int = 0, lcm: bool = False) -> Path:
    """WORK/diffusers: an SD1.5-shaped StableDiffusionPipeline folder (safetensors), written atomically."""
    import torch
    from diffusers import (AutoencoderKL, AutoencoderTiny, LCMScheduler, PNDMScheduler, StableDiffusionPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from ...evaluate import scenes
    from .tokenizers import build_tokenizer_files

    cfg = configs(tiny, lcm)
    work = Path(work)
    target, tmp = work / "diffusers", work / "diffusers.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    tok_dir = work / "tokenizer_src"
    build_tokenizer_files(scenes.vocabulary(), tok_dir, TOKENIZER_MAX_LENGTH)
    tokenizer = CLIPTokenizer.from_pretrained(tok_dir)
    text_cfg = dict(cfg["text_encoder"], vocab_size=max(cfg["text_encoder"]["vocab_size"], len(tokenizer)),
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    _log(f"building {'tiny ' if tiny else ''}text encoder, UNet, VAE (random init, seed {seed})")
    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL(**cfg["vae"]).eval(), text_encoder=CLIPTextModel(CLIPTextConfig(**text_cfg)).eval(),
        tokenizer=tokenizer, unet=UNet2DConditionModel(**cfg["backbone"]).eval(),
        scheduler=LCMScheduler(**LCM_SCHEDULER_CONFIG) if lcm else PNDMScheduler(**SCHEDULER_CONFIG),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(tmp, safe_serialization=True)
    if lcm:  # TAESD's shape at full size whatever --tiny says: it is the recipe's decoder, and small already
        AutoencoderTiny().eval().save_pretrained(tmp / TINY_VAE, safe_serialization=True)
    shutil.rmtree(tok_dir, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def export(work: Path, threads: int = 1) -> Path:
    """WORK/onnx: `onnxdiffusion export` of WORK/diffusers (validated against PyTorch by the exporter)."""
    import torch

    from ...export import ExportOptions, export_pipeline

    torch.set_num_threads(threads)
    work = Path(work)
    src, out = work / "diffusers", work / "onnx"
    _log(f"exporting {src} -> {out}")
    tiny = src / TINY_VAE
    export_pipeline(src, out, ExportOptions(overwrite=True, tiny_vae=str(tiny) if tiny.is_dir() else None),
                    progress=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("build", "export"))
    ap.add_argument("work", type=Path)
    ap.add_argument("--tiny", action="store_true", help="the same block types, narrow (seconds)")
    ap.add_argument("--lcm", action="store_true", help="the FastSD recipe's model: LCM UNet + LCMScheduler + TAESD")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))
    args.work.mkdir(parents=True, exist_ok=True)
    if args.phase == "build":
        build(args.work, args.tiny, args.seed, args.lcm)
    else:
        export(args.work, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
