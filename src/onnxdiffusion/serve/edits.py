"""POST /v1/images/edits: OpenAI's image edit (multipart/form-data) as the model's family means a picture:
an editing model (FLUX.1 Kontext: `Family.image_role` "reference") edits it by the prompt's instruction;
any other model runs img2img or inpainting.

The generations route's checks, queue, per-key limits and error shape (`build_request`), then the
picture's own: OpenAI's mask (transparent = edit) becomes the library's (white = repaint); the
picture and mask are resized to the bucket with a notice (an editing model's picture is handed over
as uploaded: its family sizes references itself); the job renders what
`Pipeline(...)(prompt, image=, mask=, strength=, seed=)` renders. Rules: docs/verbs/serve.md.
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass, replace

import numpy as np
from fastapi import FastAPI, Request

from ..errors import UserError
from ..families import describe_image_roles
from .responses import wait_and_answer
from .schemas import ImageRequest, RequestError, build_request

MAX_UPLOAD_SIDE = 4096  # pixels per side of an uploaded image, checked before it is decoded
FORMATS = ("PNG", "JPEG", "WEBP")
FIELDS = ("prompt", "n", "size", "response_format", "model", "negative_prompt", "steps", "sampler", "guidance",
          "seed", "strength", "lora", "quality", "user", "controlnet")
FILES = ("image", "mask", "control")  # control: the picture a `controlnet` field's net steers by (extension)
MORE_IMAGES, MAX_IMAGES = "image+", 8  # the 2nd.. `image` parts (an editing family's further references)


@dataclass(frozen=True, eq=False)
class EditInput:
    """The picture (and mask) of one edit job, already at the job's generation size."""

    image: np.ndarray | list  # (H, W, 3) uint8; an editing model's references: a list of them, as uploaded
    mask: np.ndarray | None  # (H, W) uint8, the library's convention: 255 = repaint
    strength: float | None  # None: an editing model (no img2img schedule cut)
    image_size: str  # the upload's WIDTHxHEIGHT
    mask_from: str | None  # "mask", "image alpha" or None (img2img)
    control: tuple | None = None  # (name, control picture (H, W, 3) uint8, scale, start, end): a ControlNet
    mask_blur: float = 0.0  # A1111's img2img: Gaussian blur (pixels) of the mask before it is binarized

    def feeds(self) -> dict:
        """Keyword arguments of `Pipeline.iter_generate` for this edit."""
        more = {"controlnets": [self.control]} if self.control is not None else {}
        if self.mask_blur:
            more["mask_blur"] = self.mask_blur
        if self.strength is not None:
            more["strength"] = self.strength
        return {"image": self.image, "mask": self.mask, **more}

    def settings(self) -> dict:
        more = {} if self.control is None else {"controlnet": dict(zip(("name", "scale", "start", "end"),
                                                                        (self.control[0], *self.control[2:])))}
        if self.strength is None:  # an editing model: the picture(s) were references
            more["edit"] = "reference"
        return {"strength": self.strength, "image_size": self.image_size, "mask": self.mask_from, **more}


def _schema() -> dict:
    """The multipart body in the OpenAPI document (/docs), since the route reads the form itself."""
    props = {name: {"type": "string"} for name in FIELDS}
    props.update({name: {"type": "string", "format": "binary"} for name in FILES})
    props.update({name: {"type": "number"} for name in ("n", "steps", "seed", "guidance", "strength")})
    props["image"]["description"] = ("the picture: " + describe_image_roles() + " (several `image` parts where an "
                                     "editing family takes several references)")
    props["strength"]["description"] = "img2img only: share of the schedule that runs, (0, 1]"
    props["mask"]["description"] = "img2img models only: transparent pixels mark where to repaint"
    body = {"type": "object", "required": ["image", "prompt"], "properties": props}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": body}}}}


def add_edit_route(app: FastAPI, config, manager, queue, submit_built) -> None:
    """Register POST /v1/images/edits; `submit_built(build, request)` is the generations route's queueing."""

    @app.post("/v1/images/edits", summary="OpenAI-compatible image edit (multipart): editing by instruction on an "
              "editing model, img2img or inpainting on the others",
              openapi_extra=_schema())
    async def edits(request: Request):
        ctype = request.headers.get("content-type", "")
        if not ctype.lower().startswith("multipart/form-data"):
            raise RequestError("POST /v1/images/edits takes multipart/form-data (an `image` file, a `prompt`, "
                               "optionally a `mask` file)", code="invalid_body")
        async with request.form(max_files=len(FILES) + 2, max_fields=len(FIELDS) + 8) as form:
            fields, files = await read_form(form)
        job = await asyncio.to_thread(
            submit_built, lambda: build_edit(fields, files, config, manager), request)
        return await wait_and_answer(job, queue, config.timeout, fields.get("response_format", "b64_json"),
                                     str(request.base_url))


async def read_form(form) -> tuple[dict[str, str], dict[str, bytes]]:
    """Text fields and file bytes, each name known, given once, and of its kind (file or text)."""
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    for name, value in form.multi_items():
        key = "image" if name == "image[]" else name
        if key not in FIELDS and key not in FILES:
            raise RequestError(f"unknown field {name!r}", name, code="unknown_field")
        if key == "image" and key in files and not isinstance(value, str):  # more references (editing models)
            more = files.setdefault(MORE_IMAGES, [])
            if len(more) >= MAX_IMAGES - 1:
                raise RequestError(f"at most {MAX_IMAGES} images are taken", key)
            more.append(await value.read())
            continue
        if key in fields or key in files:
            what = "one image (several images are not supported)" if key == "image" else "once"
            raise RequestError(f"{key!r} must be given {what}", key)
        is_file = not isinstance(value, str)
        if key in FILES and not is_file:
            raise RequestError(f"{key!r} must be a file upload (multipart part with a filename)", key)
        if key in FIELDS and is_file:
            raise RequestError(f"{key!r} must be a text field, not a file", key)
        if is_file:
            files[key] = await value.read()
        else:
            fields[key] = value
    return fields, files


def build_edit(fields: dict[str, str], files: dict[str, bytes], config, manager):
    """The JobRequest of an edit: the generations checks (`build_request`), then the picture's own."""
    body = form_body(fields, ("strength", "controlnet"))
    if "image" not in files:
        raise RequestError("missing required file 'image' (the picture to edit)", "image", code="missing_field")
    image = decode_upload(files["image"], "image")
    if _edits_by_reference(body, manager):
        return _reference_edit(body, fields, files, image, config, manager)
    if files.get(MORE_IMAGES):
        raise RequestError("'image' must be given one image (several are taken by editing models only)", "image")
    mask, mask_from = None, None
    if "mask" in files:
        mask, mask_from = mask_of(decode_upload(files["mask"], "mask"), image), "mask"
    else:
        alpha = alpha_of(image)
        if alpha is not None and (alpha < 128).any():
            mask, mask_from = _repaint(alpha), "image alpha"
    strength = _strength(fields.get("strength"), 1.0 if mask is not None else 0.8)
    size_given = body.size is not None
    if not size_given and (body.model is None or body.model in manager.models):
        _, serving = manager.route(body.model)  # the bucket nearest the picture's own size
        width, height = manager.snap(serving, *image.size)
        body = body.model_copy(update={"size": f"{width}x{height}"})
    req = build_request(body, config, manager)
    upload = f"{image.size[0]}x{image.size[1]}"
    check_model_can_edit(manager.models[req.model], req, strength, mask is not None)
    notices = []
    target = (req.width, req.height)
    if image.size != target:
        why = f"the bucket {'of the requested size' if size_given else 'nearest it'} for model {req.model}"
        notices.append(f"the image is {upload} (width x height), resized to {req.width}x{req.height}, {why}")
    control = _control(fields, files, manager.models[req.model], target)
    refuse_conflicts(manager.models[req.model], req, control is not None, inpaint=mask is not None)
    edit = EditInput(image=np.asarray(_resized(image.convert("RGB"), target)),
                     mask=None if mask is None else np.asarray(_resized(mask, target)), strength=strength,
                     image_size=upload, mask_from=mask_from, control=control)
    return replace(req, edit=edit, notices=tuple(notices), requested_size=req.requested_size if size_given else upload)


def form_body(fields: dict[str, str], drop: tuple[str, ...]) -> ImageRequest:
    """The form's text fields (less `drop`, the picture routes' own) as the generations body, checked once for
    every multipart route: a missing field is `missing_field`, any other invalid value names its field."""
    from pydantic import ValidationError

    values = {k: v for k, v in fields.items() if k not in drop}
    if "lora" in values:
        values["lora"] = form_lora(values["lora"])
    try:
        return ImageRequest.model_validate(values)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ())) or None
        if first.get("type") == "missing":
            raise RequestError(f"missing required field {param!r}", param, code="missing_field") from None
        raise RequestError(f"{param}: {first.get('msg', 'invalid value')}", param) from None


def _edits_by_reference(body, manager) -> bool:
    """Whether the request's model is an editing model (its picture a reference, not an img2img start)."""
    if body.model is not None and body.model not in manager.models:
        return False  # build_request names the unknown model
    _, serving = manager.route(body.model)
    return serving.pipeline is not None and serving.pipeline.family.image_role == "reference"


def _reference_edit(body, fields: dict, files: dict, image, config, manager):
    """An editing model's job: the picture(s) handed over as uploaded (RGB), the output at the requested size
    or the bucket nearest the first picture; a mask or strength is refused, as the library refuses them."""
    from ..runtime.references import check_image_request

    pictures = [image, *(decode_upload(b, "image") for b in files.get(MORE_IMAGES, ()))]
    size_given = body.size is not None
    if not size_given:
        _, serving = manager.route(body.model)
        width, height = manager.snap(serving, *image.size)
        body = body.model_copy(update={"size": f"{width}x{height}"})
    req = build_request(body, config, manager)
    entry = manager.models[req.model]
    family = entry.pipeline.family
    if "mask" in files or "strength" in fields:
        name = "mask" if "mask" in files else "strength"
        raise RequestError(f"model {entry.id} edits by instruction (a {family.name} model): its image is a reference, "
                           f"so it takes no {name}", name, code="model_cannot_edit")
    try:
        check_image_request(family, len(pictures), what="image")
    except UserError as e:
        raise RequestError(str(e), "image") from None
    if "vae_encoder" not in entry.pipeline.manifest.components:
        raise RequestError(f"model {entry.id} has no vae_encoder, so it cannot take a picture; export it with one",
                           "model", code="model_cannot_edit")
    upload = f"{image.size[0]}x{image.size[1]}"
    if "controlnet" in fields or "control" in files:
        raise RequestError(f"model {entry.id} takes no ControlNet", "controlnet")
    arrays = [np.asarray(p.convert("RGB")) for p in pictures]
    edit = EditInput(image=arrays, mask=None, strength=None, image_size=upload, mask_from=None)
    return replace(req, edit=edit, requested_size=req.requested_size if size_given else upload)


def _control(fields: dict, files: dict, entry, target: tuple[int, int]) -> tuple | None:
    """The `controlnet` field (NAME[:SCALE[:START:END]]) and its `control` picture, checked against the model."""
    from ..techniques.controlnet import parse_cli

    if ("controlnet" in fields) != ("control" in files):
        raise RequestError("a `controlnet` field and a `control` file go together (the net and the picture it "
                           "steers by)", "controlnet")
    if "controlnet" not in fields:
        return None
    try:
        name, scale, start, end = parse_cli(fields["controlnet"])
    except UserError as e:
        raise RequestError(f"controlnet: {e}", "controlnet") from None
    nets = entry.pipeline.manifest.controlnets or {}
    if name not in nets:
        raise RequestError(f"model {entry.id} has no ControlNet {name!r} (it has {', '.join(sorted(nets)) or 'none'})",
                           "controlnet", code="unknown_controlnet")
    picture = np.asarray(_resized(decode_upload(files["control"], "control").convert("RGB"), target))
    return (name, picture, scale, start, end)


def form_lora(text: str) -> list:
    """The `lora` form field: the JSON body's list as JSON text, or "name[:scale]" items separated by commas."""
    import json

    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except ValueError as e:
            raise RequestError(f"lora: not valid JSON ({e})", "lora") from None
    return [item.strip() for item in text.split(",") if item.strip()]


def decode_upload(data: bytes, what: str):
    """Uploaded bytes -> a loaded PIL image; anything unreadable, or too large to decode, is a 400."""
    from PIL import Image

    if not data:
        raise RequestError(f"the {what} file is empty", what, code="invalid_image")
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
        fmt, (w, h) = img.format, img.size
    except Image.DecompressionBombError:
        raise RequestError(f"the {what} is too large to decode", what, code="image_too_large") from None
    except Exception as e:  # noqa: BLE001 - whatever PIL raises on a bad file, the client sent a bad file
        raise RequestError(f"the {what} is not a readable image ({type(e).__name__}); send a PNG", what,
                           code="invalid_image") from None
    if fmt not in FORMATS:
        raise RequestError(f"the {what} is {fmt}; send a PNG (JPEG and WebP are read too)", what, code="invalid_image")
    if w > MAX_UPLOAD_SIDE or h > MAX_UPLOAD_SIDE:
        raise RequestError(f"the {what} is {w}x{h}; at most {MAX_UPLOAD_SIDE} pixels a side are taken", what,
                           code="image_too_large")
    try:
        img.load()
    except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
        raise RequestError(f"the {what} is not a readable image ({type(e).__name__}: corrupt or truncated data)",
                           what, code="invalid_image") from None
    return img


def alpha_of(img) -> np.ndarray | None:
    """The (H, W) uint8 alpha of an image that has one (an alpha channel or a transparent palette entry)."""
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        return np.asarray(img.convert("RGBA"))[..., 3]
    return None


def _repaint(alpha: np.ndarray):
    """OpenAI's mask (transparent = edit) as the library's (white = repaint), an L image."""
    from PIL import Image

    return Image.fromarray((255 - alpha.astype(np.int16)).astype(np.uint8), "L")


def mask_of(mask, image):
    """The uploaded mask as the library's L mask; it must have alpha, the image's size and a transparent pixel."""
    if mask.size != image.size:
        raise RequestError(f"the mask is {mask.size[0]}x{mask.size[1]} but the image is {image.size[0]}x"
                           f"{image.size[1]}; send a mask of the image's size", "mask", code="mask_size_mismatch")
    alpha = alpha_of(mask)
    if alpha is None:
        raise RequestError("the mask has no alpha channel: its transparent pixels (alpha 0) mark where to edit, "
                           "as in OpenAI's API; send an RGBA PNG", "mask", code="invalid_mask")
    if not (alpha < 128).any():
        raise RequestError("the mask has no transparent pixel (alpha below 128): nothing to edit", "mask",
                           code="invalid_mask")
    return _repaint(alpha)


def _resized(img, size: tuple[int, int]):
    """As the library resizes a picture or mask to the generation size (image_input._resized), without its warning."""
    from PIL import Image

    return img if img.size == size else img.resize(size, resample=Image.Resampling.LANCZOS)


def _strength(text: str | None, default: float) -> float:
    from ..runtime.image_input import check_strength

    if text is None:
        return default
    try:
        return check_strength(float(text))
    except (ValueError, UserError):
        raise RequestError(f"strength must be a number in (0, 1], got {text!r}", "strength") from None


def check_model_can_edit(entry, req, strength: float, masked: bool) -> None:
    """What the pipeline would refuse at run time, refused now (400) instead of failing the job."""
    from ..runtime.pipeline import GenerateOptions
    from ..samplers.levels import start_row

    pipe = entry.pipeline
    if pipe.family.image_role != "start":
        raise RequestError(f"model {entry.id} takes no img2img start picture (a {pipe.family.name} model: "
                           f"{describe_image_roles()})", "image", code="model_cannot_edit")
    if "vae_encoder" not in pipe.manifest.components:
        raise RequestError(f"model {entry.id} has no vae_encoder, so it cannot take a picture; export it with one",
                           "model", code="model_cannot_edit")
    inpainting = pipe.backbone_extra_channels() > 0
    if inpainting and not masked:
        raise RequestError(f"model {entry.id} is an inpainting model: it needs a mask", "mask", code="missing_field")
    table = pipe.table(GenerateOptions(steps=req.steps, sampler=req.sampler))
    if table.levels is None:
        raise RequestError(f"sampler {req.sampler!r} cannot start from a picture", "sampler")
    if start_row(table, pipe.family.start_step(req.steps, strength)) >= table.num_steps:
        raise RequestError(f"strength {strength} with {req.steps} steps leaves no step to run; raise the strength "
                           "or the steps", "strength")


def refuse_conflicts(entry, req, controlnet: bool, inpaint: bool = False) -> None:
    """The techniques registry's refusals (its CONFLICTS table) for this job, as `generate` checks them before any
    model runs and in its words: a 400 now instead of a failed job. The model's own techniques count too (its
    precision schedule, a tuned folder's recommended cache, an inpainting backbone), resolved as the pipeline
    resolves them. `inpaint`: the job has a mask."""
    from ..runtime.pipeline import GenerateOptions
    from ..techniques.active import check, parse_specs
    from ..techniques.lora import LoraUse, backbone_layers

    pipe = entry.pipeline
    # the request's LoraSet holds its converted feeds: whether they reach the backbone is known without a read
    lora = False if req.lora is None else LoraUse(
        lambda: backbone_layers(getattr(req.lora, "feeds", None), pipe.family.backbone))
    try:
        options = pipe.resolve(GenerateOptions(steps=req.steps, sampler=req.sampler, guidance=req.guidance))
        check(parse_specs(options), options.loop, lora=lora, controlnet=controlnet,
              schedule=pipe.precision_schedule is not None, inpaint=inpaint and not pipe.backbone_extra_channels(),
              inpaint_backbone=inpaint and pipe.backbone_extra_channels() > 0)
    except UserError as e:
        raise RequestError(str(e), "controlnet" if controlnet else "lora", code="techniques_conflict") from None


def refuse_text_only(entry) -> None:
    """A request without a picture for an editing model (it needs the picture to edit): 400, as the library refuses it."""
    family = entry.pipeline.family if entry.pipeline is not None else None
    if family is not None and family.image_role == "reference" and not family.references_optional:
        raise RequestError(f"model {entry.id} edits pictures by instruction (a {family.name} model): send the picture "
                           "to POST /v1/images/edits (`image`) with the instruction as the prompt", "model",
                           code="model_needs_image")


def reference_edit_input(picture, image_size: str) -> EditInput:
    """An editing model's EditInput from one PIL picture (A1111's img2img route)."""
    return EditInput(image=[np.asarray(picture.convert("RGB"))], mask=None, strength=None, image_size=image_size,
                     mask_from=None)
