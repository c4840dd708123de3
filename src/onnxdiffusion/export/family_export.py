"""The torch side of each model family: the module wrapped for export and the feeds export validates
with. These are export's (they import torch and export's own wrappers); families/ holds only what the
run time needs, and imports nothing from export/. Families without an entry here take the defaults."""

from __future__ import annotations

import numpy as np

from ..families import latents as lat
from ..families.base import ComponentSpec, Family
from ..families.flux import GUIDANCE, Flux
from ..families.flux2 import IMG_IDS as FLUX2_IMG_IDS
from ..families.flux2 import REF_IDS as FLUX2_REF_IDS
from ..families.flux2 import Flux2Base, Flux2Dev, Flux2Klein, image_ids_4d
from ..families.flux import IMG_IDS as FLUX_IMG_IDS
from ..families.flux_kontext import REF_IDS, REFERENCE_FRAME, FluxKontext
from ..families.qwenimage import IMG_IDS as QWEN_IMG_IDS
from ..families.qwenimage import MASK, QwenImage
from ..families.zimage import ZImage


def wrap(family: Family, spec: ComponentSpec, module):
    """The torch module whose forward takes the spec's inputs in order."""
    hook = _WRAPS.get(type(family))
    return hook(family, spec, module) if hook is not None else _default_wrap(spec, module)


def export_feeds(family: Family, spec: ComponentSpec, dims: dict[str, int], gen, vocab: int) -> dict:
    """Torch feeds for export validation (random by default; ids and masks need real values)."""
    from .dummies import dummy_feeds

    feeds = dummy_feeds(spec, dims, gen, vocab)
    hook = _FEEDS.get(type(family))
    return hook(family, spec, dims, feeds) if hook is not None else feeds


def _default_wrap(spec: ComponentSpec, module):
    from .wrappers import wrap as plain

    return plain(spec, module)


def _flux_wrap(family: Flux, spec: ComponentSpec, module):
    if spec.kind != family.backbone_kind:
        return _default_wrap(spec, module)
    from .fixups import decompose_rms_norms
    from .flow_components import FluxTransformer

    decompose_rms_norms(module)
    if isinstance(family, FluxKontext):
        from .flow_components import FluxKontextTransformer

        return FluxKontextTransformer(module)
    return FluxTransformer(module)


def _flux_feeds(family: Flux, spec: ComponentSpec, dims: dict[str, int], feeds: dict) -> dict:
    if FLUX_IMG_IDS in feeds:
        import torch

        ids = lat.image_ids(dims["rows"], dims["cols"], centred=False)
        feeds[FLUX_IMG_IDS] = torch.from_numpy(np.repeat(ids[None], dims["batch_size"], axis=0))
    if GUIDANCE in feeds:
        feeds[GUIDANCE] = feeds[GUIDANCE].abs() * 3
    if REF_IDS in feeds:  # Kontext: the reference grid's ids, frame 1
        import torch

        ids = lat.image_ids(dims["reference_rows"], dims["reference_cols"], frame=REFERENCE_FRAME)
        feeds[REF_IDS] = torch.from_numpy(np.repeat(ids[None], dims["batch_size"], axis=0))
    return feeds


def _qwen_wrap(family: QwenImage, spec: ComponentSpec, module):
    from .fixups import decompose_rms_norms, exact_nearest_upsamples
    from .flow_components import QwenImageTransformer

    if spec.kind == family.backbone_kind:
        decompose_rms_norms(module)
        return QwenImageTransformer(module)
    if spec.kind == "vae_decoder":
        exact_nearest_upsamples(module)
    return _default_wrap(spec, module)


def _qwen_feeds(family: QwenImage, spec: ComponentSpec, dims: dict[str, int], feeds: dict) -> dict:
    import torch

    b, s = dims["batch_size"], dims.get("sequence_length", 0)
    mask = torch.ones(b, s, dtype=torch.int64)
    if b > 1:
        mask[-1, s - 3:] = 0  # a padded row: the mask must matter
    if "attention_mask" in feeds:
        feeds["attention_mask"] = mask
    if MASK in feeds:
        feeds[MASK] = mask.to(torch.float32)
    if QWEN_IMG_IDS in feeds:
        ids = lat.image_ids(dims["rows"], dims["cols"], centred=True)
        feeds[QWEN_IMG_IDS] = torch.from_numpy(np.repeat(ids[None], b, axis=0))
    return feeds


def _flux2_wrap(family: Flux2Base, spec: ComponentSpec, module):
    from .fixups import decompose_rms_norms
    from .flux2_components import Flux2Transformer

    if spec.kind == family.backbone_kind:
        decompose_rms_norms(module)
        return Flux2Transformer(module)
    return _default_wrap(spec, module)


def _flux2_feeds(family: Flux2Base, spec: ComponentSpec, dims: dict[str, int], feeds: dict) -> dict:
    import torch

    b, s = dims["batch_size"], dims.get("sequence_length", 0)
    if "attention_mask" in feeds:
        mask = torch.ones(b, s, dtype=torch.int64)
        if b > 1:
            mask[-1, s - 3:] = 0  # a padded row: the mask must matter
        feeds["attention_mask"] = mask
    if FLUX2_IMG_IDS in feeds:
        feeds[FLUX2_IMG_IDS] = torch.from_numpy(np.repeat(image_ids_4d(dims["rows"], dims["cols"])[None], b, axis=0))
    if FLUX2_REF_IDS in feeds:
        ids = [image_ids_4d(r, c, time=10 * (i + 1)) for i, (r, c) in enumerate(dims["reference_grids"])]
        feeds[FLUX2_REF_IDS] = torch.from_numpy(np.repeat(np.concatenate(ids)[None], b, axis=0))
    if GUIDANCE in feeds:
        feeds[GUIDANCE] = feeds[GUIDANCE].abs() * 3
    return feeds


def source_settings(family: Family, src, model_index: dict) -> dict:
    """Pipeline settings a family reads from the source's weights or tokenizer rather than its JSON configs."""
    hook = _SETTINGS.get(type(family))
    return hook(family, src, model_index) if hook is not None else {}


def _flux2_settings(family: Flux2Base, src, model_index: dict) -> dict:
    from .flux2_prompt import prompt_template, vae_batch_norm

    return {**vae_batch_norm(src / "vae"), "prompt_template": prompt_template(family, src / "tokenizer"),
            "is_distilled": bool(model_index.get("is_distilled", False))}


def _zimage_wrap(family: ZImage, spec: ComponentSpec, module):
    if spec.kind != family.backbone_kind:
        return _default_wrap(spec, module)
    from .fixups import decompose_diffusers_rms_norms, decompose_rms_norms
    from .zimage_transformer import ZImageTransformer

    decompose_rms_norms(module)
    decompose_diffusers_rms_norms(module)
    return ZImageTransformer(module)


def _zimage_feeds(family: ZImage, spec: ComponentSpec, dims: dict[str, int], feeds: dict) -> dict:
    """Text: a right-padded row beside a full one. Transformer: caption rows of different kept lengths, one
    needing its own pad tokens and one shorter than the batch's padded length (masked raggedness)."""
    import torch

    b, s = dims["batch_size"], dims["sequence_length"]
    if "attention_mask" in feeds:
        feeds["attention_mask"] = _qwen_feeds(family, spec, dims, {"attention_mask": None})["attention_mask"]
    if MASK in feeds:
        kept = [s - 9, s // 2 - 5][:b]
        feeds[MASK] = (torch.arange(s)[None] < torch.tensor(kept)[:, None]).to(torch.float32)
    return feeds


_WRAPS = {Flux: _flux_wrap, FluxKontext: _flux_wrap, QwenImage: _qwen_wrap, ZImage: _zimage_wrap,
          Flux2Klein: _flux2_wrap, Flux2Dev: _flux2_wrap}
_FEEDS = {Flux: _flux_feeds, FluxKontext: _flux_feeds, QwenImage: _qwen_feeds, ZImage: _zimage_feeds,
          Flux2Klein: _flux2_feeds, Flux2Dev: _flux2_feeds}
_SETTINGS = {Flux2Klein: _flux2_settings, Flux2Dev: _flux2_settings}
