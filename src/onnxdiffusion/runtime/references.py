"""What `image` means to a model, and reference pictures for the editing families.

The family declares it (`Family.image_role`): "start" (img2img and inpainting: runtime/image_input.py), "reference"
(an editing model: each picture is resized to the size the family encodes references at, VAE-encoded (posterior
mean), and handed to the backbone as inputs of their own by `Family.reference_inputs`, which the host loop and
the Loop graph feed like any other conditioning: the same every step), or "none". The checks here run before any
model loads (generate, serve) and again in the Pipeline, so every entry point refuses the same requests.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..families.base import MAX_SIDE

ROLES = ("start", "reference", "none")
# what each role makes of `image`, for --help, the docs and the API schema
MEANING = {"start": "img2img: the start picture (with --strength; --mask inpaints)",
           "reference": "editing: the picture(s) to edit, the prompt says how",
           "none": "takes no picture"}
# 8-bit modes Pillow converts to RGB without inventing anything; the rest (16-bit, float, CMYK, YCbCr) are refused
PICTURE_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA")


def pictures(image) -> list:
    """`image` as a list of pictures (one picture, or a list / tuple of them); [] for None."""
    if image is None:
        return []
    return list(image) if isinstance(image, (list, tuple)) else [image]


def check_image_request(family, image_count: int, mask: bool = False, strength: bool = False,
                        what: str = "--image") -> None:
    """One line for a request the family cannot take: an editing model without a picture, a picture for a
    family that takes none, several where it takes one, img2img's strength or a mask on an editing model."""
    role = family.image_role
    if role == "none" and (image_count or mask or strength):
        raise UserError(f"a {family.name} model takes no picture ({what}, mask, strength): it only draws from text")
    if role == "reference":
        if not image_count and not getattr(family, "references_optional", False):  # (duck-typed families too)
            raise UserError(f"a {family.name} model edits a picture: give the picture to edit ({what}) with the "
                            "instruction as the prompt")
        if image_count > family.max_references:
            raise UserError(f"a {family.name} model takes at most {family.max_references} reference picture(s), "
                            f"got {image_count}")
        if mask or strength:
            raise UserError(f"a {family.name} model edits by instruction: its {what} is a reference, not an "
                            "img2img start, so it takes no mask or strength")
    if role == "start" and image_count > 1:
        raise UserError(f"a {family.name} model takes one start picture for img2img ({what}), got {image_count}")


def start_picture(image):
    """img2img's one picture: a one-item list is unwrapped (the callers that take several pass lists)."""
    items = pictures(image)
    return items[0] if len(items) == 1 and isinstance(image, (list, tuple)) else image


def reference_pixels(pipe, picture, index: int) -> np.ndarray:
    """One reference picture -> (1, 3, h, w) in [-1, 1] at the family's reference size."""
    from .image_input import image_pixels, to_pil

    what = f"reference picture {index + 1}"
    img = to_pil(picture, what)
    if img.mode not in PICTURE_MODES:
        raise UserError(f"{what} has mode {img.mode!r}; give an 8-bit picture ({', '.join(PICTURE_MODES)})")
    w, h = img.size
    m = int(pipe.info.size_multiple)
    if min(h, w) < m or max(h, w) > MAX_SIDE:
        raise UserError(f"{what} is {h}x{w}; each side must be {m}..{MAX_SIDE} pixels for this model")
    rh, rw = pipe.family.reference_size(pipe.info, h, w)
    if rh < m or rw < m:
        raise UserError(f"{what} is {h}x{w}, which this model's reference size rounds to nothing")
    img = img.convert("RGB")
    if img.size != (rw, rh):  # the family's reference size: a resize the model asks for, so no notice
        from PIL import Image

        img = img.resize((rw, rh), resample=Image.Resampling.LANCZOS)
    return image_pixels(img, rh, rw)


def reference_latents(pipe, picture, index: int) -> np.ndarray:
    """A reference picture, or its scaled (1, C, h, w) latents as they are -> scaled latents."""
    if isinstance(picture, np.ndarray) and picture.dtype.kind == "f":
        c, m = int(pipe.info.latent_channels), int(pipe.info.size_multiple) // int(pipe.info.vae_scale_factor)
        if picture.ndim != 4 or picture.shape[:2] != (1, c) or picture.shape[2] % m or picture.shape[3] % m \
                or not picture.shape[2] or not picture.shape[3]:
            raise UserError(f"reference latents {index + 1} must have shape (1, {c}, h, w) with h, w multiples of "
                            f"{m}, got {picture.shape}")
        if not np.isfinite(picture).all():
            raise UserError(f"reference latents {index + 1} contain NaN or inf")
        return np.ascontiguousarray(picture, np.float32)
    return pipe.encode_pixels(reference_pixels(pipe, picture, index))


def plan_references(pipe, image, batch: int) -> dict[str, np.ndarray]:
    """The backbone's reference inputs for an editing model's `image` (one picture or a list)."""
    items = pictures(image)
    check_image_request(pipe.family, len(items), what="image")
    if "vae_encoder" not in pipe.manifest.components and not all(
            isinstance(p, np.ndarray) and p.dtype.kind == "f" for p in items):
        raise UserError(f"{pipe.folder} has no vae_encoder: export it (without `--skip vae_encoder`) to take a "
                        "reference picture")
    latents = [reference_latents(pipe, p, i) for i, p in enumerate(items)]
    return pipe.family.reference_inputs(pipe.info, latents, batch)


def probe_picture(width: int, height: int) -> np.ndarray:
    """The picture an editing model is warmed up, calibrated and golden-checked on when no one gives one: a
    left-to-right grey ramp (H, W, 3) uint8, the same for a model and its quantized sibling."""
    ramp = np.linspace(32, 224, width, dtype=np.float32).round().astype(np.uint8)
    return np.ascontiguousarray(np.repeat(np.broadcast_to(ramp[None, :, None], (height, width, 1)), 3, axis=2))


def probe_feeds(pipe, width: int | None = None, height: int | None = None, light: bool = False) -> dict:
    """`image=` for a generation that measures a model (warm-up, quantize's calibration and probe images, the golden
    check): the probe picture for an editing model, nothing for the others. `light`: its latents encoded at the
    output's size instead (as many reference tokens as noise tokens, the ratio of a full-size Kontext run at its
    preferred size; a tiny model's preferred-size reference would be 4096 tokens beside 64, and int8-static's
    calibration keeps every activation of it)."""
    if pipe.family.image_role != "reference" or pipe.family.references_optional:
        return {}  # (a family that also draws from text alone is measured on text-to-image)
    w, h = width or pipe.info.default_width, height or pipe.info.default_height
    picture = probe_picture(w, h)
    if not light:
        return {"image": picture}
    from .image_input import image_pixels

    return {"image": pipe.encode_pixels(image_pixels(picture, h, w))}
