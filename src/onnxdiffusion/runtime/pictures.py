"""The picture ends of a Pipeline: pictures in (the VAE encoder, for img2img, inpainting and editing references)
and images out (the VAE decoder or the tiny one, tiled when the memory options ask).

A mixin of runtime/pipeline.Pipeline, kept apart so the Pipeline's module holds its core (loading the sessions,
conditioning, the sampler table, the generation entry points). The state these stages make on first use (the VAE
encoder's session, the tiny decoder) is this mixin's own, set up by `_init_pictures`.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..families.latents import channel_axis
from . import guards
from .loading import disabled as _disabled
from .vae_tiling import tiled_decode


class PictureStages:
    """Needs from the host: folder, manifest, info, family, memory, vae_decoder, component_session."""

    def _init_pictures(self, backbone_io) -> None:
        self._vae_encoder = None  # made on first use (img2img, inpainting)
        self._tiny = None  # the tiny decoder, made on first use (decoder="tiny")
        self._backbone_io_shapes = {i.name: i.shape for i in backbone_io.get_inputs()}

    def decode(self, latents: np.ndarray, height: int | None = None, width: int | None = None,
               decoder: str = "full") -> np.ndarray:
        """Final latents -> (batch, H, W, 3) uint8; height/width (the image's) matter to packed latents."""
        h, w = height or self.info.default_height, width or self.info.default_width
        if decoder == "full":
            feed = self.family.decoder_feed(self.info, latents, h, w)
            run = lambda x: self.vae_decoder.run(["sample"], {"latent_sample": x})[0]  # noqa: E731
        else:  # runtime/tiny_decoder.py
            from .tiny_decoder import TinyDecoder

            guards.check_decoder(self.folder, self.manifest, decoder)
            self._tiny = self._tiny or TinyDecoder(self)  # made once, on first use
            feed, run = self._tiny.prepare(latents, h, w)
        if self.memory.vae_tile:  # memory vae_tile=N: overlapping tiles of N pixels (runtime/vae_tiling.py)
            decoded = tiled_decode(run, feed, self.memory.vae_tile, self.memory.vae_tile_overlap, self.info.vae_scale_factor)
        else:
            decoded = run(feed)
        image = self.family.decoded_images(decoded)
        guards.check_finite(image, "VAE decoding (the decoder produced NaN/inf pixels)")
        image = np.clip(image / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1)
        return (image * 255).round().astype(np.uint8)

    # -- image input ----------------------------------------------------------------------------
    def encode_image(self, rgb, height: int | None = None, width: int | None = None) -> np.ndarray:
        """An RGB picture ((H, W, 3) uint8 or PIL) -> scaled latents (1, C, h, w): the VAE encoder's
        posterior mean, scaled (and shifted) as the family's pipeline does; resized to height x width
        (default: the picture's own size, rounded down to the model's size multiple) with a notice."""
        from .image_input import sized_pixels

        return self.encode_pixels(sized_pixels(rgb, int(self.info.size_multiple), height, width))

    def encode_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """(B, 3, H, W) float32 in [-1, 1] -> scaled latents (B, C, h, w) (posterior mean)."""
        if "vae_encoder" not in self.manifest.components:
            raise UserError(f"{self.folder} has no vae_encoder: export it (without `--skip vae_encoder`) to "
                            "take a picture, or pass image latents")
        if self._vae_encoder is None:
            self._vae_encoder = self.component_session(
                "vae_encoder", disabled_optimizers=_disabled(self.manifest.components["vae_encoder"]))
        params = self._vae_encoder.run(None, {"sample": np.ascontiguousarray(pixels, np.float32)})[0]
        mean = params[:, : params.shape[1] // 2]
        return self.family.encoder_latents(self.info, mean)

    def backbone_extra_channels(self) -> int:
        """Sample channels beyond the latents' (an inpainting backbone's mask + masked-image latents: 5 on the
        9-channel UNet, 320 on Flux Fill's tokens; 0 on a regular backbone)."""
        sample, m = self._backbone_io_shapes.get("sample"), int(self.info.size_multiple)
        latents = self.family.latent_shape(self.info, 1, m, m)  # the sampler state's layout
        axis = channel_axis(len(latents))
        ok = sample and len(sample) == len(latents) and isinstance(sample[axis], int)
        return sample[axis] - latents[axis] if ok else 0
