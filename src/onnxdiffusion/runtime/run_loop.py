"""One generation over a loaded Pipeline: inputs checked and drawn (`prepare`), then the per-step
generator (`run`) in the host loop or a compiled sampling graph, text-only or from a picture."""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..samplers import iter_sample
from ..techniques.active import check as check_techniques, host_techniques, parse_specs
from ..techniques.host_base import HostContext
from ..techniques.stop import check_steps
from . import guards
from .generation import GenerationResult, StepEvent


def prepare(pipe, options, latents, noise, image=None, mask=None):
    """Validate everything before any model runs; (table, latents, noise[, ImageStart])."""
    return prepare_run(pipe, options, latents, noise, image, mask)[1]


def prepare_run(pipe, options, latents, noise, image=None, mask=None, lora=False, controlnet=False):
    """(the options' technique specs, parsed once; prepare's tuple; an editing model's reference inputs or None).
    `lora` / `controlnet`: whether the generation has run-time LoRAs / ControlNets (the registry's table refuses
    what does not combine; `lora` may be a techniques.lora.LoraUse, which says whether they reach the backbone). `image` means what the family says (references.py): a start picture or references."""
    from .image_input import check_strength, plan_start
    from .references import check_image_request, pictures, plan_references, start_picture

    options = pipe.resolve(options)
    check_image_request(pipe.family, len(pictures(image)), mask is not None, options.strength is not None, "image")
    edit = pipe.family.image_role == "reference"
    image, refs = (None, image) if edit else (start_picture(image), None)
    specs = parse_specs(options)
    masked = image is not None and mask is not None
    check_techniques(specs, options.loop, lora=lora, controlnet=controlnet, schedule=pipe.precision_schedule is not None,
                     inpaint=masked and not pipe.backbone_extra_channels(),
                     inpaint_backbone=masked and pipe.backbone_extra_channels() > 0)
    specs.check_graph(options.loop, lambda: pipe.sampling_graph("loop"))  # a graph compiled without one refuses
    guards.check_request(pipe.folder, pipe.manifest, options)
    shape = pipe.latent_shape(options)  # the family's (may be packed)
    h, w = pipe.image_size(options)
    guards.check_size(pipe.info, (h, w))
    table = pipe.table(options)
    if mask is not None and image is None:
        raise UserError("a mask needs the image it masks (--image)")
    from .image_input import check_mask_matches

    check_mask_matches(image, mask)
    if pipe.backbone_extra_channels() and mask is None:
        raise UserError(f"this model's backbone is an inpainting backbone ({pipe.backbone_extra_channels()} input "
                        "channels beyond the latents'): it draws from an image and a mask (--image, --mask)")
    strength = 1.0 if options.strength is None else check_strength(options.strength)
    if image is None and options.strength is not None:
        raise UserError("strength applies to a generation from an image (--image)")
    rng = np.random.default_rng(options.seed)
    if latents is None:
        latents = rng.standard_normal(shape, dtype=np.float32)
    else:
        latents = guards.float_array(latents, "latents", shape)
    start = None
    run_table = table
    if image is not None:
        start = plan_start(pipe, table, image, strength, options.steps, latents, options.batch, h, w, mask,
                           options.mask_blur, overlay_picture=options.mask_overlay)
        run_table = start.cut
    if options.loop != "host":
        graph = pipe.sampling_graph(options.loop)
        if graph.form == "unrolled" and graph.steps != run_table.num_steps:
            raise UserError(f"this model's unrolled graph runs exactly {graph.steps} model evaluations, "
                            f"this sampler needs {run_table.num_steps}" + (" at this strength" if start else ""))
        if start is not None:
            graph.check_image_inputs(start)
    references = plan_references(pipe, refs, options.batch) if edit else None
    check_steps(specs.stop, run_table.num_steps)
    if specs.cache_on is not None:  # a method's run-time data (bound again per run): refused before any model runs
        specs.cache_on.bind(pipe, run_table.num_steps)
    if run_table.needs_noise and noise is None:
        noise = rng.standard_normal((run_table.num_steps, *shape), dtype=np.float32)
    if noise is not None:
        noise = guards.float_array(noise, "noise", (run_table.num_steps, *shape))
    return specs, ((table, latents, noise) if start is None else (table, latents, noise, start)), references


def run(pipe, options, table, latents, noise, prompts, negatives, start=None, adapter=None, controls=None,
        specs=None, references=None):
    """The per-step generator; `specs`: prepare_run's parsed technique specs (parsed here when not given);
    `references`: an editing model's reference inputs (constant conditioning of every step)."""
    specs = parse_specs(options) if specs is None else specs
    run_table = table if start is None else start.cut
    embedded = pipe.family.guidance_input_for(pipe.info)  # guidance-distilled: the scale is a backbone input, no CFG
    h, w = pipe.image_size(options)
    offset = 0 if start is None else start.start
    ctx = HostContext(pipe, prompts, negatives, options.guidance, h, w, latents.shape, run_table.num_steps,
                      extra=None if start is None else start.extra, adapter=adapter, references=references)
    techniques = host_techniques(pipe, specs, options.loop, adapter, controls, start, latents)
    if options.loop != "host":
        # one-graph loops always run the [uncond; cond] batch (guidance 1 is u + 1*(c - u)),
        # except for a guidance-distilled backbone, which takes the scale as an input
        cond, uncond = pipe.conditioning(prompts, negatives, pipe.family.true_cfg(pipe.info), h, w, adapter, references)
        if embedded is not None:
            cond[embedded] = np.full((len(prompts),), options.guidance, np.float32)
        graph = pipe.sampling_graph(options.loop)
        extra = {}  # each technique's run-time inputs (LoRA tensors, cache interval, stop threshold, ControlNets)
        for t in techniques:
            extra.update(t.graph_feeds(graph, ctx))
        scale = options.guidance if embedded is not None else pipe.family.cfg_scale(options.guidance)
        outs = graph.run_outputs(table, latents, cond, uncond, scale, noise, image=start, extra=extra or None)
        x = next(iter(outs.values()))
        steps_run = int(outs["steps_run"]) if "steps_run" in outs else run_table.num_steps
        guards.check_finite(x, "the sampling graph's output latents")
    else:
        x = latents if start is None else start.x_init
        model_fn = None
        for t in techniques:  # a technique may stand in for the guided backbone (ControlNet)
            if (made := t.backbone(ctx)) is not None:
                model_fn, ctx.backbone = made
        if model_fn is None:
            model_fn = ctx.backbone = ctx.guided()
        ctx.backbones.insert(0, ctx.backbone)
        for t in techniques:  # the registry's order: cache, correction, precision schedule around it
            model_fn = t.wrap(model_fn, ctx)
        after = next((a for t in techniques if (a := t.after_step()) is not None), None)
        steps_run, prev = 0, None
        try:
            for i, x, den in iter_sample(model_fn, x, run_table, noise, after_step=after):
                steps_run = i + 1
                if any(t.stops(i, run_table.num_steps, den, prev) for t in techniques):
                    x = den  # the x0 estimate: a finished picture, not a half-noised latent
                    yield StepEvent(offset + i, table.num_steps, float(run_table.timesteps[i]), x, den, stopped=True)
                    break
                prev = den
                yield StepEvent(offset + i, table.num_steps, float(run_table.timesteps[i]), x, den)
        finally:  # device buffers go back to the pipeline's pool (also when the generator is dropped)
            for b in ctx.backbones:
                if hasattr(b, "close"):
                    b.close()
        # one reduction over the final latents: NaN/inf anywhere in the loop propagates to them
        guards.check_finite(x, "sampling (the backbone or sampler produced NaN/inf latents)")
    settings = {"prompt": prompts, "negative_prompt": negatives if negatives is not None else [""] * len(prompts),
                **options.__dict__, "sampler": table.sampler, "steps_run": steps_run}
    if references is not None:
        settings.update(edit=True)  # the picture was a reference, not a start
    if start is not None:
        settings.update(start_row=start.start, inpaint=start.keep is not None or start.extra is not None)
    for t in techniques:
        settings.update(t.settings())
    if pipe.memory.release_backbone:  # memory `bounded`: the backbone's weights go before the decoder runs
        ctx = techniques = model_fn = after = graph = b = None  # every name that held the session (b: the loop's)
        pipe.release_backbone()
    images = pipe.decode(x, h, w, options.decoder)
    if start is not None and start.overlay is not None:
        from .image_input import apply_overlay

        images = apply_overlay(images, start.overlay)
    yield GenerationResult(images=images, latents=x, init_latents=latents, noise=noise, settings=settings)

