"""`--decoder tiny`: the folder's tiny autoencoder (families/tiny_vae.py) decodes in place of the VAE.

The session is made on first use (a pipeline that never asks for it never loads it). Its feed is the
family's decoder feed (unpacking included) with the tiny model's own scaling and shift, as diffusers'
pipelines call an AutoencoderTiny; its output is an image in [-1, 1] like the VAE's.
"""

from __future__ import annotations

import numpy as np

from ..families.tiny_vae import DECODER, scaled_info


class TinyDecoder:
    """Pipeline.decode's tiny decoder (the pipeline makes one, on first use)."""

    def __init__(self, pipe):
        from . import guards
        from .loading import disabled

        entry = pipe.manifest.components[DECODER]
        self.session = pipe.component_session(DECODER, disabled_optimizers=disabled(entry))
        guards.check_io(pipe.folder, DECODER, self.session, ("latent_sample",), ("sample",))
        self.family, self.info = pipe.family, scaled_info(pipe.info, entry)

    def prepare(self, latents: np.ndarray, height: int, width: int):
        """(the decoder's feed, a function running it on a feed or a tile of one)."""
        return self.family.decoder_feed(self.info, latents, height, width), self.run

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(["sample"], {"latent_sample": x})[0]
