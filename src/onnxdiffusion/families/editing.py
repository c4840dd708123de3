"""What a picture given with the prompt means to a family: img2img's start picture (strength, inpainting) or an
editing model's reference pictures (generate --image, pipe(image=...), /v1/images/edits).

A mixin of families/base.Family, apart so base.py keeps the family's core declarations (components, conditioning,
sizes, sampling); these are the defaults (Stable Diffusion's img2img), which the editing families override.
Run-time code: numpy only. runtime/image_input.py and runtime/references.py call these hooks.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import UserError


class PictureInput:
    """The picture hooks of a Family (its `name` is read for refusals)."""

    # -- image input (img2img, inpainting) ---------------------------------------------------------
    def start_step(self, steps: int, strength: float) -> int:
        """Sampler steps an img2img run at `strength` skips (SD/SDXL pipelines: the kept steps rounded down)."""
        return max(steps - min(int(steps * strength), steps), 0)

    def encoder_latents(self, info: dict, mean: np.ndarray) -> np.ndarray:
        """The VAE encoder's posterior mean -> scaled (B, C, h, w) latents (diffusers: (x - shift) * scaling)."""
        shift = np.float32(info.vae_shift_factor or 0.0)
        return ((mean - shift) * np.float32(info.vae_scaling_factor)).astype(np.float32)

    def inpaint_inputs(self, info: dict, mask: np.ndarray, masked: np.ndarray) -> np.ndarray:
        """An inpainting backbone's extra sample channels from the binary pixel mask (B, 1, H, W) and the
        masked picture's scaled latents (B, C, h, w): [mask on the latent grid, masked latents] (the 9-channel
        UNet's; nearest sampling picks pixel f*i, as torch's interpolate)."""
        f = int(info.vae_scale_factor)
        return np.concatenate([mask[:, :, ::f, ::f], masked], axis=1).astype(np.float32)

    def pack_latents(self, info: dict, latents: np.ndarray) -> np.ndarray:
        """(B, C, h, w) latents -> the sampler's layout (NCHW here; packed-token families override)."""
        return np.ascontiguousarray(latents, dtype=np.float32)

    # -- what a picture given with the prompt means (generate --image, pipe(image=...), /v1/images/edits) -----
    # "start": img2img, the sampler starts from it (strength, mask); "reference": an editing model, the
    # picture(s) condition every step through the backbone's reference inputs; "none": the family takes none
    image_role: ClassVar[str] = "start"
    max_references: ClassVar[int] = 1  # reference pictures one generation takes (role "reference")
    # role "reference": whether a generation may take none (FLUX.2 draws from text alone or edits), in which case
    # reference_inputs is called with no latents
    references_optional: ClassVar[bool] = False

    def reference_size(self, info: dict, height: int, width: int) -> tuple[int, int]:
        """The size a reference picture of height x width pixels is encoded at (default: its own, rounded down
        to the size multiple; Kontext picks its nearest preferred resolution)."""
        m = int(info.size_multiple)
        return height // m * m, width // m * m

    # whether the text encoders read the reference pictures too (reference_text; encode_text's `pictures`)
    reads_pictures: ClassVar[bool] = False

    def reference_text(self, info: dict, pictures: list) -> Any:
        """What the text encoders take of the RGB PIL reference pictures (handed to encode_text as `pictures`)."""
        return None

    def default_size(self, info: dict, pictures: list) -> tuple[int, int] | None:
        """An editing model's output (height, width) when none is asked, from its RGB PIL references (None: the
        folder's default size)."""
        return None

    def reference_inputs(self, info: dict, latents: list[np.ndarray], batch: int) -> dict[str, np.ndarray]:
        """Each reference picture's scaled (1, C, h, w) latents -> the backbone's reference inputs by name, on a
        batch of `batch` (the same for cond and uncond: constant inputs of the loop, never its state)."""
        raise UserError(f"a {self.name} backbone takes no reference picture")
