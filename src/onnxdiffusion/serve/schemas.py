"""Request bodies (OpenAI images API + extensions) and their checks against the server's limits."""

from __future__ import annotations

import secrets
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..errors import UserError
from ..samplers import SAMPLERS
from .config import ServeConfig
from .jobs import JobRequest
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
    steps: int = 20
    sampler: str = Field("ddim", description=", ".join(SAMPLERS))
    guidance: float = 7.5
    seed: Optional[int] = Field(None, description="default: a random seed, echoed in the response")
    preview: bool = Field(False, description="jobs: low-resolution previews in the event stream")
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
    if not 1 <= body.steps <= config.max_steps:
        raise RequestError(f"steps must be between 1 and {config.max_steps}, got {body.steps}", "steps")
    if body.sampler not in SAMPLERS:
        raise RequestError(f"unknown sampler {body.sampler!r}; choose from {', '.join(SAMPLERS)}", "sampler")
    if not 0 <= body.guidance <= 50:
        raise RequestError(f"guidance must be between 0 and 50, got {body.guidance}", "guidance")
    seed = secrets.randbelow(2**31) if body.seed is None else body.seed
    if not 0 <= seed < 2**63:
        raise RequestError(f"seed must be between 0 and 2**63-1, got {seed}", "seed")
    if body.model is not None and body.model not in manager.models:
        raise RequestError(f"unknown model {body.model!r}; available: {', '.join(manager.models)}", "model",
                           code="model_not_found")
    requested, serving = manager.route(body.model)
    try:  # the sampler must also fit the model's schedule (flow samplers only on flow-matching models)
        from ..runtime.pipeline import GenerateOptions

        serving.pipeline.table(GenerateOptions(steps=body.steps, sampler=body.sampler))
    except UserError as e:
        raise RequestError(str(e), "sampler") from None
    width, height = manager.buckets[0]
    if body.size is not None:
        try:
            width, height = parse_size(body.size)
        except Exception as e:
            raise RequestError(str(e), "size") from None
        if not (1 <= width <= config.max_side and 1 <= height <= config.max_side):
            raise RequestError(f"size sides must be between 1 and {config.max_side}, got {body.size}", "size")
    bw, bh = manager.snap(width, height)
    return JobRequest(
        prompt=body.prompt, negative_prompt=body.negative_prompt, n=body.n, width=bw, height=bh, steps=body.steps,
        sampler=body.sampler, guidance=float(body.guidance), seed=int(seed), model=serving.id,
        model_requested=requested.id, fallback=serving.id != requested.id, requested_size=f"{width}x{height}",
        preview=body.preview,
    )
