"""Several LoRAs at once -> the A/B feeds of each component's insertion points.

Ranks are concatenated and each LoRA's scale (its alpha / r times the user's weight) is folded
into its B block, so one pair of inputs per layer carries any number of adapters:
  x A B = sum_i w_i s_i (x down_i^T) up_i^T   with A = [down_1^T | down_2^T ...], B = [w_1 s_1 up_1^T; ...]
Every check runs before any model does and names the file and the key.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..folder.manifest import Manifest
from .lora_file import Layer, read_lora
from .points import A_SUFFIX, B_SUFFIX, Target, targets_from_manifest

SCALE_RANGE = (-4.0, 4.0)


@dataclass
class AdapterFeeds:
    """component -> {input name: array}; `key` identifies the adapter set (same files, same scales); `merged`:
    the merged weights a fused backbone computed for this set (adapters/fused.py), kept as long as the set is."""

    feeds: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    key: tuple = ()
    merged: dict = field(default_factory=dict, compare=False, repr=False)

    def for_component(self, name: str) -> dict[str, np.ndarray]:
        return self.feeds.get(name, {})

    def __bool__(self) -> bool:
        return any(self.feeds.values())


def parse_lora_arg(arg: str) -> tuple[str, float]:
    """'FILE[:SCALE]' (the CLI's --lora) -> (path, scale); a Windows drive letter is not a scale."""
    path, sep, tail = arg.rpartition(":")
    if sep and path and "/" not in tail and "\\" not in tail:
        try:
            return path, float(tail)
        except ValueError:
            raise UserError(f"--lora {arg!r}: the scale after ':' must be a number") from None
    return arg, 1.0


def check_scale(path, scale) -> float:
    # compared before any conversion: math.isfinite(10**400) raises OverflowError; NaN fails the comparison
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
        raise UserError(f"{path}: LoRA scale must be a number in [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}], got {repr(scale)[:40]}")
    return float(scale)


def normalize(loras) -> list[tuple[Path, float]]:
    """loras=[(path, scale), ...] | [path, ...] | 'FILE[:SCALE]' -> [(Path, scale)], scales checked."""
    if loras is None:
        return []
    if isinstance(loras, (str, Path)):
        loras = [loras]
    out = []
    for item in loras:
        if isinstance(item, (str, Path)):
            path, scale = parse_lora_arg(str(item)) if isinstance(item, str) else (item, 1.0)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            path, scale = item
        else:
            raise UserError(f"loras: each item must be a path or (path, scale), got {item!r}")
        out.append((Path(path), check_scale(path, scale)))
    return out


class LoraCache:
    """Parsed LoRA files by (path, size, mtime), LRU-bounded: a server switching adapters per request
    reads each file once."""

    def __init__(self, size: int = 16):
        self.size = size
        self._items: OrderedDict[tuple, dict] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: Path):
        try:
            st = os.stat(path)
        except OSError as e:
            raise UserError(f"cannot read LoRA {path}: {e.strerror}") from None
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        layers = read_lora(path)
        with self._lock:
            self._items[key] = layers
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return layers


def _oriented(path: Path, comp: str, module: str, layer: Layer, t: Target) -> tuple[np.ndarray, np.ndarray]:
    """(down, up) reshaped to the target's kind, shapes checked against the model's layer."""
    down, up = layer.down, layer.up
    if t.op == "conv" and down.ndim == 2 and t.kernel == (1, 1):  # a Linear LoRA on a 1x1 conv
        down, up = down[:, :, None, None], up[:, :, None, None]
    if t.op == "linear" and down.ndim == 4 and down.shape[2:] == (1, 1) and up.shape[2:] == (1, 1):
        down, up = down[:, :, 0, 0], up[:, :, 0, 0]
    r = layer.rank
    want_down = (r, t.in_features, *t.kernel) if t.op == "conv" else (r, t.in_features)
    want_up = (t.out_features, r, 1, 1) if t.op == "conv" else (t.out_features, r)
    if tuple(down.shape) != want_down or tuple(up.shape) != want_up:
        raise UserError(f"{path}: {comp}.{module}: LoRA shapes {list(layer.down.shape)} / {list(layer.up.shape)} do not fit "
                        f"the model's layer ({t.op} {t.in_features} -> {t.out_features}): a LoRA for another model?")
    return down, up


def _pattern(module: str) -> tuple[str, int | None]:
    """'text_model.encoder.layers.11.mlp.fc1' -> ('text_model.encoder.layers.#.mlp.fc1', 11)."""
    m = re.search(r"\.(\d+)\.", module)
    if m is None:
        return module, None
    return module[:m.start()] + ".#." + module[m.end():], int(m.group(1))


def _graph_tails(targets: dict[str, Target]) -> dict[str, int]:
    """Per layer pattern, the highest first index among the graph's points."""
    tails: dict[str, int] = {}
    for module in targets:
        pattern, i = _pattern(module)
        if i is not None:
            tails[pattern] = max(i, tails.get(pattern, -1))
    return tails


def _pruned(module: str, tails: dict[str, int]) -> bool:
    pattern, i = _pattern(module)
    return i is not None and pattern in tails and i > tails[pattern]


def build_feeds(manifest: Manifest, loras, cache: LoraCache | None = None) -> AdapterFeeds:
    """The feeds of every component for `loras` ([(path, scale), ...]); empty for none."""
    items = normalize(loras)
    if not items:
        return AdapterFeeds()
    targets = {name: targets_from_manifest(entry) for name, entry in manifest.components.items() if entry.lora}
    if not targets:
        raise UserError("this model folder has no LoRA insertion points: make a copy with them once "
                        "(`onnxdiffusion lora points MODEL OUT`) or fuse the LoRA at export (`export --lora`)")
    cache = cache or LoraCache()
    blocks: dict[str, dict[str, list]] = {}  # component -> module -> [(down, scaled up)]
    for path, weight in items:
        for comp, layers in cache.get(path).items():
            if comp not in targets:
                have = ", ".join(sorted(targets))
                raise UserError(f"{path}: key {comp}.{next(iter(layers))}: this model has no component {comp!r} "
                                f"with insertion points (have {have})")
            tail = _graph_tails(targets[comp])
            for module, layer in layers.items():
                t = targets[comp].get(module)
                if t is None and _pruned(module, tail):
                    continue  # a layer past the last one the graph computes (SDXL reads a penultimate state): no effect
                if t is None:
                    raise UserError(f"{path}: unknown key {comp}.{module}: the model's {comp} has no such layer "
                                    f"with an insertion point (a LoRA for another model?)")
                down, up = _oriented(path, comp, module, layer, t)
                blocks.setdefault(comp, {}).setdefault(module, []).append((down, up * np.float32(weight * layer.scale)))
    feeds: dict[str, dict[str, np.ndarray]] = {}
    for comp, modules in blocks.items():
        out = feeds.setdefault(comp, {})
        for module, pairs in modules.items():
            if targets[comp][module].op == "linear":
                a = np.concatenate([d.T for d, _ in pairs], axis=1)
                b = np.concatenate([u.T for _, u in pairs], axis=0)
            else:
                a = np.concatenate([d for d, _ in pairs], axis=0)
                b = np.concatenate([u for _, u in pairs], axis=1)
            out[module + A_SUFFIX] = np.ascontiguousarray(a, np.float32)
            out[module + B_SUFFIX] = np.ascontiguousarray(b, np.float32)
    key = tuple((str(p.resolve()), w) for p, w in items)
    return AdapterFeeds(feeds, key)
