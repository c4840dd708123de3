"""ControlNet for Z-Image: diffusers' `ZImageControlNetModel` and where its hints join the Z-Image
transformer graph.

The net is not standalone: `ZImageControlNetModel.from_transformer` lends it the transformer's timestep and
patch embedders, pad tokens, rotary table and both refiners, so exporting it needs the folder's diffusers
transformer weights beside the net's own (record `shares_backbone`). ZImageControlNetPipeline encodes the
control picture with the VAE (mode), shifts and scales it like the latents and zero-pads its channels to
the net's control_in_dim (the 2.0 nets); the net runs on the whole [cond; uncond] batch. It recomputes the
transformer's embedded image tokens and refined caption (its own control refiner may add hints into that
noise refiner), then its control layers walk the unified [image, caption] sequence beside it and return
one hint per entry of control_layers_places, over the whole unified sequence (caption tokens included):
`ZImageTransformer2DModel.forward` adds hint k to `unified` after main layer control_layers_places[k].
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import UserError
from .base import ComponentSpec, TensorSpec
from .control import COND, ControlNetSupport, transformer_net_spec

CLASS = "ZImageControlNetModel"
SEQ_MULTIPLE = 32  # the transformer pads its image tokens to a multiple of this
REFINER_MODES = (None, "control_layers", "control_noise_refiner")


def hint_name(k: int) -> str:
    return f"controlnet_block_sample_{k}"


def _ints(config: dict, key: str) -> list[int]:
    value = config.get(key)
    if value is None:
        return []
    try:
        if not isinstance(value, (list, tuple)):
            raise TypeError
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise UserError(f"the ControlNet's {key} must be a list of layer indices, got {value!r}") from None


def check_zimage_controlnet(config: dict, transformer: dict, family: str) -> dict:
    where = "the ControlNet"
    if config.get("_class_name") != CLASS:
        raise UserError(f"{where} is {config.get('_class_name')!r}; a {family} folder takes a diffusers {CLASS}")
    for key, default in (("dim", 3840), ("n_heads", 30), ("n_refiner_layers", 2), ("qk_norm", True),
                         ("norm_eps", 1e-5)):
        if config.get(key, default) != transformer.get(key, default):
            raise UserError(f"{where}'s {key} {config.get(key, default)!r} is not the folder's transformer's "
                            f"{transformer.get(key, default)!r} (a ControlNet of another model size)")
    if list(config.get("all_patch_size", [2])) != [2] or list(config.get("all_f_patch_size", [1])) != [1]:
        raise UserError(f"{where}'s patch sizes {config.get('all_patch_size')}/{config.get('all_f_patch_size')} are "
                        "not supported (2x2 patches, one frame)")
    layers = int(transformer.get("n_layers", 30))
    places = _ints(config, "control_layers_places")
    if not places or 0 not in places or len(set(places)) != len(places) or not all(0 <= p < layers for p in places):
        raise UserError(f"{where}'s control_layers_places {places} must name distinct main layers of the folder's "
                        f"transformer (0..{layers - 1}), layer 0 among them")
    mode = config.get("add_control_noise_refiner")
    if mode not in REFINER_MODES:
        raise UserError(f"{where}'s add_control_noise_refiner {mode!r} is not one of {list(REFINER_MODES)}")
    refiners = int(transformer.get("n_refiner_layers", 2))
    refiner_places = _ints(config, "control_refiner_layers_places") if mode else []
    hints = len(places) if mode == "control_layers" else refiners
    if mode and (not refiner_places or len(refiner_places) > hints
                 or not all(0 <= p < refiners for p in refiner_places)):
        raise UserError(f"{where}'s control_refiner_layers_places {refiner_places} must name 1 to {hints} noise "
                        f"refiner layers (0..{refiners - 1})")
    latent = int(transformer.get("in_channels", 16))
    cin = config.get("control_in_dim")
    if not isinstance(cin, int) or cin < latent:
        raise UserError(f"{where}'s control_in_dim {cin!r} must be at least the transformer's {latent} latent channels")
    return {"family": family, "class": CLASS, "condition": "latents", "places": places, "width": int(config["dim"]),
            "latent_channels": latent, "control_in_dim": cin, "backbone_layers": layers,
            # room for ZImageControlNetInpaintPipeline's context: control latents, the keep mask, the kept latents
            "inpaint": cin >= 2 * latent + 1,
            # the net reads the transformer's embedders and refiners: export needs its diffusers weights
            "shares_backbone": True}


def zimage_residuals(record: dict, latent: tuple[int, ...] | None = None) -> list[tuple[str, tuple]]:
    """One hint per control place over the unified sequence: symbolic, or concrete for (batch, latent height,
    latent width, caption tokens) -- the image tokens padded to 32, then the (already padded) caption."""
    width = int(record["width"])
    if latent is None:
        dims: tuple = ("batch_size", "unified_sequence_length", width)
    else:
        b, h, w, text = (*latent, 0)[:4]
        tokens = (h // 2) * (w // 2)
        dims = (b, tokens + (-tokens) % SEQ_MULTIPLE + int(text), width)
    return [(hint_name(k), dims) for k in range(len(record["places"]))]


def zimage_controlnet_spec(conditioning: tuple[TensorSpec, ...], record: dict) -> ComponentSpec:
    """The transformer's inputs, the control context (B, control_in_dim, h, w) and the scale -> the hints."""
    sample = ("batch_size", int(record["latent_channels"]), "height_latent", "width_latent")
    spec = transformer_net_spec(sample, conditioning, zimage_residuals(record))
    context = TensorSpec(COND, "float32", ("batch_size", int(record["control_in_dim"]), "height_latent", "width_latent"))
    return replace(spec, inputs=tuple(context if t.name == COND else t for t in spec.inputs))


def zimage_joins(nodes, record: dict) -> list[tuple[str, str, int, bool]]:
    """The unified hidden states main layer p hands on (p a control place), for every reader: of the edges from
    inside /model/layers.p/ read outside it (the shared rotary angles are read there too), the one made last,
    the layer's closing residual Add (behind a quantized graph's Q/DQ pair, the float edge before it)."""
    produced = {o: (i, n) for i, n in enumerate(nodes) for o in n.output}
    readers: dict[str, tuple[str, int]] = {}
    for n in nodes:
        for j, x in enumerate(n.input):
            readers.setdefault(x, (n.name, j))
    joins = []
    for k, p in enumerate(record["places"]):
        inside = f"/model/layers.{p}/"
        out = [x for n in nodes if not n.name.startswith(inside) for x in n.input
               if x in produced and produced[x][1].name.startswith(inside)]
        if not out:
            raise UserError(f"the transformer graph has no edge out of {inside} (not a torch-exported diffusers Z-Image "
                            "transformer, or another layer count)")
        edge = max(out, key=lambda x: produced[x][0])
        while produced[edge][1].op_type in ("QuantizeLinear", "DequantizeLinear"):
            edge = produced[edge][1].input[0]
        joins.append((hint_name(k), *readers[edge], True))
    return joins


def zimage_control_latents(info: dict, record: dict, latents, inpaint=None):
    """The control context (B, control_in_dim, h, w): the picture's scaled VAE latents, with `inpaint` (the keep
    mask (B, 1, h, w), the kept picture's latents) after them as ZImageControlNetInpaintPipeline joins them, then
    zeros up to control_in_dim (ZImageControlNetPipeline's padding for the 2.0 nets)."""
    import numpy as np

    parts = [latents, *(inpaint or ())]
    have = sum(p.shape[1] for p in parts)
    pad = np.zeros((latents.shape[0], int(record["control_in_dim"]) - have, *latents.shape[2:]), np.float32)
    return np.concatenate([*parts, pad], axis=1)


SUPPORT = ControlNetSupport(
    record=lambda config, transformer, info, family: check_zimage_controlnet(config, transformer, family),
    spec=zimage_controlnet_spec, residuals=zimage_residuals, joins=zimage_joins, latents=zimage_control_latents)
