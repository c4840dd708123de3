"""Request bodies (OpenAI images API + extensions) and their checks against the server's limits."""

from __future__ import annotations

import secrets
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..errors import UserError
from ..samplers import SAMPLERS
from .config import ServeConfig
from .job_request import JobRequest
from .manager import ModelManager, parse_size


class RequestError(Exception):
    """A 4xx answer: `param` names the offending field, like OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


class ImageRequest(BaseModel):
    """POST /v1/images/generations and POST /v1/jobs."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(max_length=2000, description="what to draw")
    n: int = Field(1, description="images for this prompt (one batch, seeds drawn like `generate --batch n`)")
    size: Optional[str] = Field(None, description="WIDTHxHEIGHT; snapped to the nearest bucket (echoed)")
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: Optional[str] = Field(None, description="model id from GET /v1/models (default: the first loaded)")
    # extensions
    negative_prompt: str = Field("", max_length=2000)
    # None: the model's recommended setting (its manifest), echoed in the response
    steps: Optional[int] = None
    sampler: Optional[str] = Field(None, description=", ".join(SAMPLERS))
    guidance: Optional[float] = None
    seed: Optional[int] = Field(None, description="default: a random seed, echoed in the response")
    preview: bool = Field(False, description="jobs: low-resolution previews in the event stream")
    # checked by serve/loras.parse_field, whose messages say more than a union type's validation errors would
    lora: Optional[Any] = Field(None, description='LoRA adapters the server lists in GET /v1/models: '
                                '[{"name": "style", "scale": 0.8}] or ["style:0.8"]; scale in [-4, 4], default 1')
    # OpenAI fields accepted for compatibility and ignored (one quality level, one style here)
    quality: Optional[str] = None
    style: Optional[str] = None
    user: Optional[str] = None


def build_request(body: ImageRequest, config: ServeConfig, manager: ModelManager) -> JobRequest:
    """Range checks against the configured limits, model routing and bucket snapping."""
    if not body.prompt.strip():
        raise RequestError("prompt must not be empty", "prompt")
    if not 1 <= body.n <= config.max_n:
        raise RequestError(f"n must be between 1 and {config.max_n}, got {body.n}", "n")
    if body.model is not None and body.model not in manager.models:
        raise RequestError(f"unknown model {body.model!r}; available: {', '.join(manager.models)}", "model",
                           code="model_not_found")
    requested, serving = manager.route(body.model)
    if not serving.serving:
        raise RequestError(f"model {serving.id!r} is unavailable: {serving.error}", "model", 503, "model_unavailable")
    from ..runtime.pipeline import GenerateOptions

    settings = serving.pipeline.resolve(GenerateOptions(steps=body.steps, sampler=body.sampler, guidance=body.guidance))
    steps, sampler, guidance = settings.steps, settings.sampler, settings.guidance
    if not 1 <= steps <= config.max_steps:
        raise RequestError(f"steps must be between 1 and {config.max_steps}, got {steps}", "steps")
    if sampler not in SAMPLERS:
        raise RequestError(f"unknown sampler {sampler!r}; choose from {', '.join(SAMPLERS)}", "sampler")
    if not 0 <= guidance <= 50:
        raise RequestError(f"guidance must be between 0 and 50, got {guidance}", "guidance")
    seed = secrets.randbelow(2**31) if body.seed is None else body.seed
    if not 0 <= seed < 2**63:
        raise RequestError(f"seed must be between 0 and 2**63-1, got {seed}", "seed")
    try:  # the sampler must also fit the model's schedule (flow samplers only on flow-matching models)
        serving.pipeline.table(GenerateOptions(steps=steps, sampler=sampler))
    except UserError as e:
        raise RequestError(str(e), "sampler") from None
    width, height = serving.buckets[0]
    if body.size is not None:
        try:
            width, height = parse_size(body.size)
        except Exception as e:
            raise RequestError(str(e), "size") from None
        if not (1 <= width <= config.max_side and 1 <= height <= config.max_side):
            raise RequestError(f"size sides must be between 1 and {config.max_side}, got {body.size}", "size")
        limits = serving.limits or {}
        for name, v in (("width", width), ("height", height)):  # beyond what the backbone runs: refused, not snapped
            hi = limits.get(f"max_{name}")
            if hi is not None and v > hi:
                raise RequestError(f"size {body.size}: {name} must be at most {hi} for model {serving.id} "
                                   f"({limits.get('why')})", "size", code="size_beyond_model_limit")
    bw, bh = manager.snap(serving, width, height)
    if config.max_memory is not None:
        need = manager.estimate_bytes(serving, body.n, bw, bh)
        if need > config.max_memory:
            raise RequestError(f"this request needs about {need / 2**30:.2f} GiB (estimate for {body.n} image(s) at "
                               f"{bw}x{bh}), over the server's --max-memory {config.max_memory / 2**30:.2f} GiB; "
                               f"ask for fewer images or a smaller size", "n" if body.n > 1 else "size",
                               code="over_memory_budget")
    prompt, raw_lora = prompt_tags(body.prompt, body.lora)
    lora = None if raw_lora is None else resolve_lora(raw_lora, manager, serving)  # converts last: the costly check
    return JobRequest(
        prompt=prompt, negative_prompt=body.negative_prompt, n=body.n, width=bw, height=bh, steps=steps,
        sampler=sampler, guidance=float(guidance), seed=int(seed), model=serving.id,
        model_requested=requested.id, fallback=serving.id != requested.id, requested_size=f"{width}x{height}",
        preview=body.preview, lora=lora,
    )


def prompt_tags(prompt: str, lora):
    """(the prompt without `<lora:NAME:WEIGHT>` tags, the `lora` field with the tagged adapters after its own)."""
    from ..adapters.tags import split_tags

    try:
        text, tagged = split_tags(prompt)
    except UserError as e:
        raise RequestError(str(e), "prompt", code="invalid_lora_tag") from None
    if not tagged:
        return prompt, lora
    if not text.strip():
        raise RequestError("prompt must not be empty (it holds only <lora:...> tags)", "prompt")
    if lora is not None and not isinstance(lora, list):
        return text, lora  # parse_field says what is wrong with it
    return text, [*(lora or []), *(f"{name}:{weight}" for name, weight in tagged)]


def resolve_lora(raw, manager: ModelManager, serving):
    """The request's adapters for the model that renders it (serve/loras.py), or a 400 naming `lora`."""
    catalog = getattr(manager, "loras", None)
    if catalog is None:
        raise RequestError("this server serves no LoRA adapters", "lora", code="lora_not_found")
    try:
        return catalog.resolve(raw, serving)
    except UserError as e:
        raise RequestError(str(e), "lora", getattr(e, "status", 400), getattr(e, "code", None)) from None
