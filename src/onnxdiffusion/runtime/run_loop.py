"""One generation over a loaded Pipeline: inputs checked and drawn (`prepare`), then the per-step
generator (`run`) in the host loop or a compiled sampling graph, text-only or from a picture."""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..samplers import iter_sample
from . import guards
from ..adapters.runtime import graph_feeds as graph_lora_feeds
from .cache import cached_backbone, loop_feeds, parse_cache
from .generation import GenerationResult, StepEvent
from . import stop as stopping


def prepare(pipe, options, latents, noise, image=None, mask=None):
    """Validate everything before any model runs; (table, latents, noise[, ImageStart])."""
    from .image_input import check_strength, plan_start

    options = pipe.resolve(options)
    cache = parse_cache(options.cache)
    stop = stopping.parse_stop(options.stop_early)
    stopping.check_form(stop, options.loop, lambda: pipe.sampling_graph("loop").stop, cache)
    if cache is not None and not cache.noop and options.loop != "host":
        if options.loop != "loop":
            raise UserError(f"cache {cache} runs in the host loop and the Loop graph (--loop host | loop)")
        loop_feeds(pipe.sampling_graph("loop").cache, cache)  # a graph compiled without it refuses here
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
    stopping.check_inpainting(stop, start is not None and start.keep is not None)
    stopping.check_steps(stop, run_table.num_steps)
    if run_table.needs_noise and noise is None:
        noise = rng.standard_normal((run_table.num_steps, *shape), dtype=np.float32)
    if noise is not None:
        noise = guards.float_array(noise, "noise", (run_table.num_steps, *shape))
    return (table, latents, noise) if start is None else (table, latents, noise, start)


def run(pipe, options, table, latents, noise, prompts, negatives, start=None, adapter=None, controls=None):
    stop = stopping.parse_stop(options.stop_early)
    stop = None if stop is None or stop.noop else stop  # threshold 0 never stops: no test to compute
    run_table = table if start is None else start.cut
    embedded = pipe.family.guidance_input_for(pipe.info)  # guidance-distilled: the scale is a backbone input, no CFG
    h, w = pipe.image_size(options)
    offset = 0 if start is None else start.start
    if options.loop != "host":
        # one-graph loops always run the [uncond; cond] batch (guidance 1 is u + 1*(c - u)),
        # except for a guidance-distilled backbone, which takes the scale as an input
        cond, uncond = pipe.conditioning(prompts, negatives, embedded is None, h, w, adapter)
        if embedded is not None:
            cond[embedded] = np.full((len(prompts),), options.guidance, np.float32)
        graph = pipe.sampling_graph(options.loop)
        lora = None if adapter is None else graph_lora_feeds(pipe, graph, adapter)
        cache = loop_feeds(graph.cache, parse_cache(options.cache)) if graph.form == "loop" else {}
        # a run-time LoRA's tensors, the compiled cache's interval / threshold, the stopping test's settings
        extra = {**(lora or {}), **cache, **stopping.loop_feeds(stop)}
        if graph.controlnets:  # ControlNets built into the graph: every one is fed (scale 0 when unused)
            from .controlnet import graph_feeds

            extra.update(graph_feeds(pipe, graph.controlnets, controls or [], run_table.num_steps, latents.shape[0], h, w))
        outs = graph.run_outputs(table, latents, cond, uncond, options.guidance, noise, image=start, extra=extra or None)
        x = next(iter(outs.values()))
        steps_run = int(outs["steps_run"]) if "steps_run" in outs else run_table.num_steps
        guards.check_finite(x, "the sampling graph's output latents")
    else:
        extra = None if start is None else start.extra
        run_table, x = (table, latents) if start is None else (start.cut, start.x_init)
        if controls:  # ControlNets: their residuals into the backbone cut to take them (runtime/controlnet.py)
            from .controlnet import controlled_backbone

            model_fn = controlled_backbone(pipe, controls, prompts, negatives, options.guidance, h, w, latents.shape,
                                           run_table.num_steps, extra=extra)
            backbone = model_fn.g
        else:
            model_fn = backbone = pipe.guided_backbone(prompts, negatives, options.guidance, h, w, latents.shape,
                                                       extra=extra, adapter=adapter)
        backbones = [backbone]
        if (cache := parse_cache(options.cache)) is not None and not cache.noop:
            model_fn = cached_backbone(pipe, backbone, cache)  # first -> (rest | cached) -> tail
        if pipe.correction is not None:
            model_fn = pipe.correction.wrap(model_fn)
        if pipe.precision_schedule is not None:
            high_fn = pipe.guided_backbone(prompts, negatives, options.guidance, h, w, latents.shape,
                                           pipe.backbone_high, extra=extra, adapter=adapter)
            backbones.append(high_fn)
            model_fn = pipe.precision_schedule.wrap(model_fn, high_fn)
        after = None if start is None or start.keep is None else blend_step(start, latents)
        steps_run, prev = 0, None
        try:
            for i, x, den in iter_sample(model_fn, x, run_table, noise, after_step=after):
                steps_run = i + 1
                if stop is not None and stop.stops(i, run_table.num_steps, den, prev):
                    x = den  # the x0 estimate: a finished picture, not a half-noised latent
                    yield StepEvent(offset + i, table.num_steps, float(run_table.timesteps[i]), x, den, stopped=True)
                    break
                prev = den
                yield StepEvent(offset + i, table.num_steps, float(run_table.timesteps[i]), x, den)
        finally:  # device buffers go back to the pipeline's pool (also when the generator is dropped)
            for b in backbones:
                if hasattr(b, "close"):
                    b.close()
        # one reduction over the final latents: NaN/inf anywhere in the loop propagates to them
        guards.check_finite(x, "sampling (the backbone or sampler produced NaN/inf latents)")
    settings = {"prompt": prompts, "negative_prompt": negatives if negatives is not None else [""] * len(prompts),
                **options.__dict__, "sampler": table.sampler, "steps_run": steps_run}
    if start is not None:
        settings.update(start_row=start.start, inpaint=start.keep is not None or start.extra is not None)
    if controls:
        settings["controlnets"] = [{"name": c.spec.name, "scale": c.spec.scale, "start": c.spec.start, "end": c.spec.end}
                                   for c in controls]
    images = pipe.decode(x, h, w, options.decoder)
    if start is not None and start.overlay is not None:
        from .image_input import apply_overlay

        images = apply_overlay(images, start.overlay)
    yield GenerationResult(images=images, latents=x, init_latents=latents, noise=noise, settings=settings)


def blend_step(start, noise0: np.ndarray):
    """after_step for inpainting with a regular backbone: x = keep * target_i + (1 - keep) * x, target_i
    the image latents noised to the next row's level (diffusers: (1 - mask) * proper + mask * latents)."""
    keep = start.keep
    inv = (np.float32(1.0) - keep).astype(np.float32)
    lv = start.cut.levels
    lat = start.image_latents

    def after(i: int, x: np.ndarray) -> np.ndarray:
        s, n = lv[i + 1]
        target = np.float32(s) * lat + np.float32(n) * noise0
        return (keep * target + inv * x).astype(np.float32)

    return after
