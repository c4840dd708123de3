"""`plan(folder, prompt, options, request)`: every check of a generation that needs no model loaded, in one
place and in the order a user meets them (cheap ones first: the prompt, the provider, the memory setting, the
technique specs, the pictures, then the folder's manifest: what --image means to its family, the techniques'
combinations, ranges and sizes, the ControlNets, the LoRA feeds). The CLI's `generate`, `generate()` below (the
Python API that takes a folder) and anything else that loads a model for one request call it, so a bad input is
refused with one line before any session is made. `Pipeline.iter_generate` checks the same again over a loaded
pipeline (runtime/run_loop.py), for callers that hold one."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UserError
from . import guards
from .options import GenerateOptions, GenerateRequest


@dataclass(frozen=True)
class Plan:
    """A checked request: the folder to load (a LoRA's points copy where one was made), its manifest, the prompt
    without its <lora:...> tags, the resolved options, the pictures read, and the LoRAs and ControlNets parsed."""
    folder: Path
    manifest: object
    prompt: str
    options: GenerateOptions
    request: GenerateRequest
    picture: object = None  # a start picture, or the list of pictures an editing family edits
    mask: object = None
    loras: tuple = ()  # ((path, scale), ...)
    controls: tuple = ()  # (techniques.controlnet.ControlNetSpec, ...), pictures read

    def load(self):
        """The Pipeline of this request's folder, as the request says it runs."""
        from .pipeline import Pipeline

        r = self.request
        return Pipeline.from_folder(self.folder, provider=r.provider, profile=r.profile, memory=r.memory)

    def events(self, pipe):
        """The per-step events and then the GenerationResult (Pipeline.iter_generate) of this request."""
        return pipe.iter_generate(self.prompt, negative_prompt=self.request.negative_prompt, image=self.picture,
                                  mask=self.mask, loras=list(self.loras), controlnets=list(self.controls),
                                  **self.options.__dict__)


def plan(folder: Path | str | None, prompt: str, options: GenerateOptions = GenerateOptions(),
         request: GenerateRequest = GenerateRequest(), outputs: Callable[[int], object] | None = None,
         log: Callable[[str], None] | None = None) -> Plan:
    """Check a generation before any model loads (folder None: the embedded model). `outputs(batch)`: the caller's
    check of where the images go (the CLI's output paths), called right after the prompts; `log`: notices (a LoRA
    folder's points copy being made)."""
    log = log or (lambda m: print(m, file=sys.stderr))
    guards.prompt_list(prompt, 1, "prompt")
    if request.negative_prompt is not None:
        guards.prompt_list(request.negative_prompt, 1, "negative prompt")
    if outputs is not None:  # a batch out of range is refused below (guards): naming 100000 files first took seconds
        b = options.batch
        outputs(b if isinstance(b, int) and not isinstance(b, bool) and 0 < b <= guards.MAX_BATCH else 1)
    from .session import resolve_provider

    resolve_provider(request.provider)
    if request.memory is not None:
        from .memory import memory_options

        memory_options(request.memory)  # a bad setting fails before any model loads
    from ..techniques.caching import parse_cache
    from ..techniques.stop import parse_stop

    # parsed once, before any model loads (a bad spec: one line), and passed down typed
    cache_spec, stop_spec = parse_cache(options.cache), parse_stop(options.stop_early)
    pictures, mask = _pictures(request, options)
    controls = _controls(request)
    return _with_folder(folder, prompt, options, request, cache_spec, stop_spec, pictures, mask, controls, log)


def _pictures(request: GenerateRequest, options: GenerateOptions):
    """The --image pictures and the --mask, read now (a bad file fails before any model loads)."""
    images = request.image if isinstance(request.image, (list, tuple)) else (request.image,)
    images = [i for i in images if i is not None]
    if not (images or request.mask is not None or options.strength is not None):
        return None, None
    from .image_input import check_mask_matches, check_strength, read_picture

    if not images:
        raise UserError("--mask and --strength need --image")
    if options.strength is not None:
        check_strength(options.strength)
    pictures = [_read(read_picture, p, "--image") for p in images]
    mask = _read(read_picture, request.mask, "--mask") if request.mask is not None else None
    check_mask_matches(pictures[0], mask)
    return pictures, mask


def _read(read_picture, picture, what: str):
    """A picture file read now; a picture already in memory (PIL, an array) as it is."""
    return read_picture(picture, what) if isinstance(picture, (str, Path)) else picture


def _controls(request: GenerateRequest) -> list:
    """--control / --controlnet pairs (and their --control-inpaint contexts) -> [ControlNetSpec], pictures read now."""
    from ..techniques.controlnet import ControlNetSpec, check_spec, parse_cli
    from .image_input import read_picture

    images, nets = list(request.control or ()), list(request.controlnet or ())
    if len(images) != len(nets):
        raise UserError(f"give one --control image per --controlnet (got {len(images)} images, {len(nets)} nets)")
    contexts = list(request.control_inpaint or ())
    if contexts and len(contexts) != len(nets):
        raise UserError(f"give one --control-inpaint PICTURE,MASK per --controlnet (got {len(contexts)} contexts, "
                        f"{len(nets)} nets)")
    specs, parsed = [], [parse_cli(n) for n in nets]
    for k, ((name, scale, start, end), p) in enumerate(zip(parsed, images)):
        context = _context(contexts[k]) if contexts else None
        # checked as the Python API checks ControlNetSpec(inpaint=...): the same one-line refusals
        spec = check_spec(ControlNetSpec(name, _read(read_picture, p, "--control"), scale, start, end, context))
        if spec.inpaint is not None:
            spec = replace(spec, inpaint=tuple(_read(read_picture, q, "--control-inpaint") for q in spec.inpaint))
        specs.append(spec)
    return specs


def _context(value):
    """"PICTURE,MASK" -> (picture, mask); a pair as it is; anything else left for check_spec to refuse."""
    if isinstance(value, str):
        parts = value.split(",")
        return tuple(parts) if len(parts) == 2 and all(parts) else value
    return value


def _with_folder(folder, prompt, options, request, cache_spec, stop_spec, pictures, mask, controls, log) -> Plan:
    """The checks that read the folder's manifest (still no model loaded)."""
    from ..families import get_family
    from ..folder.artifacts import read_manifest
    from ..folder.paths import default_model_folder
    from ..techniques.active import Specs, check as check_techniques
    from ..techniques.caching import parse_cache
    from .generation import resolve_options
    from .references import check_image_request

    folder = Path(folder) if folder is not None else default_model_folder()
    manifest = read_manifest(folder)
    family = get_family(manifest.family)  # what --image means to it: a start picture or the picture(s) to edit
    check_image_request(family, len(pictures or ()), mask is not None, options.strength is not None)
    picture = pictures
    if pictures is not None and family.image_role != "reference":
        picture = pictures[0]
    if picture is not None and "vae_encoder" not in manifest.components:
        raise UserError(f"{folder} has no vae_encoder component, which --image needs (export it without "
                        "`--skip vae_encoder`)")
    asked = options.cache
    options = resolve_options(replace(options, stop_early=stop_spec,
                                      cache="none" if asked is not None and cache_spec is None else cache_spec),
                              manifest.recommended)
    cache_spec = parse_cache(options.cache)  # a tuned folder's recommended cache, where none was asked for
    if options.loop is None:  # the profile decides, else the host loop
        from ..profiles import load_profile

        options = replace(options, loop=load_profile(request.profile).loop if request.profile is not None else "host")
    if controls:
        from ..techniques.controlnet import check_request

        check_request(folder, manifest, options, [c.name for c in controls])  # before any model loads
    from ..adapters.tags import split_tags, tagged_files

    # <lora:NAME:WEIGHT> as A1111 clients write it (the encoder sees no tag): split before the table's check, so a
    # tagged LoRA that does not combine is refused before its file is looked up or a points copy is made
    prompt, tagged = split_tags(prompt)
    # what does not combine (techniques/registry.py), as far as the options say; iter_generate checks it all again
    # with the folder's precision schedule and the picture's mask
    check_techniques(Specs(cache_spec, stop_spec), options.loop, lora=bool(request.lora) or bool(tagged),
                     controlnet=bool(controls))
    guards.check_request(folder, manifest, options)
    from ..adapters.feeds import normalize

    loras = [(str(p), w) for p, w in normalize(list(request.lora or ()))] + tagged_files(tagged, request.lora_dir)
    if loras:
        from ..adapters.feeds import build_feeds
        from ..adapters.folder import with_points

        folder = with_points(folder, log=log)  # a plain export: its points copy
        manifest = read_manifest(folder)
        build_feeds(manifest, loras)  # a bad file, key, shape or scale fails before any model loads
    return Plan(folder, manifest, prompt, options, request, picture, mask, tuple(loras), tuple(controls))


def generate(folder: Path | str | None, prompt: str, options: GenerateOptions = GenerateOptions(),
             request: GenerateRequest = GenerateRequest()):
    """The Python twin of `onnxdiffusion generate`: every input checked before any model loads (plan), then the
    folder loaded and the images made; returns the GenerationResult."""
    from .generation import GenerationResult

    checked = plan(folder, prompt, options, request)
    result = None
    for event in checked.events(checked.load()):
        result = event
    assert isinstance(result, GenerationResult)
    return result
