"""What the browser page at `/` needs beyond the OpenAI routes: the page itself (one HTML answer, its CSS
and JS inlined so the open `/` is the only unauthenticated path it uses), each served model's
capabilities (`GET /v1/page/models`), and picture jobs that stream (`POST /v1/jobs/edits`).

`/v1/images/edits` answers when the image is done, so a page using it could show neither step previews
nor a cancel button; `/v1/jobs/edits` takes the same multipart form, checks it with the same code
(`edits.build_edit`), queues it with previews on and answers with the job at once, like `POST /v1/jobs`.
Without an `image` but with `controlnet` + `control` it is a text-to-image job steered by the net (the
edits route needs a picture to start from; a ControlNet does not).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from importlib import resources

from fastapi import FastAPI, Request

from .schemas import RequestError

PARTS = ("page.css", "page.js", "page_mask.js")  # inlined into page.html where it names them


def page_html() -> str:
    """page.html with its parts inlined (`<!-- part: NAME -->` markers), read per request: no build step."""
    root = resources.files(__package__)
    html = root.joinpath("page.html").read_text()
    for name in PARTS:
        text = root.joinpath(name).read_text()
        tag = "style" if name.endswith(".css") else "script"
        html = html.replace(f"<!-- part: {name} -->", f"<{tag}>\n{text}</{tag}>")
    return html


def model_capabilities(entry) -> dict:
    """One served model as the page offers it: sizes, defaults, the samplers its schedule takes (and which
    of them can start from a picture), adapters, ControlNets, and what it does with a picture."""
    from ..adapters.feeds import SCALE_RANGE
    from ..runtime.pipeline import GenerateOptions
    from ..samplers import SAMPLERS

    pipe = entry.pipeline
    defaults = pipe.resolve(GenerateOptions())
    samplers = []
    for name in SAMPLERS:
        try:
            table = pipe.table(GenerateOptions(steps=defaults.steps, sampler=name))
        except Exception:  # noqa: BLE001 - a sampler this schedule refuses is simply not offered
            continue
        samplers.append({"name": name, "from_picture": table.levels is not None})
    components = pipe.manifest.components
    from ..families.tiny_vae import DECODER

    return {
        "id": entry.id, "status": entry.status, "precision": entry.precision,
        "fallback_to": entry.sibling if entry.status == "degraded" else None,
        "buckets": [f"{w}x{h}" for w, h in entry.buckets],
        "defaults": {"steps": defaults.steps, "guidance": defaults.guidance, "sampler": defaults.sampler},
        "samplers": samplers,
        "loras": list(entry.loras or ()), "lora_scale": list(SCALE_RANGE),
        "controlnets": sorted(pipe.manifest.controlnets or {}),
        "takes_picture": "vae_encoder" in components,
        "needs_mask": pipe.backbone_extra_channels() > 0,  # an inpainting backbone: every picture job needs one
        "preview_decoder": "tiny" if DECODER in components else "full",
    }


def add_page_routes(app: FastAPI, config, manager, queue, submit_built) -> None:
    """Register GET /v1/page/models and POST /v1/jobs/edits; `submit_built` is the generations route's queueing."""
    from .edits import FIELDS, FILES, read_form

    cache: dict = {}

    @app.get("/v1/page/models", summary="Served models with what the page offers for each (samplers, LoRAs, ...)")
    async def page_models():
        out = []
        for entry in manager.models.values():
            if not entry.serving:
                continue
            key = (entry.id, id(entry.pipeline), entry.loras)  # a reloaded pipeline or a late catalog: asked again
            if key not in cache:
                cache[key] = model_capabilities(entry)
            out.append(cache[key])
        return {"object": "list", "data": out, "max_steps": config.max_steps, "max_n": config.max_n,
                "default_model": manager.default_id if manager.models else None}

    @app.post("/v1/jobs/edits", status_code=202, summary="Queue a picture job (multipart, as /v1/images/edits) or "
              "a ControlNet job; returns the job at once, its previews in /v1/jobs/{id}/events")
    async def create_edit_job(request: Request):
        ctype = request.headers.get("content-type", "")
        if not ctype.lower().startswith("multipart/form-data"):
            raise RequestError("POST /v1/jobs/edits takes multipart/form-data (as /v1/images/edits)",
                               code="invalid_body")
        async with request.form(max_files=len(FILES) + 2, max_fields=len(FIELDS) + 8) as form:
            fields, files = await read_form(form)
        job = await asyncio.to_thread(submit_built, lambda: _build(fields, files, config, manager), request)
        snap = job.snapshot(queue.position(job))
        if job.request.notices:
            snap["notices"] = list(job.request.notices)
        return snap


def _build(fields: dict, files: dict, config, manager):
    """The edit's JobRequest with previews on; without a picture, a ControlNet-steered text-to-image job."""
    from .edits import build_edit

    if "image" in files or "control" not in files:
        return replace(build_edit(fields, files, config, manager), preview=True)
    return replace(_control_only(fields, files, config, manager), preview=True)


def _control_only(fields: dict, files: dict, config, manager):
    from .edits import _control, form_body, refuse_conflicts
    from .schemas import build_request

    if "strength" in fields:
        raise RequestError("strength needs a picture to start from (an `image` file)", "strength")
    req = build_request(form_body(fields, ("controlnet",)), config, manager)
    entry = manager.models[req.model]
    if entry.pipeline.backbone_extra_channels() > 0:
        raise RequestError(f"model {entry.id} is an inpainting model: it needs a picture and a mask", "image",
                           code="missing_field")
    control = _control(fields, files, entry, (req.width, req.height))
    refuse_conflicts(entry, req, controlnet=True)
    return replace(req, edit=ControlInput(control))


@dataclass(frozen=True, eq=False)
class ControlInput:
    """A job's ControlNet without a picture: rendered as edits are (alone, noise drawn from its seed as
    `generate --seed S --controlnet ...` draws it), fed only the net."""

    control: tuple  # (name, control picture (H, W, 3) uint8, scale, start, end), as EditInput's

    def feeds(self) -> dict:
        return {"controlnets": [self.control]}

    def settings(self) -> dict:
        return {"controlnet": dict(zip(("name", "scale", "start", "end"), (self.control[0], *self.control[2:])))}
