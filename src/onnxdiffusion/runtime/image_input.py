"""Image-conditioned generation (img2img, inpainting): pictures and masks in, the sampler's start.

As diffusers' img2img and inpaint pipelines do it:
- the picture is resized (Lanczos) to the generation size and scaled to [-1, 1]; the VAE encoder's
  posterior mean, scaled as the family says, is the image latents (or the caller hands them in);
- the strength drops the first `family.start_step(steps, strength)` sampler steps; the sampler
  starts from its own add_noise(image latents, noise, first kept row) (samplers/levels.py);
- a mask (white = repaint) is binarized at 0.5 (optionally Gaussian-blurred first, the mask
  processor's `blur`) and brought to the latent grid by nearest-neighbour sampling; after each step
  the kept region is reset to the image latents noised to the next row's level (4-channel
  backbones), or the backbone itself takes mask + masked-image latents as extra input channels
  (a 9-channel inpainting UNet, `StableDiffusionInpaintPipeline`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..families.latents import channel_axis
from ..samplers import SamplerTable


@dataclass
class ImageStart:
    """What a run conditioned on an image adds to a text-to-image run (all in the sampler's layout)."""
    image_latents: np.ndarray  # scaled image latents, packed as the sampler's state
    start: int  # the first table row that runs
    cut: SamplerTable  # the table from that row on (init_scale 1: the state starts at x_init)
    x_init: np.ndarray  # the sampler's starting state
    signal: float  # x_init = signal * image_latents + noise_level * noise
    noise_level: float
    keep: np.ndarray | None = None  # inpainting: 1 where the picture is kept (latent grid, sampler layout)
    extra: np.ndarray | None = None  # inpainting backbones: their extra sample channels (family.inpaint_inputs)
    overlay: tuple[np.ndarray, np.ndarray] | None = None  # (picture (H, W, 3) uint8, alpha (H, W) of the mask)


def _pil():
    from PIL import Image

    return Image


def to_pil(image, what: str = "image"):
    """A PIL image, an (H, W, 3) uint8 array, or a path -> PIL RGB."""
    Image = _pil()
    if isinstance(image, Image.Image):
        return image
    a = np.asarray(image)
    if a.dtype != np.uint8 or a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3, 4)):
        raise UserError(f"{what} must be a PIL image or an (H, W, 3) uint8 array, got {a.dtype} {a.shape}")
    return Image.fromarray(a[..., 0] if a.ndim == 3 and a.shape[2] == 1 else a)


def _resized(img, height: int, width: int, what: str):
    Image = _pil()
    if img.size != (width, height):
        warnings.warn(f"{what} is {img.size[1]}x{img.size[0]}, resized to the generation size {height}x{width}",
                      UserWarning, stacklevel=5)
        img = img.resize((width, height), resample=Image.Resampling.LANCZOS)
    return img


def image_pixels(image, height: int, width: int) -> np.ndarray:
    """(1, 3, H, W) float32 in [-1, 1] (VaeImageProcessor.preprocess: resize, /255, *2 - 1)."""
    img = _resized(to_pil(image).convert("RGB"), height, width, "the image")
    x = np.asarray(img, dtype=np.float32) / np.float32(255.0)
    return np.ascontiguousarray((x * 2.0 - 1.0).transpose(2, 0, 1)[None])


def sized_pixels(rgb, multiple: int, height: int | None = None, width: int | None = None) -> np.ndarray:
    """Pipeline.encode_image's pixels: `rgb` resized to height x width (default: its own size rounded down to
    the model's size `multiple`)."""
    img = to_pil(rgb)
    h = height or img.size[1] // multiple * multiple
    w = width or img.size[0] // multiple * multiple
    if h < 1 or w < 1:
        raise UserError(f"the image is {img.size[1]}x{img.size[0]}, smaller than the model's size multiple {multiple}")
    return image_pixels(img, h, w)


def mask_pixels(mask, height: int, width: int, blur: float = 0.0) -> np.ndarray:
    """(1, 1, H, W) float32 in {0, 1}, 1 = repaint (the mask processor: grayscale, blur, resize, >= 0.5)."""
    from PIL import ImageFilter

    img = to_pil(mask, "mask").convert("L")
    if blur < 0:
        raise UserError(f"mask blur must be >= 0, got {blur}")
    if blur:
        img = img.filter(ImageFilter.GaussianBlur(blur))
    img = _resized(img, height, width, "the mask")
    m = np.asarray(img, dtype=np.float32) / np.float32(255.0)
    return (m >= 0.5).astype(np.float32)[None, None]


def latent_grid(mask: np.ndarray, factor: int) -> np.ndarray:
    """Pixel mask (B, 1, H, W) -> latent grid (B, 1, H/f, W/f): torch's nearest interpolation picks pixel f*i."""
    return np.ascontiguousarray(mask[:, :, ::factor, ::factor])


def check_strength(strength) -> float:
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 < float(strength) <= 1.0:
        raise UserError(f"strength must be a number in (0, 1], got {strength!r}")
    return float(strength)


def image_latents_of(pipe, image, batch: int, height: int, width: int) -> np.ndarray:
    """`image` (RGB picture, or (B, C, h, w) scaled latents used as they are) -> scaled NCHW latents."""
    if isinstance(image, np.ndarray) and image.dtype.kind == "f":
        f = pipe.info.vae_scale_factor
        c = int(pipe.info.latent_channels)
        want = (image.shape[0], c, height // f, width // f)
        if image.ndim != 4 or image.shape[1:] != want[1:] or image.shape[0] not in (1, batch):
            raise UserError(f"image latents must have shape (1 or {batch}, {c}, {height // f}, {width // f}), "
                            f"got {image.shape}")
        lat = np.asarray(image, np.float32)
        if not np.isfinite(lat).all():
            raise UserError("image latents contain NaN or inf")
    else:
        lat = pipe.encode_image(image, height=height, width=width)
    if lat.shape[0] != batch:
        lat = np.repeat(lat, batch, axis=0)
    return np.ascontiguousarray(lat, np.float32)


def plan_start(pipe, table: SamplerTable, image, strength: float, steps: int, noise0: np.ndarray, batch: int,
               height: int, width: int, mask=None, mask_blur: float = 0.0, image_pixels_=None,
               overlay_picture: bool = False) -> ImageStart:
    """The sampler's start for an image-conditioned run; `noise0` is the Gaussian noise (the `latents`)."""
    from ..samplers.levels import cut_rows, start_row

    if table.levels is None:
        raise UserError(f"sampler {table.sampler!r} has no img2img start (its noise levels are not known)")
    skip = pipe.family.start_step(steps, strength)
    start = start_row(table, skip)
    if start >= table.num_steps:
        raise UserError(f"strength {strength} with {steps} steps leaves no step to run; raise the strength or steps")
    nchw = image_latents_of(pipe, image, batch, height, width)
    lat = pipe.family.pack_latents(pipe.info, nchw)
    if lat.shape != noise0.shape:
        raise UserError(f"image latents pack to {lat.shape}, the noise is {noise0.shape}")
    signal, level = (float(v) for v in table.levels[start])
    rows64 = cut_rows(table.rows64, start)[start:]
    cut = SamplerTable(sampler=table.sampler, rows=rows64.astype(np.float32), init_scale=1.0,
                       needs_noise=table.needs_noise, rows64=rows64, levels=table.levels[start:])
    keep = extra = None
    if mask is not None:
        m = mask_pixels(mask, height, width, mask_blur)
        grid = np.repeat(latent_grid(m, pipe.info.vae_scale_factor), batch, axis=0)  # (B, 1, h, w)
        more = pipe.backbone_extra_channels()
        if not more:  # a regular backbone: blend after every step
            keep = pipe.family.pack_latents(pipe.info, np.broadcast_to(1.0 - grid, nchw.shape))
        else:  # an inpainting backbone: mask and masked-image latents as input channels
            if isinstance(image, np.ndarray) and image.dtype.kind == "f":
                raise UserError("an inpainting backbone needs the picture itself, not its latents")
            pixels = image_pixels(image, height, width) if image_pixels_ is None else image_pixels_
            masked = pipe.encode_pixels(pixels * (m < 0.5).astype(np.float32))
            extra = pipe.family.inpaint_inputs(pipe.info, np.repeat(m, batch, axis=0), np.repeat(masked, batch, axis=0))
            axis = channel_axis(extra.ndim)
            if extra.shape[axis] != more:
                raise UserError(f"this inpainting backbone takes {more} extra input channels; the "
                                f"{pipe.family.name} family makes {extra.shape[axis]} from a mask and a picture")
    if mask is not None and strength == 1.0:
        # diffusers' inpaint pipelines start from pure noise at full strength (not add_noise at the first step)
        x_init, signal, level = (noise0 * np.float32(table.init_scale)).astype(np.float32), 0.0, table.init_scale
    else:
        x_init = (np.float32(signal) * lat + np.float32(level) * noise0).astype(np.float32)
    overlay = None
    if mask is not None and overlay_picture and not (isinstance(image, np.ndarray) and image.dtype.kind == "f"):
        pic = np.asarray(_resized(to_pil(image).convert("RGB"), height, width, "the image"), np.uint8)
        overlay = (pic, overlay_alpha(mask, height, width, mask_blur))
    return ImageStart(lat, start, cut, x_init, signal, level, keep, extra, overlay)


def overlay_alpha(mask, height: int, width: int, blur: float) -> np.ndarray:
    """(H, W) float32 in [0, 1]: how much of the generated pixel shows (the mask, blurred but not binarized,
    as diffusers' apply_overlay composites the original through the inverted mask)."""
    from PIL import ImageFilter

    img = to_pil(mask, "mask").convert("L")
    if blur:
        img = img.filter(ImageFilter.GaussianBlur(blur))
    img = img.resize((width, height), resample=_pil().Resampling.LANCZOS) if img.size != (width, height) else img
    return np.asarray(img, np.float32) / np.float32(255.0)


def apply_overlay(images: np.ndarray, overlay) -> np.ndarray:
    """Generated (B, H, W, 3) uint8 -> the picture's pixels outside the mask, the generated ones inside."""
    pic, alpha = overlay
    a = alpha[None, :, :, None]
    out = a * images.astype(np.float32) + (1.0 - a) * pic[None].astype(np.float32)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def read_picture(path, what: str):
    """A picture file -> PIL image (loaded now, so a bad file fails before any model loads)."""
    from pathlib import Path

    Image = _pil()
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path}: no such file")
    try:
        with Image.open(path) as img:
            img.load()
            return img.copy()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"{what} {path}: not a readable picture ({type(e).__name__})") from None


def check_mask_matches(image, mask) -> None:
    """A mask must cover the picture it masks: same size (both are then brought to the generation size)."""
    if mask is None or image is None or (isinstance(image, np.ndarray) and image.dtype.kind == "f"):
        return
    isize, msize = to_pil(image).size, to_pil(mask, "mask").size
    if isize != msize:
        raise UserError(f"the mask is {msize[1]}x{msize[0]} but the image is {isize[1]}x{isize[0]}; "
                        "give a mask of the image's size")
