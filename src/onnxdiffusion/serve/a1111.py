"""AUTOMATIC1111's web UI API (`/sdapi/v1/...`), the part its clients use, over the same queue and pipeline.

Open WebUI, SillyTavern, Krita's and Photoshop's plugins and the `webuiapi` client speak it. Each image is an
ordinary job (queue, micro-batching, per-key limits, timeouts): txt2img renders what `generate --seed S` renders,
img2img what `generate --image --strength [--mask]` renders. A1111's semantics where they differ from the OpenAI
routes: seed -1 is random and image i of a request takes seed + i (the seeds used are in `info`); the current model
is server state (`POST /sdapi/v1/options` with `sd_model_checkpoint`), `override_settings` names one per request;
`<lora:NAME:WEIGHT>` in the prompt picks served adapters; progress and interrupt act on the A1111 jobs in flight.
Errors use A1111's shape (a1111_schemas.A1111Error). Rules and limits: docs/verbs/serve.md.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import threading
from dataclasses import replace

from fastapi import FastAPI, Request

from ..errors import UserError
from .a1111_schemas import (SCHEDULERS, A1111Error, Img2ImgBody, Txt2ImgBody, info_text, our_sampler, parameters,
                            progress_of, refuse_unsupported, usable_names)
from .responses import RetryLater
from .schemas import ImageRequest, RequestError, build_request


MAX_OPTIONS = 64  # option keys other than sd_model_checkpoint a client may set (echoed by GET, not used)


class A1111State:
    """What A1111 keeps globally: the current model, the options set, the requests in flight (for progress)."""

    def __init__(self, manager):
        self.manager = manager
        self.current: str | None = None  # None: the manager's default model
        self.options: dict = {}
        self.active: list[tuple[str | None, list]] = []  # (owner, jobs) of each request in flight
        self.lock = threading.Lock()

    def model_id(self, name) -> str:
        """A model named as A1111 clients name it: its title, model_name, or `title [hash]`."""
        if not isinstance(name, str) or not name.strip():
            raise A1111Error("sd_model_checkpoint must be a model title from GET /sdapi/v1/sd-models",
                             param="sd_model_checkpoint")
        bare = name.strip().split(" [")[0].removesuffix(".onnx")
        for key in (name.strip(), bare):
            if key in self.manager.models:
                return key
        raise A1111Error(f"model not found: {name[:80]!r}; GET /sdapi/v1/sd-models lists: "
                         f"{', '.join(self.manager.models)}", 422, "model_not_found", "sd_model_checkpoint")

    def title(self, model_id: str | None = None) -> str:
        return model_id or self.current or self.manager.default_id

    def mine(self, owner) -> list:
        with self.lock:
            return [job for o, jobs in self.active if o == owner for job in jobs]


def add_a1111_routes(app: FastAPI, config, manager, queue, submit_built, caller) -> None:
    state = A1111State(manager)

    async def read_body(request: Request, model):
        from pydantic import ValidationError

        try:
            raw = await request.json()
        except ValueError:
            raise A1111Error("the body must be JSON (Content-Type: application/json)", code="invalid_json") from None
        try:
            return model.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first.get("loc", ())) or None
            raise A1111Error(f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param) from None

    async def generate(request: Request, body, picture):
        refuse_unsupported(body)
        owner = caller(request)
        made: dict = {}

        def build_first():  # every image's request is checked before the first is queued
            made["all"] = make_requests(body, picture, state, config, manager)
            return made["all"][0][0]

        first = await asyncio.to_thread(submit_built, build_first, request)
        reqs, title, a_name, extra = made["all"]
        jobs = [first]
        try:
            for r in reqs[1:]:
                jobs.append(submit_built(lambda r=r: r, request))
        except Exception:
            for job in jobs:
                _cancel(queue, job)
            raise
        with state.lock:
            state.active.append((owner, jobs))
        try:
            await _wait(jobs, queue, config.timeout)
        finally:
            with state.lock:
                state.active = [a for a in state.active if a[1] is not jobs]
        failed = [j for j in jobs if j.status in ("failed", "timeout")]
        if failed:
            status = 504 if failed[0].status == "timeout" else 500
            raise A1111Error(f"job {failed[0].id} {failed[0].status}: {failed[0].error}", status, failed[0].status)
        from .jobs import png_bytes

        done = [j for j in jobs if j.status == "succeeded"]
        interrupted = len(done) < len(jobs)
        images = [base64.b64encode(png_bytes(im)).decode() for j in done for im in j.images] if body.send_images else []
        extra = {**extra, "interrupted": interrupted} if interrupted else extra
        return {"images": images, "parameters": parameters(body), "info": info_text(reqs, body, a_name, title, extra)}

    @app.post("/sdapi/v1/txt2img", summary="A1111: text to image")
    @answer
    async def txt2img(request: Request):
        return await generate(request, await read_body(request, Txt2ImgBody), None)

    @app.post("/sdapi/v1/img2img", summary="A1111: image to image, inpainting with `mask` (white = repaint)")
    @answer
    async def img2img(request: Request):
        body = await read_body(request, Img2ImgBody)
        return await generate(request, body, await asyncio.to_thread(read_pictures, body))

    _model_routes(app, state, manager)

    @app.get("/sdapi/v1/progress", summary="A1111: progress of this caller's A1111 requests, with the current preview")
    async def progress(request: Request, skip_current_image: bool = False):
        jobs = state.mine(caller(request))
        if not skip_current_image:  # someone watches: decode previews from the next step on (not before: cost)
            for job in jobs:
                job.watched = True
        return progress_of(jobs, skip_current_image)

    @app.post("/sdapi/v1/interrupt", summary="A1111: stop this caller's A1111 requests (finished images are kept)")
    async def interrupt(request: Request):
        for job in state.mine(caller(request)):
            _cancel(queue, job)
        return None

    @app.post("/sdapi/v1/skip", summary="A1111: stop the running image of this caller's requests")
    async def skip(request: Request):
        for job in state.mine(caller(request)):
            if job.status == "running":
                _cancel(queue, job)
        return None

    for path, value in (("upscalers", []), ("latent-upscale-modes", []), ("hypernetworks", []), ("sd-vae", []),
                        ("face-restorers", []), ("realesrgan-models", []), ("prompt-styles", []),
                        ("embeddings", {"loaded": {}, "skipped": {}}), ("scripts", {"txt2img": [], "img2img": []})):
        app.add_api_route(f"/sdapi/v1/{path}", _constant(value), methods=["GET"], summary="A1111: none here")
    for path in ("refresh-checkpoints", "refresh-loras"):
        app.add_api_route(f"/sdapi/v1/{path}", _constant(None), methods=["POST"], summary="A1111: nothing to refresh")


def answer(handler):
    """The route's own errors, the shared checks' (RequestError) and the queue's (RetryLater) in A1111's shape."""
    async def run(request: Request):
        try:
            return await handler(request)
        except A1111Error as e:
            return e.response()
        except RequestError as e:
            status = 422 if e.status == 400 else e.status
            return A1111Error(e.message, status, e.code, e.param).response()
        except RetryLater as e:
            return A1111Error(e.message, e.status, e.code, headers={"Retry-After": str(e.retry_after)}).response()
    run.__name__ = handler.__name__
    return run


def _model_routes(app: FastAPI, state: A1111State, manager) -> None:
    """sd-models, options (the current model), samplers, schedulers, loras."""
    @app.get("/sdapi/v1/sd-models", summary="A1111: the served models (title = model id)")
    async def sd_models():
        return [{"title": e.id, "model_name": e.id, "hash": (e.unet_sha256 or "")[:10] or None,
                 "sha256": e.unet_sha256, "filename": e.id, "config": None} for e in manager.models.values()]

    @app.get("/sdapi/v1/options", summary="A1111: options (sd_model_checkpoint: the current model)")
    async def get_options():
        entry = manager.models.get(state.title())
        return {**state.options, "sd_model_checkpoint": state.title(), "samples_format": "png",
                "sd_checkpoint_hash": entry.unet_sha256 if entry else None}

    @app.post("/sdapi/v1/options", summary="A1111: set options; sd_model_checkpoint switches among served models")
    @answer
    async def set_options(request: Request):
        try:
            raw = await request.json() if await request.body() else {}
        except ValueError:
            raise A1111Error("the body must be JSON (Content-Type: application/json)", code="invalid_json") from None
        if not isinstance(raw, dict):
            raise A1111Error("the body must be a JSON object of options", code="invalid_body")
        if len(state.options.keys() | raw.keys()) > MAX_OPTIONS:  # kept only to be echoed: bounded
            raise A1111Error(f"at most {MAX_OPTIONS} options are kept", code="too_many_options")
        if "sd_model_checkpoint" in raw:
            model_id = state.model_id(raw["sd_model_checkpoint"])
            if not manager.models[model_id].serving:
                raise A1111Error(f"model {model_id} is unavailable: {manager.models[model_id].error}", 503,
                                 "model_unavailable", "sd_model_checkpoint")
            state.current = model_id
        state.options.update({k: v for k, v in raw.items() if k != "sd_model_checkpoint"})
        return None

    @app.get("/sdapi/v1/samplers", summary="A1111: sampler names (ours they map to in `options`)")
    async def samplers():
        from .a1111_schemas import ALIASES, SAMPLERS

        names = {n for e in manager.serving() for n in usable_names(e.pipeline)}
        return [{"name": k, "aliases": ALIASES[k], "options": {"onnxdiffusion": "|".join(SAMPLERS[k])}}
                for k in SAMPLERS if k in names]

    @app.get("/sdapi/v1/schedulers", summary="A1111: schedulers (automatic: the model's own sigma grid)")
    async def schedulers():
        return [{"name": k, "label": v, "aliases": None, "default_rho": -1, "need_inner_model": False}
                for k, v in SCHEDULERS.items()]

    @app.get("/sdapi/v1/loras", summary="A1111: the served LoRA adapters (<lora:NAME:WEIGHT> in a prompt)")
    async def loras():
        catalog = getattr(manager, "loras", None)
        names = sorted(catalog.files) if catalog is not None else []
        return [{"name": n, "alias": n, "path": f"{n}.safetensors", "metadata": {}} for n in names]


def _constant(value):
    async def route():
        return value
    return route


def make_requests(body, picture, state: A1111State, config, manager):
    """The JobRequests of one A1111 request (one per image, seeds seed + i), its model's title, A1111's sampler
    name and what `info` adds. Raises RequestError / A1111Error / UserError (the caller turns them into 4xx)."""
    from ..adapters.tags import split_tags

    model_id = state.model_id((body.override_settings or {}).get("sd_model_checkpoint")) if (
        body.override_settings or {}).get("sd_model_checkpoint") else state.title()
    try:
        prompt, tagged = split_tags(body.prompt)
    except UserError as e:
        raise A1111Error(str(e), 422, "invalid_lora_tag", "prompt") from None
    _, serving = manager.route(model_id)
    if not serving.serving:
        raise A1111Error(f"model {serving.id} is unavailable: {serving.error}", 503, "model_unavailable")
    sampler, a_name = our_sampler(body, serving.pipeline, body.steps)
    size = None if body.width is None and body.height is None else (
        f"{body.width or serving.buckets[0][0]}x{body.height or serving.buckets[0][1]}")
    if size is None and picture is not None:  # no size asked: the bucket nearest the picture's, as on /v1/images/edits
        size = "{}x{}".format(*manager.snap(serving, *picture[0].size))
    if body.width is not None and body.width < 1 or body.height is not None and body.height < 1:
        raise A1111Error("width and height must be positive", param="width")
    seed = body.seed if body.seed is not None and body.seed >= 0 else None
    from pydantic import ValidationError

    try:
        ask = ImageRequest(prompt=prompt or "-", negative_prompt=body.negative_prompt, size=size, model=model_id,
                           steps=body.steps, sampler=sampler, guidance=body.cfg_scale, seed=seed,
                           lora=[f"{n}:{w}" for n, w in tagged] or None)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ())) or None
        raise A1111Error(f"{param}: {first.get('msg', 'invalid value')}", param=param) from None
    first = build_request(ask, config, manager)
    first = replace(first, prompt=prompt)  # A1111 takes an empty prompt; the OpenAI route does not
    extra: dict = {}
    if body.eta not in (None, 0, 0.0) and first.sampler == "ddim":
        extra["notices"] = [f"eta {body.eta:g} ignored: DDIM runs deterministic here (eta 0)"]
    if picture is not None:
        first, extra = with_picture(first, body, picture, manager, extra)
    else:
        from .edits import refuse_text_only

        refuse_text_only(manager.models[first.model])  # an editing model: img2img with init_images
    count = body.batch_size * body.n_iter
    if first.seed + count >= 2**63:
        raise A1111Error("seed is too large", param="seed")
    # each image its own EditInput: an edit renders alone (its identity is its batch key), never batched with its twin
    reqs = [replace(first, seed=first.seed + i, edit=None if first.edit is None else replace(first.edit))
            for i in range(count)]
    return reqs, serving.id, a_name, extra


def with_picture(req, body: Img2ImgBody, picture, manager, extra: dict):
    """img2img: the picture (and mask) resized to the request's bucket, as an EditInput of the job."""
    from .edits import EditInput, _resized, check_model_can_edit, refuse_conflicts

    image, mask = picture
    from ..runtime.image_input import check_strength

    entry = manager.models[req.model]
    if entry.pipeline.family.image_role == "reference":  # an editing model: init_images[0] is the picture to edit
        return _reference(req, entry, image, mask, extra)

    try:
        strength = check_strength(body.denoising_strength)
    except UserError as e:
        raise A1111Error(f"denoising_strength: {e}", param="denoising_strength") from None
    check_model_can_edit(manager.models[req.model], req, strength, mask is not None)
    refuse_conflicts(manager.models[req.model], req, controlnet=False, inpaint=mask is not None)
    if body.mask_blur is not None and not 0 <= body.mask_blur <= 64:
        raise A1111Error(f"mask_blur must be in [0, 64], got {body.mask_blur}", param="mask_blur")
    target = (req.width, req.height)
    notices = list(extra.get("notices", []))
    if image.size != target:
        notices.append(f"the image is {image.size[0]}x{image.size[1]}, resized to {req.width}x{req.height} (the "
                       f"bucket of the requested size for model {req.model})")
    edit = EditInput(image=_array(_resized(image.convert("RGB"), target)),
                     mask=None if mask is None else _array(_resized(mask, target)), strength=strength,
                     image_size=f"{image.size[0]}x{image.size[1]}", mask_from=None if mask is None else "mask",
                     mask_blur=float(body.mask_blur or 0.0) if mask is not None else 0.0)
    more = {"strength": strength}
    if notices:
        more["notices"] = notices
    return replace(req, edit=edit, notices=tuple(notices)), {**extra, **more}


def _array(img):
    import numpy as np

    return np.asarray(img)


def read_pictures(body: Img2ImgBody):
    """(init image, mask or None) from base64 (raw or a data: URL); the mask as the library's L (white = repaint)."""
    from PIL import ImageOps

    images = body.init_images or []
    if len(images) != 1:
        raise A1111Error(f"init_images must hold one picture, got {len(images)}", param="init_images")
    image = _decode(images[0], "init_images")
    mask = None
    if body.mask:
        mask = _decode(body.mask, "mask")
        if mask.size != image.size:
            raise A1111Error(f"the mask is {mask.size[0]}x{mask.size[1]} but the image is {image.size[0]}x"
                             f"{image.size[1]}; send a mask of the image's size", 422, "mask_size_mismatch", "mask")
        mask = mask.convert("L")
        if body.inpainting_mask_invert:
            mask = ImageOps.invert(mask)
    return image, mask


def _decode(data, what: str):
    from .edits import decode_upload

    if not isinstance(data, str) or not data:
        raise A1111Error(f"{what}: a base64 picture (raw or data:image/png;base64,...) is needed", param=what)
    text = data.split(",", 1)[1] if data.startswith("data:") and "," in data else data
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)  # line-wrapped base64 is still base64
    except (binascii.Error, ValueError):
        raise A1111Error(f"{what}: not valid base64", 422, "invalid_base64", what) from None
    try:
        return decode_upload(raw, what)
    except RequestError as e:
        raise A1111Error(e.message, 413 if e.code == "image_too_large" else 422, e.code, what) from None


async def _wait(jobs, queue, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    events = []
    for job in jobs:
        done = asyncio.Event()
        job.add_done_callback(lambda d=done: loop.call_soon_threadsafe(d.set))
        events.append(done)
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=(timeout + 5) if timeout else None)
    except asyncio.TimeoutError:
        for job in jobs:
            queue.expire(job)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=30)


def _cancel(queue, job) -> None:
    from .jobs import FINAL, JobConflict

    if job.status in FINAL:
        return
    try:
        queue.cancel(job.id)
    except (KeyError, JobConflict):
        pass


def _reference(req, entry, image, mask, extra: dict):
    """img2img on an editing model: the picture is the one to edit (as uploaded; its family sizes it), the prompt
    the instruction; denoising_strength does not apply (said in a notice), a mask is refused."""
    from .edits import reference_edit_input

    if mask is not None:
        raise A1111Error(f"model {entry.id} edits by instruction: it takes no mask", param="mask")
    if "vae_encoder" not in entry.pipeline.manifest.components:
        raise A1111Error(f"model {entry.id} has no vae_encoder, so it cannot take a picture", param="init_images")
    notices = [*extra.get("notices", []), f"model {entry.id} edits by instruction: init_images[0] is the picture to "
               "edit, denoising_strength does not apply"]
    edit = reference_edit_input(image, f"{image.size[0]}x{image.size[1]}")
    return replace(req, edit=edit, notices=tuple(notices)), {**extra, "notices": notices}
