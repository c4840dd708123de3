"""Tiled VAE decoding: the decoder runs on overlapping latent tiles, blended in numpy.

The decoder's activations grow with the image (SD1.5 at 512x512: 1.4-2.6 GB in ONNX Runtime), a
tile's do not: every tile has the same shape, so the session plans and keeps one tile's worth. As
diffusers' `enable_vae_tiling`, tiles overlap and are cross-faded over the overlap (here: each tile's
pixels weighted by a linear ramp across every side it shares with a neighbour, the weights of the
tiles over a pixel normalized to sum to one), which hides the seams the convolutions' zero padding leaves at a
tile's border. The image is not bit-identical to untiled decoding (the decoder's receptive field is
wider than any practical overlap, and its mid-block attention sees one tile), except when one tile
covers the image: then it is the untiled decode exactly. Measured in tests/runtime/test_vae_tiling.py and
bench/report_sd15/README.md.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import UserError


def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Start offsets of the fewest tiles of `tile` that cover [0, size) with consecutive tiles overlapping
    by >= `overlap`, spread evenly; one tile when it covers everything."""
    if tile >= size:
        return [0]
    count = -(-(size - overlap) // (tile - overlap))
    return [int(v) for v in np.round(np.linspace(0, size - tile, count))]


def _ramps(starts: list[int], tile: int, scale: int) -> list[np.ndarray]:
    """Per tile, its weight along one axis (image pixels): a linear ramp across each overlap with a
    neighbour (rising from ~0 at the tile's border), 1 elsewhere."""
    n = tile * scale
    out = []
    for i, s in enumerate(starts):
        w = np.ones(n, np.float64)
        if i > 0:  # the overlap with the previous tile
            k = (starts[i - 1] + tile - s) * scale
            w[:k] = (np.arange(k) + 0.5) / k
        if i + 1 < len(starts):  # the overlap with the next tile
            k = (s + tile - starts[i + 1]) * scale
            w[n - k:] = np.minimum(w[n - k:], (k - np.arange(k) - 0.5) / k)
        out.append(w)
    return out


def check_overlap(tile: int, overlap: int) -> None:
    """Tile and overlap sizes that do not depend on the decoder (checked where memory settings are parsed)."""
    if not 0 <= overlap < tile // 2:
        raise UserError(f"vae_overlap ({overlap}) must be >= 0 and less than half of vae_tile ({tile})")


def check_tiling(tile: int, overlap: int, scale: int) -> None:
    """Image-pixel tile and overlap sizes for a decoder that upsamples by `scale`."""
    if tile % scale or overlap % scale:
        raise UserError(f"vae_tile ({tile}) and vae_overlap ({overlap}) must be multiples of the VAE's scale factor {scale}")
    check_overlap(tile, overlap)


def tiled_decode(run: Callable[[np.ndarray], np.ndarray], latents: np.ndarray, tile: int, overlap: int,
                 scale: int) -> np.ndarray:
    """Decode `latents` (..., h, w) tile by tile: `run` maps a latent tile to its decoded (..., 3, h*s, w*s) image.

    `tile` and `overlap` are in image pixels (multiples of `scale`, the decoder's upsampling factor)."""
    check_tiling(tile, overlap, scale)
    t, o = tile // scale, overlap // scale
    h, w = latents.shape[-2:]
    rows, cols = tile_starts(h, t, o), tile_starts(w, t, o)
    th, tw = min(t, h), min(t, w)
    if len(rows) == 1 and len(cols) == 1:
        return run(latents)
    wy, wx = _ramps(rows, th, scale), _ramps(cols, tw, scale)
    out = None
    for i, y in enumerate(rows):
        for j, x in enumerate(cols):
            piece = run(np.ascontiguousarray(latents[..., y:y + th, x:x + tw]))
            if out is None:
                out = np.zeros((*piece.shape[:-2], h * scale, w * scale), np.float64)
                total = np.zeros((h * scale, w * scale), np.float64)
            weight = np.outer(wy[i], wx[j])
            region = (slice(y * scale, (y + th) * scale), slice(x * scale, (x + tw) * scale))
            out[(..., *region)] += piece * weight
            total[region] += weight
    return (out / total).astype(np.float32)  # where two tiles overlap their ramps sum to one already
