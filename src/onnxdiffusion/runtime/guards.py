"""Checks the generation path runs before (and, cheaply, after) the models: ranges, shapes, memory, NaN.

Documented ranges (README "Settings and their ranges"):
  steps      1 .. the schedule's num_train_timesteps (1000 for SD)
  guidance   0 .. 100 (<= 1 means no classifier-free guidance)
  seed       0 .. 2**63 - 1
  batch      1 .. 4096, and the memory estimate below must fit in this machine's RAM
  height / width  positive multiples of the model's size_multiple, at most 16384 or the family's declared
                  limit (families.SizeLimits: SD3's position table)
Non-finite latents or pixels are an error naming the stage where they were found; the check is one
reduction over the final latents and one over the image (not per step), so it costs nothing measurable.
"""

from __future__ import annotations

import json
import math
import os
import warnings

import numpy as np

from ..errors import UserError
from ..families.base import MAX_SIDE  # noqa: E402  (one bound for the run time and the families)
from ..folder.manifest import Manifest, PipelineInfo
MAX_BATCH = 4096
MAX_GUIDANCE = 100.0
MAX_SEED = 2**63 - 1



def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_options(options) -> None:
    g = options.guidance
    if isinstance(g, bool) or not isinstance(g, (int, float, np.floating)) or not math.isfinite(g) \
            or not 0 <= g <= MAX_GUIDANCE:
        raise UserError(f"guidance must be a number in [0, {MAX_GUIDANCE:g}], got {g!r}")
    if not is_int(options.seed) or not 0 <= options.seed <= MAX_SEED:
        raise UserError(f"seed must be an integer in [0, 2**63-1], got {options.seed!r}")
    if not is_int(options.steps):
        raise UserError(f"steps must be an integer, got {options.steps!r}")
    if options.sampler is not None and not isinstance(options.sampler, str):  # None: the folder's own
        raise UserError(f"sampler must be a string, got {options.sampler!r}")
    if options.spacing is not None and not isinstance(options.spacing, str):
        raise UserError(f"spacing must be a string, got {options.spacing!r}")
    if options.loop not in ("host", "loop", "unrolled"):
        raise UserError(f"unknown loop form {options.loop!r}; choose from host, loop, unrolled")


def size_limits(manifest: Manifest):
    """The family's declared size limits for this folder (families.SizeLimits)."""
    from ..families import get_family

    return get_family(manifest.family).size_limits(manifest.pipeline)


def latent_shape(info: PipelineInfo, options, limits=None) -> tuple[int, int, int, int]:
    """`limits`: the family's SizeLimits (check_request passes them); None: size_multiple and MAX_SIDE only."""
    from ..families.base import SizeLimits

    h = info.default_height if options.height is None else options.height
    w = info.default_width if options.width is None else options.width
    limits = limits or SizeLimits(int(info.size_multiple), MAX_SIDE, MAX_SIDE)
    problem = limits.problem(h, w)
    if problem:
        raise UserError(problem)
    if not is_int(options.batch) or not 1 <= options.batch <= MAX_BATCH:
        raise UserError(f"batch must be an integer in [1, {MAX_BATCH}], got {options.batch!r}")
    f = info.vae_scale_factor
    return (options.batch, info.latent_channels, h // f, w // f)


def check_request(folder, manifest: Manifest, options) -> tuple[int, int, int, int]:
    """Everything about a request that needs only the manifest (no model loaded): ranges, sampler,
    loop form, size, memory. Returns the latent shape."""
    from ..samplers import SAMPLERS

    check_options(options)
    if options.sampler is not None and options.sampler not in SAMPLERS:
        raise UserError(f"unknown sampler {options.sampler!r}; choose from {', '.join(SAMPLERS)}")
    n = manifest.pipeline.num_train_timesteps
    if not 1 <= options.steps <= n:
        raise UserError(f"num_steps must be in [1, {n}], got {options.steps}")
    shape = latent_shape(manifest.pipeline, options, size_limits(manifest))
    if options.loop != "host":
        graph = manifest.component(f"sampler_{options.loop}")
        if graph is None:
            raise UserError(f"{folder} has no '{options.loop}' sampling graph "
                            f"(run `onnxdiffusion compile-loop --form {options.loop}`)")
        # from an image, the evaluations are the steps the strength keeps (checked once the table is cut)
        full = getattr(options, "strength", None) in (None, 1.0)
        if options.loop == "unrolled" and full and graph.steps != options.steps:
            raise UserError(f"this model's unrolled graph runs exactly {graph.steps} steps, got {options.steps}")
    check_decoder(folder, manifest, getattr(options, "decoder", "full"))
    check_memory(folder, manifest, shape)
    return shape


def check_decoder(folder, manifest: Manifest, decoder) -> None:
    """A known decoder, and for `tiny` a folder that has one (families/tiny_vae.py)."""
    from ..families.tiny_vae import DECODER, DECODERS

    if not isinstance(decoder, str) or decoder not in DECODERS:
        raise UserError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    if decoder == "tiny" and DECODER not in manifest.components:
        raise UserError(f"{folder} has no tiny decoder ({DECODER}): add one with `export ... --tiny-vae DIR`")


def check_size(info: PipelineInfo, size: tuple[int, int]) -> None:
    """A size other than the trained one works but usually looks worse: say so (once, as a warning)."""
    h, w = size
    if (h, w) != (info.default_height, info.default_width):
        warnings.warn(f"{h}x{w} differs from the model's trained size {info.default_height}x{info.default_width}; "
                      "expect lower quality", UserWarning, stacklevel=4)


def _channels(folder, manifest: Manifest, rel: str, default: int) -> int:
    """The first block width from a component's diffusers config.json (listed and hashed), else a default."""
    from ..folder.manifest import confined

    if rel not in manifest.files:
        return default
    try:
        c = json.loads(confined(folder, rel, "config").read_text())["block_out_channels"][0]
        return int(c) if is_int(c) and 0 < c < 100_000 else default
    except (OSError, ValueError, KeyError, IndexError, TypeError, UserError):
        return default


_CHANNELS: dict = {}


def memory_estimate(folder, manifest: Manifest, shape: tuple[int, ...]) -> int:
    """A lower bound on the bytes one generation needs at its peak (fp32 activations):

    backbone: 2*b rows (guidance) x h*w latent pixels x (16 live tensors of c_unet channels) plus one
    attention score matrix (h*w)^2 per row; VAE decoder: b x H*W pixels x 8 live tensors of c_vae
    channels plus its mid-block attention (h*w)^2. Channel widths come from the folder's config.json.
    """
    key = (str(folder), manifest.files.get("unet/config.json"), manifest.files.get("vae_decoder/config.json"))
    if key not in _CHANNELS:
        _CHANNELS[key] = (_channels(folder, manifest, "unet/config.json", 320),
                          _channels(folder, manifest, "vae_decoder/config.json", 128))
    c_unet, c_vae = _CHANNELS[key]
    b, _, h, w = shape
    f = manifest.pipeline.vae_scale_factor
    tokens = h * w
    unet = 2 * b * (tokens * c_unet * 16 + tokens * tokens) * 4
    vae = b * (tokens * f * f * c_vae * 8 + tokens * tokens) * 4
    return max(unet, vae)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def check_memory(folder, manifest: Manifest, shape: tuple[int, ...]) -> None:
    need, have = memory_estimate(folder, manifest, shape), physical_memory()
    if need > have:
        raise UserError(f"this request needs at least {need / 2**30:.1f} GiB (estimate for batch {shape[0]}, latents "
                        f"{shape[2]}x{shape[3]}) but this machine has {have / 2**30:.1f} GiB; use a smaller size or batch")


def float_array(a, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Caller-supplied latents / noise: a real numeric array of the right shape, finite."""
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        try:
            a = np.asarray(a)
        except (ValueError, TypeError):
            raise UserError(f"{name} must be a float array of shape {shape}") from None
        if a.dtype.kind not in "fiu":
            raise UserError(f"{name} must be a float array of shape {shape}, got dtype {a.dtype}")
    if a.shape != shape:
        raise UserError(f"{name} must have shape {shape}, got {a.shape}")
    a = np.asarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise UserError(f"{name} contain NaN or inf")
    return a


def prompt_list(prompt, batch: int, what: str) -> list[str]:
    prompts = [prompt] * batch if isinstance(prompt, str) else prompt
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise UserError(f"{what} must be a string or a list of strings, got {type(prompt).__name__}")
    if len(prompts) != batch:
        raise UserError(f"got {len(prompts)} {what}s for batch {batch}")
    for p in prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{what} is not valid UTF-8 text") from None
        if "\x00" in p:
            raise UserError(f"{what} contains a NUL character")
    return list(prompts)


def check_finite(a: np.ndarray, stage: str) -> None:
    if not np.isfinite(a).all():
        raise UserError(f"non-finite values after {stage}; the model folder or settings are unusable")


def check_io(folder, name: str, session, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    """A component swapped for another (or a foreign ONNX file) fails here, not mid-generation."""
    ins = {i.name for i in session.get_inputs()}
    outs = {o.name for o in session.get_outputs()}
    if not set(inputs) <= ins or not set(outputs) <= outs:
        raise UserError(f"{folder}: component '{name}' has inputs {sorted(ins)} and outputs {sorted(outs)}; expected "
                        f"inputs {list(inputs)} and outputs {list(outputs)} (a wrong or swapped component?)")


def check_latent_channels(folder, info: PipelineInfo, sessions: dict) -> None:
    """The manifest's latent_channels must be what the components take: `sessions` maps a component's
    name to (its session, the input that holds the latents)."""
    for name, (session, input_name) in sessions.items():
        shape = next(i.shape for i in session.get_inputs() if i.name == input_name)
        c = info.latent_channels
        # an inpainting UNet also takes the mask and the masked image's latents: 2C + 1 channels
        allowed = (c, 2 * c + 1) if input_name == "sample" else (c,)
        if len(shape) != 4 or (isinstance(shape[1], int) and shape[1] not in allowed):
            raise UserError(f"{folder}: manifest field 'pipeline.latent_channels' is {info.latent_channels} but "
                            f"component '{name}' takes {input_name} of shape {shape}")


def check_schedule(schedule, where) -> None:
    ac = getattr(schedule, "alphas_cumprod", None)
    if ac is not None and (not np.isfinite(ac).all() or (ac <= 0).any() or (ac > 1).any()):
        raise UserError(f"{where}: the noise schedule is degenerate (alphas_cumprod outside (0, 1])")


REQUEST_AXES = ("batch_size", "height_latent", "width_latent", "height", "width", "image_sequence_length")


def check_declared_dims(folder, family, info: PipelineInfo, components: dict) -> None:
    """Each component's graph must declare input shapes the run time can feed: the rank its family's spec
    gives, every fixed axis of the spec (a width, a channel count) equal, and a text encoder's token axis,
    if the graph fixes it, equal to the length its tokenizer pads to. A folder whose manifest and graphs
    disagree (crafted, or mixed by hand) is refused here instead of failing inside ONNX Runtime mid-run.
    `components`: name -> a session or session.GraphIO."""
    specs = family.component_specs(info, {*(slot.name for slot in family.text_encoders), family.backbone, "vae"})
    slots = {s.name: s for s in family.text_encoders}
    for name, io in components.items():
        spec = specs.get(name)
        if spec is None:
            continue
        declared = {i.name: i.shape for i in io.get_inputs()}
        known = {"sequence_length": family.sequence_length(name, info)} if name in slots else {}
        for t in spec.inputs:
            shape = declared.get(t.name)
            if shape is None:
                continue
            if len(shape) != len(t.dims):
                raise UserError(f"{folder}: component '{name}' input {t.name!r} has rank {len(shape)}; this "
                                f"{family.name} model feeds it rank {len(t.dims)} {list(t.dims)}")
            for axis, (got, want) in enumerate(zip(shape, t.dims)):
                want = known.get(want, want)
                if isinstance(got, int) and got > 0 and isinstance(want, int) and got != want:
                    raise UserError(f"{folder}: component '{name}' input {t.name!r} fixes axis {axis} to {got}; "
                                    f"the manifest says {want} (graph and manifest disagree)")
                if isinstance(got, int) and got > 0 and want in REQUEST_AXES:
                    # the request decides the batch (guidance doubles it) and the size: a graph fixed to one
                    # value fails at every other inside ONNX Runtime
                    raise UserError(f"{folder}: component '{name}' input {t.name!r} fixes axis {axis} ({want}) to "
                                    f"{got}; this {family.name} model feeds it at the size each request asks")
                if isinstance(got, int) and got <= 0:
                    raise UserError(f"{folder}: component '{name}' input {t.name!r} declares axis {axis} as {got}")


def probe_text(folder, pipe, backbone_io) -> None:
    """Encode an empty prompt once at load: a tokenizer padding past a text encoder's position table, or
    text conditioning the backbone's graph does not take (a manifest's lengths or widths that disagree with
    the graphs), is refused now in one line instead of failing inside ONNX Runtime on the first request.
    Costs one encoding; where the text encoders are let go after each encoding (memory lean/bounded) the
    pipeline runs `checked_encoding` on its first real prompt instead, so an LLM encoder runs once, not twice."""
    checked_encoding(folder, lambda: pipe.encode_prompt([""]), backbone_io, "an empty prompt")


def checked_encoding(folder, encode, backbone_io, what: str = "the first prompt"):
    """`encode()`'s conditioning, refused in one line if the text encoders fail or make conditioning the
    backbone's graph does not take (see probe_text)."""
    try:
        cond = encode()
    except UserError:
        raise
    except Exception as e:  # ORT's own exception types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"{folder}: the text encoders fail on {what} ({type(e).__name__}: {first})") from None
    declared = {i.name: i.shape for i in backbone_io.get_inputs()}
    for name, value in cond.items():
        shape = declared.get(name)
        if shape is None:
            continue
        bad = len(shape) != value.ndim or any(isinstance(d, int) and d > 0 and d != n
                                              for d, n in zip(shape[1:], value.shape[1:]))
        if bad:
            raise UserError(f"{folder}: the text side makes {name} of shape {list(value.shape)} but the backbone "
                            f"takes {shape} (manifest and graphs disagree)")
    return cond


def is_runtime_error(e: BaseException) -> bool:
    """An error ONNX Runtime raised from a session (its pybind exception types, or the RuntimeError its IO
    binding raises), as opposed to a bug of ours."""
    text = str(e)
    return type(e).__module__.startswith("onnxruntime") or (
        type(e) is RuntimeError and (text.startswith("Error in execution") or "[ONNXRuntimeError]" in text))


def model_errors(folder, events):
    """Re-raise ONNX Runtime's errors from a generation's events as one line naming the folder."""
    from ..errors import ModelRunError

    try:
        yield from events
    except Exception as e:
        if not is_runtime_error(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ModelRunError(f"{folder}: the model failed while running ({first})") from None
