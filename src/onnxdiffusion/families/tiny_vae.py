"""A tiny autoencoder (diffusers' AutoencoderTiny, the TAESD architecture) beside the full VAE.

Its two halves are optional components of any family whose VAE is an image VAE: `vae_decoder_tiny`
(latents -> image, [-1, 1]) and `vae_encoder_tiny` (image -> latents; deterministic, no posterior).
diffusers' pipelines call an AutoencoderTiny exactly as they call the VAE, with the tiny model's own
config: decode(latents / scaling_factor + shift_factor). TAESD for SD 1.x/SDXL has scaling 1.0 (it
decodes the backbone's scaled latents), TAESD3/TAEF1 carry their VAE's scaling and shift (they decode
raw latents): the manifest entry records the pair, so the run time never guesses.
"""

from __future__ import annotations

from ..folder.manifest import Component, PipelineInfo
from .base import ComponentSpec, TensorSpec
from .sd import latent_io

DECODER, ENCODER = "vae_decoder_tiny", "vae_encoder_tiny"
SOURCE = "vae_tiny"  # the diffusers folder's name for the weights (export --tiny-vae DIR)
CLASS = "AutoencoderTiny"
DECODERS = ("full", "tiny")  # generate --decoder


def tiny_vae_specs(latent_channels: int) -> dict[str, ComponentSpec]:
    lat = latent_io(latent_channels)
    img = ("batch_size", 3, "height", "width")
    return {
        DECODER: ComponentSpec(DECODER, (TensorSpec("latent_sample", "float32", lat),),
                               (TensorSpec("sample", "float32", img),), atol=2e-3, kind=DECODER, source=SOURCE),
        ENCODER: ComponentSpec(ENCODER, (TensorSpec("sample", "float32", img),),
                               (TensorSpec("latents", "float32", lat),), atol=2e-3, kind=ENCODER, source=SOURCE),
    }


def scaled_info(info: PipelineInfo, entry: Component) -> PipelineInfo:
    """The pipeline info with the tiny model's scaling and shift in place of the VAE's: a family's
    decoder_feed (unpacking included) then feeds the tiny decoder as diffusers does."""
    return info.with_vae_scaling(float(entry.scaling_factor), float(entry.shift_factor or 0.0))
