"""Tiny ControlNets for the tests: `ControlNetModel.from_unet` of a tiny pipeline's UNet, its zero convolutions
(and the conditioning embedding's last conv) given random non-zero weights, so the nets move the image."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def build_tiny_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, embedding=(8, 16, 16), std: float = 0.3) -> Path:
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(pipeline_dir / "unet", local_files_only=True)
    torch.manual_seed(seed)
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=tuple(embedding))
    with torch.no_grad():
        zero_convs = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
        for conv in zero_convs:
            conv.weight.normal_(0.0, std)
            conv.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out


def control_image(size: int, seed: int = 0) -> np.ndarray:
    """An (H, W, 3) uint8 picture: a few bright rectangles on black, like an edge or position map."""
    rng = np.random.default_rng(seed)
    img = np.zeros((size, size, 3), np.uint8)
    for _ in range(3):
        y, x = rng.integers(0, size - size // 4, 2)
        img[y:y + size // 4, x:x + size // 3] = rng.integers(128, 256, 3)
    return img


def build_tiny_sd3_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, layers: int = 1, std: float = 0.3,
                              zero_pooled: bool = True) -> Path:
    """`SD3ControlNetModel.from_transformer` of a tiny SD3 pipeline's transformer, its zero-initialised
    controlnet_blocks and control-latent patch embedding given random non-zero weights."""
    import torch
    from diffusers import SD3ControlNetModel, SD3Transformer2DModel

    tr = SD3Transformer2DModel.from_pretrained(pipeline_dir / "transformer", local_files_only=True)
    torch.manual_seed(seed)
    net = SD3ControlNetModel.from_transformer(tr, num_layers=layers, num_extra_conditioning_channels=0)
    if not zero_pooled:
        net.register_to_config(force_zeros_for_pooled_projection=False)
    with torch.no_grad():
        for lin in [*net.controlnet_blocks, net.pos_embed_input.proj]:
            lin.weight.normal_(0.0, std)
            lin.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_flux_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, layers: int = 1, single_layers: int = 1,
                               std: float = 0.3) -> Path:
    """`FluxControlNetModel.from_transformer` of a tiny Flux pipeline's transformer, its zero-initialised
    controlnet_blocks, controlnet_single_blocks and control-latent embedder given random non-zero weights."""
    import torch
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    tr = FluxTransformer2DModel.from_pretrained(pipeline_dir / "transformer", local_files_only=True)
    torch.manual_seed(seed)
    net = FluxControlNetModel.from_transformer(tr, num_layers=layers, num_single_layers=single_layers,
                                               attention_head_dim=tr.config.attention_head_dim,
                                               num_attention_heads=tr.config.num_attention_heads)
    with torch.no_grad():
        for lin in [*net.controlnet_blocks, *net.controlnet_single_blocks, net.controlnet_x_embedder]:
            lin.weight.normal_(0.0, std)
            lin.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_qwen_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, layers: int = 1, std: float = 0.3) -> Path:
    """`QwenImageControlNetModel.from_transformer` of a tiny Qwen-Image pipeline's transformer, its
    zero-initialised controlnet_blocks and control-latent embedder given random non-zero weights."""
    import torch
    from diffusers import QwenImageControlNetModel, QwenImageTransformer2DModel

    tr = QwenImageTransformer2DModel.from_pretrained(pipeline_dir / "transformer", local_files_only=True)
    torch.manual_seed(seed)
    net = QwenImageControlNetModel.from_transformer(tr, num_layers=layers, attention_head_dim=tr.config.attention_head_dim,
                                                    num_attention_heads=tr.config.num_attention_heads)
    with torch.no_grad():
        for lin in [*net.controlnet_blocks, net.controlnet_x_embedder]:
            lin.weight.normal_(0.0, std)
            lin.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out
