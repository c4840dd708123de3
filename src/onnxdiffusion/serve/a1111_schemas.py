"""AUTOMATIC1111's API bodies, its sampler names mapped to ours, its error shape and its `info` (serve/a1111.py).

Field names, defaults of the fields clients rely on and the answer's shape are A1111's (modules/api/models.py),
so its clients work unchanged. Where a field is left out the model's own setting applies (its recommended steps,
sampler and guidance, its trained size), not A1111's 512x512 at 50 steps: the served models are what they are.
Fields that would change the picture in a way this server cannot (hires fix, face restoration, tiling, scripts)
are refused by name rather than ignored; those that cannot (saving, grids) are accepted and ignored.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

# A1111 name -> our samplers, in order: the first the model's schedule takes (flow models take flow_*)
SAMPLERS: dict[str, tuple[str, ...]] = {
    "Euler a": ("euler_a",), "Euler": ("euler", "flow_euler"), "DDIM": ("ddim",), "DPM++ 2M": ("dpmpp_2m",),
    "Heun": ("flow_heun",), "PLMS": ("pndm",), "UniPC": ("unipc",), "LCM": ("lcm",), "TCD": ("tcd",),
}
ALIASES: dict[str, list[str]] = {
    "Euler a": ["k_euler_a", "k_euler_ancestral"], "Euler": ["k_euler"], "DDIM": ["ddim"], "DPM++ 2M": ["k_dpmpp_2m"],
    "Heun": ["k_heun"], "PLMS": ["plms"], "UniPC": ["unipc"], "LCM": ["k_lcm", "lcm"], "TCD": ["tcd"],
}
# the sigma grid comes from the model folder's scheduler config; A1111's other schedulers are refused by name
SCHEDULERS = {"automatic": "Automatic"}
MAX_IMAGES = 16  # batch_size x n_iter of one request


class A1111Error(Exception):
    """A 4xx/5xx answered in A1111's shape: {"error", "detail", "body", "errors"} (plus `code`, `param`)."""

    def __init__(self, message: str, status: int = 422, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.param, self.headers = message, status, code, param, headers

    def response(self) -> JSONResponse:
        body = {"error": "HTTPException", "detail": self.message, "body": "", "errors": self.message,
                "code": self.code, "param": self.param}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class _Body(BaseModel):
    # A1111's own models ignore fields they do not know; clients send many (styles, s_churn, ...)
    model_config = ConfigDict(extra="ignore")

    prompt: str = ""
    negative_prompt: str = ""
    seed: int = -1
    steps: Optional[int] = None
    cfg_scale: Optional[float] = None
    width: Optional[int] = None
    height: Optional[int] = None
    sampler_name: Optional[str] = None
    sampler_index: Optional[str] = None  # deprecated in A1111; sampler_name wins when both are sent
    scheduler: Optional[str] = None
    batch_size: int = 1
    n_iter: int = 1
    eta: Optional[float] = None  # DDIM's eta; ours is deterministic (eta 0): echoed as ignored when not 0
    override_settings: Optional[dict] = None
    send_images: bool = True
    save_images: bool = False
    # refused when set: they change the picture in a way this server does not do
    enable_hr: bool = False
    restore_faces: Optional[bool] = False
    tiling: Optional[bool] = False
    script_name: Optional[str] = None
    subseed_strength: float = 0.0
    alwayson_scripts: Optional[dict] = None


class Txt2ImgBody(_Body):
    pass


class Img2ImgBody(_Body):
    init_images: Optional[list] = None
    denoising_strength: float = 0.75
    mask: Optional[str] = None
    mask_blur: Optional[float] = None  # A1111's default is 4 (as webuiapi sends); absent: 0
    inpainting_mask_invert: int = 0
    resize_mode: int = 0
    include_init_images: bool = False


def refuse_unsupported(body: _Body) -> None:
    """Settings that would change the image in a way this server cannot do: a clear 422, not a silently other image."""
    for name, what in (("enable_hr", "hires fix"), ("restore_faces", "face restoration"), ("tiling", "tiling")):
        if getattr(body, name):
            raise A1111Error(f"{name}: {what} is not supported by this server", code="unsupported_field", param=name)
    if body.script_name:
        raise A1111Error(f"script_name: scripts are not supported by this server (got {body.script_name[:40]!r})",
                         code="unsupported_field", param="script_name")
    if body.subseed_strength:
        raise A1111Error("subseed_strength: variation seeds are not supported by this server", code="unsupported_field",
                         param="subseed_strength")
    for name, script in (body.alwayson_scripts or {}).items():
        args = script.get("args") if isinstance(script, dict) else script
        if args not in (None, [], [False], {}):  # clients send an extension's "off" as [] or [False]
            raise A1111Error(f"alwayson_scripts: {str(name)[:40]!r} is not supported by this server",
                             code="unsupported_field", param="alwayson_scripts")
    if body.scheduler not in (None, "", *SCHEDULERS, *SCHEDULERS.values()):
        raise A1111Error(f"unknown scheduler {body.scheduler[:40]!r}; this server has: {', '.join(SCHEDULERS)} (the "
                         "model folder's own sigma grid)", 422, "scheduler_not_found", "scheduler")
    if not 1 <= body.batch_size * body.n_iter <= MAX_IMAGES or body.batch_size < 1 or body.n_iter < 1:
        raise A1111Error(f"batch_size x n_iter must be between 1 and {MAX_IMAGES}, got {body.batch_size} x "
                         f"{body.n_iter}", param="batch_size")


def our_sampler(body: _Body, pipe, steps: int | None) -> tuple[str | None, str | None]:
    """(our sampler, A1111's name) for the request: `sampler_name` wins over `sampler_index`; None: the model's own.
    An unknown name, or one no sampler of this model's schedule answers to, is A1111's 404."""
    from ..errors import UserError
    from ..runtime.pipeline import GenerateOptions

    name = body.sampler_name or body.sampler_index
    if not name:
        return None, None
    key = next((k for k, aliases in ALIASES.items() if name == k or name.lower() in aliases), None)
    if key is None:
        raise A1111Error(f"Sampler not found: {name[:40]!r}; this server has: {', '.join(SAMPLERS)}", 404,
                         "sampler_not_found", "sampler_name")
    for ours in SAMPLERS[key]:
        try:
            pipe.table(GenerateOptions(steps=steps or 20, sampler=ours))
            return ours, key
        except UserError:
            continue
    raise A1111Error(f"sampler {key!r} does not fit this model's schedule; GET /sdapi/v1/samplers", 404,
                     "sampler_not_found", "sampler_name")


def usable_names(pipe) -> list[str]:
    """A1111 sampler names this model runs."""
    from ..errors import UserError
    from ..runtime.pipeline import GenerateOptions

    out = []
    for key, ours in SAMPLERS.items():
        for s in ours:
            try:
                pipe.table(GenerateOptions(steps=20, sampler=s))
                out.append(key)
                break
            except UserError:
                continue
    return out


def info_text(reqs, body: _Body, a1111_sampler: str | None, title: str, extra: dict) -> str:
    """A1111's `info`: a JSON string with the settings each image was made with (the seeds used among them)."""
    r0 = reqs[0]
    seeds = [r.seed for r in reqs]
    sampler = a1111_sampler or next((k for k, v in SAMPLERS.items() if r0.sampler in v), r0.sampler)
    info = {
        "prompt": r0.prompt, "all_prompts": [r.prompt for r in reqs], "negative_prompt": r0.negative_prompt,
        "all_negative_prompts": [r.negative_prompt for r in reqs], "seed": seeds[0], "all_seeds": seeds,
        "subseed": -1, "all_subseeds": [-1] * len(reqs), "subseed_strength": 0, "width": r0.width, "height": r0.height,
        "sampler_name": sampler, "cfg_scale": r0.guidance, "steps": r0.steps, "batch_size": body.batch_size,
        "restore_faces": False, "sd_model_name": title, "sd_model_hash": None, "seed_resize_from_w": -1,
        "seed_resize_from_h": -1, "denoising_strength": extra.get("strength"), "extra_generation_params": {},
        "index_of_first_image": 0, "infotexts": [infotext(r, sampler, title) for r in reqs], "styles": [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"), "clip_skip": 1, "is_using_inpainting_conditioning": False,
        "version": "onnxdiffusion", "scheduler": "Automatic",
        # ours: what rendered it, in the library's terms (sampler, bucket, adapters, notices)
        "onnxdiffusion": {"sampler": r0.sampler, **r0.settings(), **extra},
    }
    return json.dumps(info)


def infotext(r, sampler: str, title: str) -> str:
    """A1111's one-paragraph parameters text (what its PNG info and 'send to' buttons read)."""
    lines = [r.prompt]
    if r.negative_prompt:
        lines.append(f"Negative prompt: {r.negative_prompt}")
    lines.append(f"Steps: {r.steps}, Sampler: {sampler}, Schedule type: Automatic, CFG scale: {r.guidance:g}, "
                 f"Seed: {r.seed}, Size: {r.width}x{r.height}, Model: {title}")
    return "\n".join(lines)


def parameters(body: BaseModel) -> dict[str, Any]:
    """The request echoed as A1111 does (`parameters`), without the pictures sent in."""
    out = body.model_dump()
    for name in ("init_images", "mask"):
        if out.get(name):
            out[name] = None
    return out


def progress_of(jobs: list, skip_image: bool) -> dict:
    """A1111's progress object over the caller's jobs in flight: share of steps done, the running job's step and
    the latest step preview (the x0 estimate, decoded small)."""
    total = sum(j.request.steps for j in jobs)
    done = sum(j.request.steps if j.status in ("succeeded", "failed", "cancelled", "timeout") else j.step for j in jobs)
    running = [j for j in jobs if j.status == "running"]
    current = running[0] if running else None
    fraction = done / total if total else 0.0
    started = min((j.started for j in jobs if j.started), default=None)
    elapsed = time.time() - started if started else 0.0
    eta = elapsed / fraction - elapsed if fraction > 0 else None
    image = None
    if not skip_image:
        import base64

        shown = next((j for j in running if j.preview_png is not None), None)
        image = base64.b64encode(shown.preview_png).decode() if shown is not None else None
    return {"progress": round(fraction, 4), "eta_relative": round(eta, 3) if eta is not None else 0.0,
            "state": {"skipped": False, "interrupted": any(j.cancel_requested for j in jobs),
                      "job": f"task({current.id})" if current else "", "job_count": len(jobs),
                      "job_timestamp": time.strftime("%Y%m%d%H%M%S"), "job_no": sum(j.status == "succeeded" for j in jobs),
                      "sampling_step": current.step if current else 0,
                      "sampling_steps": current.request.steps if current else 0},
            "current_image": image, "textinfo": None}
