"""Answers shared by the routes: errors in OpenAI's shape (also the key middleware's), and a finished
job as an OpenAI images response (generations and edits alike)."""

from __future__ import annotations

import asyncio
import base64

from fastapi.responses import JSONResponse


class RetryLater(Exception):
    """A 503 (or 429) the client should retry: answered with `Retry-After` seconds."""

    def __init__(self, message: str, retry_after: int, status: int = 503, code: str = "queue_full"):
        super().__init__(message)
        self.message, self.retry_after, self.status, self.code = message, retry_after, status, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def image_response(job, response_format: str, base_url: str) -> dict:
    """`{created, data: [{b64_json | url, revised_prompt}]}` plus the job id, its settings, timings (and notices)."""
    from .jobs import png_bytes

    data = []
    for i, img in enumerate(job.images):
        item = {"revised_prompt": job.request.prompt}
        if response_format == "url":
            item["url"] = f"{base_url.rstrip('/')}/v1/jobs/{job.id}/images/{i}"
        else:
            item["b64_json"] = base64.b64encode(png_bytes(img)).decode()
        data.append(item)
    out = {"created": int(job.created), "data": data, "id": job.id, "settings": job.request.settings(),
           "timings": {"queued_s": round(job.started - job.created, 4), "run_s": round(job.finished - job.started, 4),
                       "batch_size": job.batch_size}}
    if job.request.notices:
        out["notices"] = list(job.request.notices)
    return out


async def wait_and_answer(job, queue, timeout: float, response_format: str, base_url: str):
    """Wait for `job` (at most `timeout` + 5 s; 0: no bound), then its images, or 504/409/500 in OpenAI's shape."""
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    job.add_done_callback(lambda: loop.call_soon_threadsafe(done.set))
    try:
        await asyncio.wait_for(done.wait(), timeout=(timeout + 5) if timeout else None)
    except asyncio.TimeoutError:
        queue.expire(job)
        await asyncio.wait_for(done.wait(), timeout=30)
    if job.status == "timeout":
        return error_response(504, f"job {job.id} {job.error}", code="timeout")
    if job.status == "cancelled":
        return error_response(409, f"job {job.id} was cancelled", code="cancelled")
    if job.status != "succeeded":
        return error_response(500, f"job {job.id} failed: {job.error}")
    return image_response(job, response_format, base_url)
