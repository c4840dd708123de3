"""FLUX.1 Kontext: Flux that edits by instruction (diffusers' FluxKontextPipeline).

The picture to edit is a reference, not a start: resized to the nearest preferred Kontext resolution, VAE-encoded
(posterior mode), shifted and scaled, packed into 2x2 tokens and appended after the noise tokens with position
ids whose frame axis is 1; the backbone's output is cut back to the noise tokens. Here the reference tokens and
their ids are two backbone inputs of their own (`reference_latents`, `reference_ids`), joined and cut inside the
exported graph, so the sampler state stays the noise tokens and the reference is conditioning like the text: the
same every step, a constant input of the Loop graph. Our height/width are the output's exact size (diffusers
rescales its own to `max_area`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import UserError
from . import latents as lat
from .base import TensorSpec
from .flux import Flux

REF_LATENTS, REF_IDS = "reference_latents", "reference_ids"
REF_TOKENS = ("batch_size", "reference_sequence_length")
# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS, (width, height) in pixels of its factor-8 VAE
PREFERRED = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
             (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
             (1568, 672))
REFERENCE_FRAME = 1  # the position ids' axis 0 of the reference tokens (the noise tokens' is 0)


def preferred_size(height: int, width: int, vae_scale_factor: int, multiple: int) -> tuple[int, int]:
    """(height, width) of the preferred resolution nearest the picture's aspect ratio (ties: the narrower, as
    diffusers' min over (distance, w, h)), rounded down to `multiple`. The table is in pixels of Kontext's
    factor-8 VAE; a VAE of another factor gets the same token grids (sides scaled by factor / 8)."""
    aspect = width / height
    _, w, h = min((abs(aspect - w / h), w, h) for w, h in PREFERRED)
    w, h = w * vae_scale_factor // 8, h * vae_scale_factor // 8
    return h // multiple * multiple, w // multiple * multiple


class FluxKontext(Flux):
    name: ClassVar[str] = "flux_kontext"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("FluxKontextPipeline",)
    image_role: ClassVar[str] = "reference"
    max_references: ClassVar[int] = 1
    controlnet: ClassVar[Any] = None  # diffusers has no Kontext ControlNet pipeline
    # the whole graph takes the picture's packed reference latents and their ids as inputs beside the token ids (the
    # picture's resize and VAE encoding stay outside it: export-web's page runs them as a graph of their own)
    whole_refusal: ClassVar[str | None] = None

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        info = super().pipeline_info(configs)
        if "backbone_in_channels" in info:
            raise UserError("a Kontext transformer takes the packed latents alone (no Fill channels); "
                            f"this one takes {info['backbone_in_channels']}")
        return info

    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        c = 4 * int(info.latent_channels)
        return (*super().conditioning(info), TensorSpec(REF_LATENTS, "float32", (*REF_TOKENS, c)),
                TensorSpec(REF_IDS, "float32", (*REF_TOKENS, 3)))

    def export_dims(self, spec, info: dict) -> list[dict[str, int]]:
        dims = super().export_dims(spec, info)
        if spec.kind != self.backbone_kind:
            return dims
        # reference grids unlike the noise grids (2x3, then 4x2): a token count of their own
        return [{**d, "reference_sequence_length": n, "reference_rows": r, "reference_cols": n // r}
                for d, (r, n) in zip(dims, ((2, 6), (4, 8)))]

    def reference_size(self, info: dict, height: int, width: int) -> tuple[int, int]:
        return preferred_size(height, width, int(info.vae_scale_factor), int(info.size_multiple))

    def reference_inputs(self, info: dict, latents: list[np.ndarray], batch: int) -> dict[str, np.ndarray]:
        if len(latents) != 1:
            raise UserError(f"a Kontext model takes one reference picture, got {len(latents)}")
        ref = latents[0]
        tokens = lat.pack_patches(np.asarray(ref, np.float32))
        ids = lat.image_ids(ref.shape[2] // 2, ref.shape[3] // 2, frame=REFERENCE_FRAME)
        return {REF_LATENTS: np.ascontiguousarray(np.repeat(tokens, batch, axis=0)),
                REF_IDS: np.ascontiguousarray(np.repeat(ids[None], batch, axis=0))}
