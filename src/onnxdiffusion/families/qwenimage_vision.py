"""Qwen2.5-VL's picture side in numpy and Pillow (run time, torch-free): what transformers' Qwen2VLImageProcessor
and the vision tower's grid bookkeeping compute before any weight is touched.

- `pixel_patches`: the processor's resize (smart_resize within the folder's min/max pixels, Pillow bicubic),
  rescale, normalize and patchify, in its order;
- `vision_feeds`: the exported vision tower's grid-dependent inputs. transformers computes them from
  `image_grid_thw` as Python ints (rotary table rows, the window permutation, cu_seqlens splits), which a traced
  graph would freeze at the export-time size; here they are arrays fed to the graph: the patches already in window
  order, each patch's (row, column) rotary position, window and picture ids (the graph's attention masks), and the
  order that puts the merged tokens back;
- `rope_positions`: Qwen2.5-VL's 3D (temporal, row, column) text positions for a prompt holding pictures
  (`get_rope_index`), padding positions 1 as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UserError


@dataclass(frozen=True)
class VisionConfig:
    """The folder's preprocessor_config.json and the vision tower's geometry, as the manifest records them."""

    patch: int
    temporal: int
    merge: int
    window: int  # the vision tower's window_size in pixels
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float
    resample: int  # a PIL resampling filter (3: bicubic)

    @classmethod
    def from_dict(cls, d) -> VisionConfig:
        """The manifest's record (an untrusted folder's: a malformed one is a one-line error)."""
        try:
            cfg = cls(int(d["patch"]), int(d["temporal"]), int(d["merge"]), int(d["window"]), int(d["min_pixels"]),
                      int(d["max_pixels"]), tuple(float(v) for v in d["mean"]), tuple(float(v) for v in d["std"]),
                      float(d["rescale"]), int(d["resample"]))
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"manifest pipeline.vision is malformed ({type(e).__name__}: {e})") from None
        sizes = (cfg.patch, cfg.temporal, cfg.merge, cfg.window, cfg.min_pixels, cfg.max_pixels)
        if min(sizes) < 1 or max(sizes) > 1 << 28 or len(cfg.mean) != 3 or len(cfg.std) != 3 \
                or not all(math.isfinite(v) and v > 0 for v in cfg.std) or cfg.resample not in range(6):
            raise UserError(f"manifest pipeline.vision has values out of range: {d}")
        return cfg

    def to_dict(self) -> dict:
        return {"patch": self.patch, "temporal": self.temporal, "merge": self.merge, "window": self.window,
                "min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "mean": list(self.mean),
                "std": list(self.std), "rescale": self.rescale, "resample": self.resample}

    @property
    def patch_width(self) -> int:
        return 3 * self.temporal * self.patch * self.patch


def vision_config(preprocessor: dict, vision: dict) -> dict:
    """The manifest's record from preprocessor_config.json and the text encoder's vision_config (export side)."""
    size = preprocessor.get("size") or {}
    min_pixels = preprocessor.get("min_pixels") or size.get("shortest_edge") or 56 * 56
    max_pixels = preprocessor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    patch, merge = int(preprocessor.get("patch_size", 14)), int(preprocessor.get("merge_size", 2))
    if patch != int(vision.get("patch_size", 14)) or merge != int(vision.get("spatial_merge_size", 2)):
        raise UserError("processor/preprocessor_config.json's patch_size / merge_size disagree with the text "
                        "encoder's vision_config (components of different models mixed?)")
    if int(preprocessor.get("temporal_patch_size", 2)) != int(vision.get("temporal_patch_size", 2)):
        raise UserError("processor/preprocessor_config.json's temporal_patch_size disagrees with the vision tower's")
    for key, want in (("do_resize", True), ("do_rescale", True), ("do_normalize", True)):
        if bool(preprocessor.get(key, want)) != want:
            raise UserError(f"processor/preprocessor_config.json sets {key}={preprocessor.get(key)!r}; "
                            "only the released processing is supported")
    return VisionConfig(patch, int(preprocessor.get("temporal_patch_size", 2)), merge, int(vision.get("window_size", 112)),
                        int(min_pixels), int(max_pixels), tuple(float(v) for v in preprocessor.get("image_mean")),
                        tuple(float(v) for v in preprocessor.get("image_std")),
                        float(preprocessor.get("rescale_factor", 1 / 255)), int(preprocessor.get("resample", 3))).to_dict()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: sides multiples of `factor`, area within [min_pixels, max_pixels], the aspect
    ratio kept as nearly as possible."""
    if max(height, width) / min(height, width) > 200:
        raise UserError(f"a reference picture's aspect ratio must be under 200, got {width}x{height}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pixel_patches(picture, cfg: VisionConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An RGB PIL picture -> (patches [t*h*w, 3*T*P*P] float32, grid (t, h, w)) as Qwen2VLImageProcessor gives."""
    width, height = picture.size
    rh, rw = smart_resize(height, width, cfg.patch * cfg.merge, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(picture.convert("RGB").resize((rw, rh), resample=cfg.resample))
    x = (resized.astype(np.float64) * cfg.rescale).astype(np.float32)
    x = ((x - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32)).astype(np.float32)
    frames = np.repeat(x.transpose(2, 0, 1)[None], cfg.temporal, axis=0)  # one picture: the frame repeated
    p, m, T = cfg.patch, cfg.merge, cfg.temporal
    gh, gw = rh // p, rw // p
    x = frames.reshape(1, T, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * T * p * p)), (1, gh, gw)


def _windows(grid: tuple[int, int, int], cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(merged-token order, window of each token in that order) for one picture (get_window_index's layout)."""
    t, h, w = grid
    lh, lw, size = h // cfg.merge, w // cfg.merge, cfg.window // cfg.merge // cfg.patch
    index = np.arange(t * lh * lw).reshape(t, lh, lw)
    ph, pw = size - lh % size, size - lw % size
    nh, nw = (lh + ph) // size, (lw + pw) // size
    padded = np.pad(index, ((0, 0), (0, ph), (0, pw)), constant_values=-100)
    padded = padded.reshape(t, nh, size, nw, size).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, size * size)
    window = np.repeat(np.arange(t * nh * nw)[:, None], size * size, axis=1)
    keep = padded != -100
    return padded[keep], window[keep]


def _positions(grid: tuple[int, int, int], merge: int) -> np.ndarray:
    """(row, column) of each patch in the processor's order (rot_pos_emb's pos_ids)."""
    t, h, w = grid
    rows = np.broadcast_to(np.arange(h)[:, None], (h, w))
    cols = np.broadcast_to(np.arange(w)[None, :], (h, w))

    def merged(a: np.ndarray) -> np.ndarray:
        return a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)

    return np.tile(np.stack([merged(rows), merged(cols)], axis=-1), (t, 1))


def vision_feeds(pictures: list[tuple[np.ndarray, tuple[int, int, int]]], cfg: VisionConfig) -> dict[str, np.ndarray]:
    """(patches, grid) per picture -> the vision tower inputs of the exported text encoder."""
    unit = cfg.merge * cfg.merge
    patches, positions, windows, images, order = [], [], [], [], []
    merged = window_base = 0
    for i, (x, grid) in enumerate(pictures):
        index, window = _windows(grid, cfg)
        n = len(index)
        patches.append(x.reshape(n, unit, -1)[index].reshape(n * unit, -1))
        positions.append(_positions(grid, cfg.merge).reshape(n, unit, 2)[index].reshape(n * unit, 2))
        windows.append(np.repeat(window + window_base, unit))
        images.append(np.full(n * unit, i))
        order.append(index + merged)
        merged, window_base = merged + n, window_base + int(window.max()) + 1
    window_order = np.concatenate(order)
    return {"pixel_values": np.concatenate(patches).astype(np.float32),
            "vision_position_ids": np.concatenate(positions).astype(np.int64),
            "vision_window_ids": np.concatenate(windows).astype(np.int64),
            "vision_image_ids": np.concatenate(images).astype(np.int64),
            "vision_merge_order": np.argsort(window_order, kind="stable").astype(np.int64)}


def rope_positions(ids: np.ndarray, mask: np.ndarray, grids: list[tuple[int, int, int]], image_token: int,
                   vision_start: int, merge: int) -> np.ndarray:
    """Qwen2.5-VL's get_rope_index for prompts holding pictures (grids in order across the batch): [3, B, L]."""
    out = np.ones((3, *ids.shape), np.int64)
    image = 0
    for b in range(ids.shape[0]):
        keep = mask[b].astype(bool)
        tokens = ids[b][keep].tolist()
        starts = [i for i, tok in enumerate(tokens[:-1]) if tok == vision_start and tokens[i + 1] == image_token]
        parts, st = [], 0

        def next_start() -> int:
            return int(parts[-1].max()) + 1 if parts else 0

        for _ in starts:
            ed = tokens.index(image_token, st)
            t, h, w = grids[image]
            image += 1
            h, w = h // merge, w // merge
            base = next_start()
            parts.append(np.broadcast_to(np.arange(ed - st), (3, ed - st)) + base)
            grid = np.stack([np.zeros(t * h * w, np.int64),
                             np.broadcast_to(np.arange(h)[None, :, None], (t, h, w)).reshape(-1),
                             np.broadcast_to(np.arange(w)[None, None, :], (t, h, w)).reshape(-1)])
            parts.append(grid + (ed - st) + base)
            st = ed + t * h * w
        if st < len(tokens):
            base = next_start()
            parts.append(np.broadcast_to(np.arange(len(tokens) - st), (3, len(tokens) - st)) + base)
        out[:, b, keep] = np.concatenate(parts, axis=1)
    return out
