"""`<lora:NAME:WEIGHT>` in a prompt: the convention AUTOMATIC1111's web UI and stable-diffusion.cpp read.

Every client that speaks A1111's API (Open WebUI, SillyTavern, Krita's plugin ...) names adapters this way,
inside the text. The tags are taken out before the text encoder sees the prompt (they are not words), and the
text left is tidied the way a person wrote it: `a red circle <lora:style:0.8>` encodes as `a red circle`, the
same tokens as the prompt written without the tag. WEIGHT is optional (1). A1111's separate text-encoder and
UNet weights (`<lora:NAME:TE:UNET>`) are refused: an adapter here has one scale.
"""

from __future__ import annotations

import re

from ..errors import UserError

_TAG = re.compile(r"<lora:([^<>]*)>", re.IGNORECASE)
_SPACE = re.compile(r"\s+")
_ORPHAN_COMMA = re.compile(r"\s*,(\s*,)+")  # "a, <lora:x>, b" leaves "a, , b"


class LoraTagError(UserError):
    """A malformed `<lora:...>` tag in a prompt (serve answers it as a 400 on `prompt`)."""


def split_tags(prompt: str) -> tuple[str, list[tuple[str, float]]]:
    """(the prompt without its `<lora:...>` tags, [(name, weight), ...] in order). A prompt without tags comes back
    as it is, character for character."""
    from .feeds import SCALE_RANGE

    found: list[tuple[str, float]] = []
    for match in _TAG.finditer(prompt):
        parts = match.group(1).split(":")
        name = parts[0].strip()
        shown = match.group(0) if len(match.group(0)) <= 80 else match.group(0)[:79] + "…"
        if not name:
            raise LoraTagError(f"prompt: {shown} names no adapter; write <lora:NAME:WEIGHT>")
        if len(parts) > 2:
            raise LoraTagError(f"prompt: {shown}: one weight per adapter (<lora:NAME:WEIGHT>); separate text-encoder "
                               "and UNet weights are not supported")
        weight = 1.0
        if len(parts) == 2 and parts[1].strip():
            try:
                weight = float(parts[1])
            except ValueError:
                raise LoraTagError(f"prompt: {shown}: the weight must be a number") from None
        if not SCALE_RANGE[0] <= weight <= SCALE_RANGE[1]:  # NaN fails too
            raise LoraTagError(f"prompt: {shown}: the weight must be in [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}]")
        if any(name == n for n, _ in found):
            raise LoraTagError(f"prompt: adapter {name!r} is tagged twice; give it once with one weight")
        found.append((name, weight))
    if not found:
        return prompt, []
    text = _ORPHAN_COMMA.sub(",", _TAG.sub(" ", prompt))
    text = _SPACE.sub(" ", text).strip().strip(",").strip()
    return text, found


def tagged_files(tagged: list[tuple[str, float]], lora_dir) -> list[tuple[str, float]]:
    """`generate`'s tags as (FILE, weight): NAME is NAME.safetensors in `lora_dir` (default: the shipped adapters,
    models/loras)."""
    from pathlib import Path

    from ..folder.paths import models_root

    folder = Path(lora_dir) if lora_dir is not None else models_root() / "loras"
    out = []
    for name, weight in tagged:
        path = folder / f"{name}.safetensors"
        if "/" in name or "\\" in name or name.startswith(".") or not path.is_file():
            have = sorted(p.stem for p in folder.glob("*.safetensors")) if folder.is_dir() else []
            raise LoraTagError(f"prompt: <lora:{name}> names no adapter in {folder} (it has: {', '.join(have) or 'none'}; "
                               "--lora-dir DIR names the folder)")
        out.append((str(path), weight))
    return out
