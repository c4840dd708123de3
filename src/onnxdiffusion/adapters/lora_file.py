"""LoRA files -> per component, per module (down, up, scale), with numpy alone.

Read here: the diffusers/peft layout `save_lora_weights` writes (`<component>.<module>.lora_A.weight`
/ `lora_B.weight`, optional `lora_adapter_metadata` with r / lora_alpha / rank_pattern /
alpha_pattern / use_rslora per component), the older diffusers layout (`.lora.down.weight` /
`.lora.up.weight`, `.lora_linear_layer.down/up`, optional `.alpha`), and the file `lora convert`
writes (scales folded in). The kohya/A1111 layout (`lora_unet_...`, `lora_te_...`) needs diffusers'
converters, so it is converted once on the export side (adapters/convert.py).

The scale rules follow diffusers' (utils/peft_utils.get_peft_kwargs): without alphas or metadata
lora_alpha is the component's most common rank, so a module of another rank gets that rank / its own.
"""

from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from . import safetensors_io

FORMAT = "onnxdiffusion-lora"  # __metadata__["format"] of a converted file
_PAIRS = ((".lora_A.weight", ".lora_B.weight"), (".lora.down.weight", ".lora.up.weight"),
          (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"))
KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "lora_transformer_")


@dataclass
class Layer:
    down: np.ndarray  # peft lora_A weight: [r, in] (linear) or [r, in, kh, kw] (conv)
    up: np.ndarray  # peft lora_B weight: [out, r] or [out, r, 1, 1]
    scale: float  # alpha / r (diffusers' rules), before the user's weight

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


LoraLayers = dict[str, dict[str, Layer]]  # component -> module -> layer


def is_kohya(keys) -> bool:
    return any(k.startswith(KOHYA_PREFIXES) for k in keys)


def _pattern_value(pattern: dict, module: str, default):
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _number(path: Path, where: str, value, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) \
            or (positive and value <= 0):
        raise UserError(f"{path}: lora_adapter_metadata {where} must be a {'positive ' if positive else ''}number, "
                        f"got {str(value)[:60]!r}")
    return float(value)


def _metadata_scale(path: Path, config: dict, comp: str, module: str, r: int) -> float:
    """alpha / r (or / sqrt(r) with rsLoRA) from peft's per-component config, every field checked."""
    patterns = {}
    for kind in ("alpha_pattern", "rank_pattern"):
        pattern = config.get(f"{comp}.{kind}") or {}
        if not isinstance(pattern, dict):
            raise UserError(f"{path}: lora_adapter_metadata {comp}.{kind} must be an object")
        for key in pattern:
            try:
                re.compile(key)
            except re.error as e:
                raise UserError(f"{path}: lora_adapter_metadata {comp}.{kind}: {key[:60]!r} is not a pattern ({e})") from None
        patterns[kind] = pattern
    alpha = _number(path, f"{comp}.lora_alpha", _pattern_value(patterns["alpha_pattern"], module,
                                                               config.get(f"{comp}.lora_alpha", r)), positive=False)
    rank = _number(path, f"{comp}.r", _pattern_value(patterns["rank_pattern"], module, config.get(f"{comp}.r", r)))
    rslora = config.get(f"{comp}.use_rslora", False)
    if not isinstance(rslora, bool):
        raise UserError(f"{path}: lora_adapter_metadata {comp}.use_rslora must be true or false")
    return alpha / (float(np.sqrt(rank)) if rslora else rank)


def _split(path: Path, tensors: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """{(component, module): (down, up)} and {(component, module): alpha} from the key layout."""
    pairs: dict[tuple[str, str], list] = {}
    alphas: dict[tuple[str, str], float] = {}
    for key, value in tensors.items():
        if key.endswith(".alpha"):
            comp, _, module = key[:-len(".alpha")].partition(".")
            flat = np.asarray(value, np.float64).reshape(-1)
            if flat.size != 1 or not np.isfinite(flat[0]):
                raise UserError(f"{path}: key {key!r}: an alpha is one finite number, got {flat.size} value(s)"
                                + ("" if flat.size != 1 else f" ({flat[0]})"))
            alphas[(comp, module)] = float(flat[0])
            continue
        for i, (a, b) in enumerate(_PAIRS):
            for j, suffix in enumerate((a, b)):
                if key.endswith(suffix):
                    comp, _, module = key[:-len(suffix)].partition(".")
                    if not module:
                        raise UserError(f"{path}: key {key!r} names no component (want e.g. unet.<module>{suffix})")
                    pairs.setdefault((comp, module), [None, None])[j] = value
                    break
            else:
                continue
            break
        else:
            if key.endswith((".lora_B.bias", "lora_magnitude_vector", ".dora_scale")):
                raise UserError(f"{path}: key {key!r}: LoRA biases and DoRA are not supported")
            raise UserError(f"{path}: unknown key {key!r} (not a diffusers/peft or kohya LoRA key)")
    for (comp, module), (down, up) in pairs.items():
        if down is None or up is None:
            raise UserError(f"{path}: {comp}.{module} has only one of its two LoRA matrices")
    return pairs, alphas


def read_lora(path: Path | str) -> LoraLayers:
    """Every layer of one LoRA file, scale (alpha / r) attached; one line naming the file and key on bad input."""
    path = Path(path)
    if path.suffix.lower() in (".ckpt", ".pt", ".pth", ".bin", ".pkl"):
        raise UserError(f"{path}: a pickle file; LoRAs are read from .safetensors only (pickle can run code)")
    tensors, meta = safetensors_io.read(path)
    return layers_from_tensors(path, tensors, meta)


def layers_from_tensors(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, str]) -> LoraLayers:
    """read_lora's parse of keys and scales, on tensors already in memory (convert.py hands diffusers' output)."""
    if not tensors:
        raise UserError(f"{path}: holds no tensors")
    if is_kohya(tensors):
        raise UserError(f"{path}: a kohya/A1111 LoRA (key {next(k for k in tensors if k.startswith(KOHYA_PREFIXES))!r}); "
                        f"convert it once with `onnxdiffusion lora convert {path.name} OUT.safetensors --model MODEL`")
    pairs, alphas = _split(path, tensors)
    folded = meta.get("format") == FORMAT
    try:
        config = json.loads(meta["lora_adapter_metadata"]) if "lora_adapter_metadata" in meta else {}
    except ValueError:
        raise UserError(f"{path}: lora_adapter_metadata is not valid JSON") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: lora_adapter_metadata is not a JSON object")
    ranks: dict[str, list[int]] = collections.defaultdict(list)
    for (comp, _), (down, _) in pairs.items():
        ranks[comp].append(int(down.shape[0]))
    out: LoraLayers = {}
    for (comp, module), (down, up) in pairs.items():
        down, up = np.asarray(down, np.float32), np.asarray(up, np.float32)
        r = int(down.shape[0])
        if down.ndim not in (2, 4) or up.ndim != down.ndim or int(up.shape[1]) != r:
            raise UserError(f"{path}: {comp}.{module}: lora_A {list(down.shape)} and lora_B {list(up.shape)} "
                            f"do not make a rank-r pair")
        if folded:
            scale = 1.0
        elif f"{comp}.r" in config:
            scale = _metadata_scale(path, config, comp, module, r)
        elif (comp, module) in alphas:
            scale = alphas[(comp, module)] / r
        else:  # diffusers: lora_alpha = the most common rank of the component
            scale = collections.Counter(ranks[comp]).most_common(1)[0][0] / r
        out.setdefault(comp, {})[module] = Layer(down, up, float(scale))
    return out
