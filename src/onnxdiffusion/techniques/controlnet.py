"""ControlNet, host side: `pipe(prompt, controlnets=[...])`, diffusers' (Multi)ControlNet pipelines -- the
spec (ControlNetSpec, parsed once: Python objects and the CLI's NAME[:SCALE[:START:END]] alike), the nets'
checks, loading and preparation, and the host loop's model function (ControlHost); its Loop twin is
controlnet_graph.py's ControlLoop, what it cannot combine with is techniques/registry.py's CONFLICTS.

Each step, every active net runs on the backbone's own batch ([uncond; cond] under CFG; the latent batch
for a backbone that embeds the guidance scale; the cond half for a `cond_only` net record, whose samples
both halves take, Qwen-Image's pipeline) with the sample, timestep and conditioning (no guess mode)
and its control image (pixels in [0, 1], or for a latent-conditioned net the picture's VAE latents as the
family shapes them), and the residuals (each net's already scaled by scale x keep, summed over the nets as
MultiControlNetModel does) are fed to the backbone, cut at load time to take them (`residual_session`: an
`Add` on each edge the family names: a UNet's skip edges and mid block output, an MMDiT's block outputs).
keep follows diffusers' control_guidance_start/end: net j is off at step i of N when
i/N < start or (i+1)/N > end. The backbone is never re-exported: an int8 or fp16-stored one is cut as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..families.base import CONTEXT, SAMPLE, TIMESTEP
from ..families.control import COND, SCALE
from ..folder.artifacts import read_json_object
from ..folder.manifest import confined
from ..runtime.control_graph import residual_names
from .host_base import HostTechnique

NAME = "controlnet"


@dataclass(frozen=True)
class ControlNetSpec:
    """One ControlNet of a generation: the folder's net `name`, its control image (an RGB picture, (H, W, 3)
    uint8 or PIL, or a (B, 3, H, W) float array in [0, 1]), its scale and its active share of the steps.
    `inpaint`: (picture, mask; white = repaint) for a net that takes an inpainting context (Z-Image's 2.0
    nets, as ZImageControlNetInpaintPipeline's image and mask_image): it conditions the net only."""
    name: str
    image: object
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    inpaint: object = None


def _number(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(float(v)):
        raise UserError(f"ControlNet {what} must be a finite number, got {v!r}")
    return float(v)


def check_spec(spec: ControlNetSpec) -> ControlNetSpec:
    if not isinstance(spec.name, str) or not spec.name:
        raise UserError(f"ControlNet name must be a non-empty string, got {spec.name!r}")
    scale, start, end = _number(spec.scale, "scale"), _number(spec.start, "start"), _number(spec.end, "end")
    if not 0.0 <= start < end <= 1.0:
        raise UserError(f"ControlNet {spec.name!r}: start and end must satisfy 0 <= start < end <= 1, got {start}, {end}")
    if spec.image is None:
        raise UserError(f"ControlNet {spec.name!r} needs a control image")
    if spec.inpaint is not None and (not isinstance(spec.inpaint, (tuple, list)) or len(spec.inpaint) != 2
                                     or any(v is None for v in spec.inpaint)):
        raise UserError(f"ControlNet {spec.name!r}: inpaint must be (picture, mask)")
    return ControlNetSpec(spec.name, spec.image, scale, start, end, spec.inpaint)


def parse_controls(controlnets) -> list[ControlNetSpec]:
    """ControlNetSpec entries or tuples (name, image[, scale[, start, end]]) -> checked specs."""
    if controlnets is None:
        return []
    if isinstance(controlnets, ControlNetSpec) or (isinstance(controlnets, tuple) and controlnets
                                                   and isinstance(controlnets[0], str)):
        controlnets = [controlnets]  # one net given alone
    if not isinstance(controlnets, (list, tuple)):
        raise UserError(f"controlnets must be a list of ControlNetSpec or tuples, got {type(controlnets).__name__}")
    specs = []
    for c in controlnets:
        if isinstance(c, tuple):
            if not 2 <= len(c) <= 5 or len(c) == 4:
                raise UserError("a ControlNet entry is (name, image), (name, image, scale) or (name, image, scale, start, end)")
            c = ControlNetSpec(*c)
        if not isinstance(c, ControlNetSpec):
            raise UserError(f"controlnets entries must be ControlNetSpec or tuples, got {type(c).__name__}")
        specs.append(check_spec(c))
    return specs


def parse_cli(text: str) -> tuple[str, float, float, float]:
    """`NAME[:SCALE[:START:END]]` -> (name, scale, start, end), checked."""
    name, *rest = str(text).split(":")
    if len(rest) not in (0, 1, 3):
        raise UserError(f"--controlnet {text!r}: expected NAME[:SCALE[:START:END]]")
    try:
        nums = [float(v) for v in rest]
    except ValueError:
        raise UserError(f"--controlnet {text!r}: SCALE, START and END must be numbers") from None
    scale = nums[0] if nums else 1.0
    start, end = (nums[1], nums[2]) if len(nums) == 3 else (0.0, 1.0)
    spec = check_spec(ControlNetSpec(name, "?", scale, start, end))
    return spec.name, spec.scale, spec.start, spec.end


def keep_column(spec: ControlNetSpec, steps: int) -> np.ndarray:
    """(steps,) float32: 1 where the net runs (diffusers: 1 - (i/N < start or (i+1)/N > end))."""
    i = np.arange(steps, dtype=np.float64)
    off = (i / steps < spec.start) | ((i + 1) / steps > spec.end)
    return (1.0 - off).astype(np.float32)


def control_pixels(image, batch: int, height: int, width: int) -> np.ndarray:
    """(batch, 3, H, W) float32 in [0, 1]: a picture resized (Lanczos, with a notice) and scaled as diffusers'
    control image processor does, or a float array of that size used as it is."""
    from ..runtime.image_input import _resized, to_pil

    if isinstance(image, np.ndarray) and image.dtype.kind == "f":
        a = np.asarray(image, np.float32)
        if a.ndim != 4 or a.shape[1] != 3 or a.shape[2:] != (height, width) or a.shape[0] not in (1, batch):
            raise UserError(f"a control image array must be (1 or {batch}, 3, {height}, {width}) in [0, 1], got {a.shape}")
        if not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
            raise UserError("a control image array must hold finite values in [0, 1]")
    else:
        img = _resized(to_pil(image, "the control image").convert("RGB"), height, width, "the control image")
        a = (np.asarray(img, np.float32) / np.float32(255.0)).transpose(2, 0, 1)[None]
    return np.ascontiguousarray(np.repeat(a, batch // a.shape[0], axis=0), np.float32)


def record_of(pipe, name: str) -> dict:
    """The folder's ControlNet `name`, checked against the folder's family and backbone (one line if not)."""
    rec = pipe.manifest.controlnets[name]  # (check_request: it is there)
    if not isinstance(rec, dict) or rec.get("family") != pipe.family.name:
        raise UserError(f"{pipe.folder}: ControlNet {name!r} was exported for family "
                        f"{rec.get('family') if isinstance(rec, dict) else None!r}, the folder is {pipe.family.name!r}")
    config = _json_in(pipe.folder, f"controlnets/{name}/config.json")
    backbone = _json_in(pipe.folder, f"{pipe.family.backbone}/config.json")
    fresh = pipe.family.controlnet_record(config, backbone, pipe.info)  # another family or size: one line
    if residuals_of(pipe.family, fresh) != residuals_of(pipe.family, rec):
        raise UserError(f"{pipe.folder}: ControlNet {name!r}'s manifest record disagrees with its config.json")
    return rec


def residuals_of(family, record: dict, latent=None) -> list:
    """A manifest record's residual (name, dims) pairs; a record that does not describe them: one line."""
    try:
        return [(n, tuple(d)) for n, d in family.control_residuals(record, latent)]
    except (KeyError, TypeError, ValueError):
        raise UserError("a ControlNet's manifest record does not describe its residuals") from None


def _json_in(folder, rel: str) -> dict:
    return read_json_object(confined(folder, rel, "ControlNet config"))


@dataclass
class Prepared:
    """A checked ControlNet of one generation: its spec, manifest record and (batch, 3, H, W) control pixels."""
    spec: ControlNetSpec
    record: dict
    pixels: np.ndarray


def check_request(folder, manifest: dict, options, names: list[str]) -> None:
    """What can be refused from the manifest and options alone (the CLI asks before loading any model)."""
    if options.loop != "host":
        graph = manifest.components.get(f"sampler_{options.loop}")
        compiled = graph.controlnets if graph is not None else ()
        missing = [n for n in names if n not in compiled]
        if missing:
            raise UserError(f"ControlNet {missing[0]!r} is not built into this folder's {options.loop} graph: recompile "
                            f"it with `onnxdiffusion compile-loop --controlnet {missing[0]}` or use --loop host")
    nets = manifest.controlnets or {}
    for name in names:
        if name not in nets:
            have = ", ".join(sorted(nets)) or "none (add one: onnxdiffusion add-controlnet)"
            raise UserError(f"{folder} has no ControlNet {name!r}; it has {have}")


def prepare(pipe, controlnets, options, loras=None) -> list[Prepared]:
    """Everything checked before any model runs; [] without ControlNets."""
    specs = parse_controls(controlnets)
    if not specs:
        return []
    check_request(pipe.folder, pipe.manifest, options, [s.name for s in specs])
    # what ControlNet does not combine with (LoRA, caching, a precision schedule): techniques/registry.py,
    # checked by run_loop.prepare_run before this runs
    if pipe.profile is not None and pipe.profile.profile.io_binding == "device":
        raise UserError("ControlNet runs with host buffers; this profile binds device buffers (io_binding=device)")
    h, w = pipe.image_size(options)
    out = []
    for spec in specs:
        rec = record_of(pipe, spec.name)
        pixels = control_pixels(spec.image, options.batch, h, w)
        if rec.get("condition") == "latents":  # the net takes the picture's VAE latents (SD3's pipeline)
            latents = pipe.encode_pixels(pixels * np.float32(2.0) - np.float32(1.0))
            extra = None if spec.inpaint is None else inpaint_context(pipe, spec.inpaint, options.batch, h, w)
            pixels = np.ascontiguousarray(pipe.family.control_latents(pipe.info, rec, latents, extra), np.float32)
        elif spec.inpaint is not None:
            raise UserError(f"ControlNet {spec.name!r} takes no inpainting context (image and mask)")
        out.append(Prepared(spec, rec, pixels))
    return out


def inpaint_context(pipe, inpaint, batch: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(picture, mask) -> (the keep mask on the latent grid (B, 1, h, w), the VAE latents of the picture with
    the part to repaint set to 0 in [-1, 1]), as ZImageControlNetInpaintPipeline makes them (mask binarized at
    0.5 after the resize, nearest on the latent grid)."""
    from ..runtime.image_input import image_pixels, latent_grid, mask_pixels

    picture, mask = inpaint
    m = mask_pixels(mask, h, w)
    kept = pipe.encode_pixels(np.ascontiguousarray(image_pixels(picture, h, w) * (m < 0.5), np.float32))
    keep = latent_grid(np.float32(1.0) - m, int(pipe.info.vae_scale_factor))
    return np.repeat(keep, batch, axis=0), np.repeat(kept, batch, axis=0)


class ControlledBackbone:
    """model_fn(x, t): the active nets on the backbone's batch, their scaled residuals summed into the
    residual backbone's input buffers, then that backbone (a GuidedBackbone) and guidance."""

    def __init__(self, guided, nets: list[tuple], names: list[str], steps: int):
        self.g, self.names = guided, names
        self.buffers = [guided.conditioning[n] for n in names]  # bound to the session: written in place
        self.cond = {k: v for k, v in guided.conditioning.items() if k not in names}
        # (session, its conditioning input names, pixels [uncond; cond], spec, keep column, cond only: a net that
        # runs on the conditional half, its samples added to both halves, as QwenImageControlNetPipeline)
        self.nets = nets
        self.step, self.steps = 0, steps
        self.active: list[int] = []  # how many nets ran, per call

    def __call__(self, x: np.ndarray, t: float) -> np.ndarray:
        g = self.g
        sample = np.ascontiguousarray(np.concatenate([x, x]) if g.guided else x, np.float32)
        single = np.ascontiguousarray(x, np.float32)
        i = min(self.step, self.steps - 1)
        ran = 0
        for session, wanted, pixels, spec, keep, cond_only in self.nets:
            scale = np.float32(spec.scale * keep[i])  # diffusers: conditioning_scale x keep[i]
            if scale == 0:  # the net's residuals would be zeros: nothing to add
                continue
            half = cond_only and g.guided  # the net sees the conditional half; both halves take its samples
            cond = {k: self.cond[k][g.batch:] if half else self.cond[k] for k in wanted}
            s = single if half else sample
            feeds = {SAMPLE: s, TIMESTEP: np.full((s.shape[0],), t, np.float32), COND: pixels,
                     SCALE: np.array([scale], np.float32), **cond}
            for buf, r in zip(self.buffers, session.run(self.names, feeds)):
                for part in ((buf[:g.batch], buf[g.batch:]) if half else (buf,)):
                    if ran:
                        part += r
                    else:
                        np.copyto(part, r)
            ran += 1
        if not ran:
            for buf in self.buffers:
                buf.fill(0.0)
        self.active.append(ran)
        self.step += 1
        return g(x, t)


def residual_session(pipe, record: dict):
    """The pipeline's backbone cut to take residuals (cut once per pipeline)."""
    import onnx

    from ..onnxio import fp16_storage
    from ..runtime.control_graph import add_residual_inputs  # noqa: F401 (onnx is loaded only here)
    from .caching import piece_session

    key = tuple(residuals_of(pipe.family, record))
    cuts = pipe.technique_state.get("controlnet_cuts", dict)
    if key not in cuts:
        path = pipe.backbone_path
        model = add_residual_inputs(fp16_storage.expand(onnx.load(str(path)), str(path)), pipe.family, record)
        cuts[key] = piece_session(model, pipe.backbone_session_maker(disabled_optimizers=True))
    return cuts[key]


def net_session(pipe, name: str, record: dict):
    from ..onnxio.session import make_session
    from ..runtime import guards

    sessions = pipe.technique_state.get("controlnet_sessions", dict)
    if name not in sessions:
        path = confined(pipe.folder, record.get("path"), f"ControlNet {name!r}")
        s = make_session(path, pipe.provider, pipe.threads, providers=pipe.providers_for("backbone"), memory=pipe.memory)
        guards.check_io(pipe.folder, f"controlnets/{name}", s, (SAMPLE, TIMESTEP, COND, SCALE),
                        tuple(residual_names(pipe.family, record)))
        sessions[name] = s
    return sessions[name]


def controlled_backbone(pipe, prepared: list[Prepared], prompts, negatives, guidance: float, h: int, w: int,
                        shape: tuple[int, ...], steps: int, extra=None) -> ControlledBackbone:
    """This generation's model function with ControlNets (prepared by `prepare`)."""
    rec = prepared[0].record
    for p in prepared[1:]:
        if residuals_of(pipe.family, p.record) != residuals_of(pipe.family, rec):
            raise UserError(f"ControlNets {prepared[0].spec.name!r} and {p.spec.name!r} give residuals of different shapes")
    # an embedded scale or a step-distilled backbone: no CFG batch
    cfg = pipe.family.true_cfg(pipe.info) and pipe.family.cfg_scale(guidance) > 1.0
    n = shape[0] * (2 if cfg else 1)
    f = int(pipe.info.vae_scale_factor)  # latent size from the pixel size: packed-token latents too
    names = [name for name, _ in residuals_of(pipe.family, rec)]

    def zeros(conditioning: dict) -> dict:
        # residuals over the text tokens too (Z-Image's hints) are as long as this run's encoded prompts
        text = conditioning[CONTEXT].shape[1] if CONTEXT in conditioning else 0
        return {name: np.zeros(dims, np.float32) for name, dims in residuals_of(pipe.family, rec, (n, h // f, w // f, text))}

    guided = pipe.guided_backbone(prompts, negatives, guidance, h, w, shape, residual_session(pipe, rec), extra=extra,
                                  inputs=zeros)
    nets = []
    for p in prepared:
        session = net_session(pipe, p.spec.name, p.record)
        wanted = [i.name for i in session.get_inputs() if i.name not in (SAMPLE, TIMESTEP, COND, SCALE)]
        missing = [k for k in wanted if k not in guided.conditioning]
        if missing:
            raise UserError(f"ControlNet {p.spec.name!r} wants inputs {missing} the backbone is not fed")
        cond_only = bool(p.record.get("cond_only"))
        pixels = np.concatenate([p.pixels, p.pixels]) if guided.guided and not cond_only else p.pixels
        nets.append((session, wanted, np.ascontiguousarray(pixels), p.spec, keep_column(p.spec, steps), cond_only))
    return ControlledBackbone(guided, nets, names, steps)


def graph_feeds(pipe, compiled: list[str], prepared: list[Prepared], steps: int, batch: int, h: int, w: int) -> dict:
    """A sampling graph's ControlNet inputs: each compiled net's image, scale and keep column; a net this run
    does not use gets scale 0 (zero residuals, as the host loop's skipped net)."""
    by_name = {p.spec.name: p for p in prepared}
    feeds = {}
    for k, name in enumerate(compiled):
        p = by_name.get(name)
        if p is None:  # the control image of a net left out: zeros of its layout (latents: the sampler's)
            rec = (pipe.manifest.controlnets or {}).get(name) or {}
            f = int(pipe.info.vae_scale_factor)  # zeros of the layout a latent-conditioned net makes of VAE latents
            vae = np.zeros((batch, int(pipe.info.latent_channels), h // f, w // f), np.float32)
            shape = pipe.family.control_latents(pipe.info, rec, vae).shape if rec.get("condition") == "latents" else (
                batch, 3, h, w)
        feeds[f"control_image_{k}"] = p.pixels if p else np.zeros(shape, np.float32)
        feeds[f"control_scale_{k}"] = np.array(p.spec.scale if p else 0.0, np.float32)
        feeds[f"control_keep_{k}"] = keep_column(p.spec, steps) if p else np.zeros((steps,), np.float32)
    return feeds


class ControlHost(HostTechnique):
    name = NAME

    def __init__(self, controls: list):
        self.controls = controls

    def backbone(self, ctx):
        model_fn = controlled_backbone(ctx.pipe, self.controls, ctx.prompts, ctx.negatives, ctx.guidance, ctx.height,
                                       ctx.width, ctx.shape, ctx.steps, extra=ctx.extra)
        return model_fn, model_fn.g

    def graph_feeds(self, graph, ctx) -> dict:
        if not graph.controlnets:
            return {}
        # every net built into the graph is fed (scale 0 when this run does not use it)
        return graph_feeds(ctx.pipe, graph.controlnets, self.controls, ctx.steps, ctx.shape[0], ctx.height, ctx.width)

    def settings(self) -> dict:
        if not self.controls:
            return {}
        return {"controlnets": [{"name": c.spec.name, "scale": c.spec.scale, "start": c.spec.start, "end": c.spec.end}
                                for c in self.controls]}
