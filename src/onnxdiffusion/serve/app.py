"""FastAPI routes over the model manager and the job queue.

Errors use OpenAI's error object `{"error": {"message", "type", "param", "code"}}`; nothing a client
sees carries a traceback (unexpected errors are logged here and answered with their type only).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sys
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import UserError
from .config import ServeConfig
from .auth import ApiKeyAuth, KeyRing
from .body import BodyLimit
from .responses import RetryLater, error_response, image_response, wait_and_answer
from .jobs import FINAL, JobConflict, JobQueue, KeyBusy, NotAccepting, QueueFull, png_bytes
from .manager import ModelManager, parse_buckets
from .metrics import ServeMetrics
from .schemas import ImageRequest, RequestError, build_request

log = logging.getLogger("onnxdiffusion.serve")


class Service:
    """What one server process holds: settings, models, queue, metrics."""

    def __init__(self, config: ServeConfig, manager: ModelManager | None = None):
        self.config = config
        self.metrics = ServeMetrics()
        self.manager = manager or ModelManager(parse_buckets(config.buckets), config.golden_threshold_db,
                                               threads=config.threads, provider=config.provider,
                                               profile=config.profile, memory=config.memory,
                                               explicit=config.buckets is not None)
        self.queue = JobQueue(self.manager, max_queue=config.max_queue, timeout=config.timeout,
                              workers=config.workers, max_batch=config.max_batch, retention=config.retention,
                              max_finished=config.max_finished, metrics=self.metrics,
                              per_key=config.per_key_limit() if config.api_keys else None,
                              max_memory=config.max_memory)
        self.load_error: str | None = None
        from .loras import LoraCatalog, adapter_files

        # on the manager, where build_request (schemas) finds it without importing this module
        self.manager.loras = LoraCatalog(adapter_files(config.lora_dir, config.loras), config.lora_cache)

    def start(self) -> None:
        """Warm up and golden-check in the background so /health answers at once and /ready says when."""
        def run():
            try:
                if not self.manager.models:
                    self.manager.load(list(self.config.models), log=_stderr)
                # before prepare(), which makes the models ready: no request sees a model whose adapters are unknown
                self.manager.loras.check(self.manager.serving(), log=_stderr)
                self.manager.prepare(warmup=self.config.warmup, log=_stderr, batch=self.config.max_batch,
                                     max_memory=self.config.max_memory)
                self.metrics.models(self.manager.models.values())
                self.queue.start()
            except UserError as e:
                self.load_error = str(e)
                log.error("model loading failed: %s", e)
            except Exception as e:  # never a dead loader thread with `error: null`: /ready says what happened
                from .manager import one_line

                self.load_error = f"{type(e).__name__}: {one_line(e)}"
                log.error("model loading failed: %s", self.load_error)
            if not self.load_error and not self.manager.serving():
                self.load_error = "; ".join(f"{e.id}: {e.error}" for e in self.manager.models.values())
        threading.Thread(target=run, name="serve-loader", daemon=True).start()

    @property
    def ready(self) -> bool:
        """Ready when warm-up is done and at least one model serves (failed ones are named in /ready)."""
        return self.manager.ready and self.load_error is None and bool(self.manager.serving())


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return {503: "rejected", 504: "timeout", 413: "too_large", 404: "not_found", 409: "conflict"}.get(
        status, "invalid" if status < 500 else "error")


def create_app(config: ServeConfig, service: Service | None = None) -> FastAPI:
    service = service or Service(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        # graceful: stop taking jobs, let in-flight ones finish for `grace` s, cancel the rest
        await asyncio.to_thread(service.queue.shutdown, config.grace)

    app = FastAPI(title="onnxdiffusion", version="0.1.0", lifespan=lifespan,
                  description="Text-to-image with ONNX Runtime: OpenAI-compatible images API, jobs with progress, "
                              "resolution buckets and golden-sample fallback.")
    app.state.service = service
    app.add_middleware(BodyLimit, limit=config.max_body, per_path={"/v1/images/edits": config.max_edit_body,
                                                                        "/sdapi/v1/img2img": config.max_edit_body,
                                                                        "/v1/jobs/edits": config.max_edit_body})
    # outermost: a caller without a key is refused before its body is read
    app.add_middleware(ApiKeyAuth, ring=KeyRing(config.api_keys), protect_metrics=config.protect_metrics)
    svc, queue, manager, metrics = service, service.queue, service.manager, service.metrics

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.request(getattr(route, "path", "other"), _outcome(response.status_code))
        return response

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"invalid JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}",
                                  code="invalid_json")
        if tuple(first.get("loc", ())) == ("body",):
            return error_response(400, "request body must be a JSON object (Content-Type: application/json)",
                                  code="invalid_body")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "missing":
            return error_response(400, f"missing required field {param!r}", param, code="missing_field")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unknown field {param!r}", param, code="unknown_field")
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__})")

    def caller(request: Request) -> str | None:
        return request.scope.get("state", {}).get("caller")

    def submit(body: ImageRequest, request: Request):
        from .edits import refuse_text_only

        def build():
            req = build_request(body, config, manager)
            refuse_text_only(manager.models[req.model])  # an editing model needs its picture (/v1/images/edits)
            return req

        return submit_built(build, request)

    def submit_built(build, request: Request):
        """Queue the JobRequest `build()` makes once the models serve (edits build their own)."""
        if svc.load_error:
            raise RequestError(f"models failed to load: {svc.load_error}", status=503)
        if not svc.ready:
            # Retry-After: the openai client (and A1111's) wait and retry a 503 that says when
            raise RetryLater("models are still loading; see GET /ready", 2, code="not_ready")
        try:
            req = build()
        except UserError as e:
            raise RequestError(str(e)) from None
        try:
            job = queue.submit(req, owner=caller(request))
        except QueueFull as e:
            metrics.request("queue", "full")
            raise RetryLater(str(e), e.retry_after) from None
        except KeyBusy as e:
            metrics.request("queue", "key_limit")
            raise RetryLater(str(e), e.retry_after, 429, "rate_limit_exceeded") from None
        except NotAccepting as e:
            raise RequestError(str(e), status=503) from None
        if req.fallback:
            metrics.fallback(req.model_requested)
        return job

    @app.exception_handler(RetryLater)
    async def on_retry(request: Request, exc: RetryLater):
        return error_response(exc.status, exc.message, code=exc.code, headers={"Retry-After": str(exc.retry_after)})

    def get_job(job_id: str, request: Request):
        """A job of this caller (another key's job is answered as unknown: ids do not leak across keys)."""
        try:
            job = queue.get(job_id)
        except KeyError:
            job = None
        if job is None or job.owner != caller(request):
            raise RequestError(f"no job {job_id!r} (unknown, or its result expired)", "id", 404, "job_not_found") from None
        return job

    _probe_and_model_routes(app, svc, manager, queue, metrics)
    _image_and_job_routes(app, config, queue, submit, get_job)
    from .edits import add_edit_route

    add_edit_route(app, config, manager, queue, submit_built)
    from .a1111 import add_a1111_routes

    add_a1111_routes(app, config, manager, queue, submit_built, caller)
    from .page_routes import add_page_routes

    add_page_routes(app, config, manager, queue, submit_built)  # what the page at / needs beyond the OpenAI routes

    if config.web:  # the browser page (export-web) at /web
        from ..web.serve import mount_web

        mount_web(app, config.web)
    return app


def _probe_and_model_routes(app: FastAPI, svc: Service, manager, queue, metrics) -> None:
    """The page, /health, /ready, /metrics and /v1/models*."""
    # -- pages and probes ---------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        from .page_routes import page_html

        return page_html()

    @app.get("/health", summary="Liveness: the process answers")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", summary="Models loaded and warmed, golden check done")
    async def ready():
        models = [m.describe() for m in manager.models.values()]
        degraded = [m["id"] for m in models if m["status"] == "degraded"]
        failed = {m["id"]: m["error"] for m in models if m["status"] == "failed"}
        body = {"ready": svc.ready, "error": svc.load_error, "models": models, "degraded": degraded,
                "failed": failed, "queue_depth": queue.depth()}
        return JSONResponse(body, status_code=200 if svc.ready else 503)

    @app.get("/metrics", summary="Prometheus text format")
    async def prometheus():
        metrics.queue_depth(queue.depth())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- models -------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [m.describe() for m in manager.models.values()],
                # the buckets some serving model runs (each model's own list is in its entry)
                "buckets": [f"{w}x{h}" for w, h in manager.buckets if any((w, h) in e.buckets for e in manager.serving())]}

    @app.get("/v1/models/{model_id}")
    async def one_model(model_id: str):
        if model_id not in manager.models:
            raise RequestError(f"unknown model {model_id!r}", "model", 404, "model_not_found")
        return manager.models[model_id].describe()

    @app.post("/v1/models/{model_id}/check", summary="Re-run the golden-sample check now")
    async def check_model(model_id: str):
        if model_id not in manager.models:
            raise RequestError(f"unknown model {model_id!r}", "model", 404, "model_not_found")
        if not svc.ready:
            raise RequestError("models are still loading; see GET /ready", status=503, code="not_ready")
        entry = await asyncio.to_thread(manager.check, model_id)
        metrics.models([entry])
        return entry.describe()



def _image_and_job_routes(app: FastAPI, config: ServeConfig, queue, submit, get_job) -> None:
    """/v1/images/generations and the job routes (status, result, images, events, cancel)."""
    # -- images -------------------------------------------------------------------------------
    @app.post("/v1/images/generations", summary="OpenAI-compatible: wait for the images")
    async def generations(body: ImageRequest, request: Request):
        # an adapter set seen first is converted while the request is checked: off the event loop
        job = await asyncio.to_thread(submit, body, request) if body.lora else submit(body, request)
        return await wait_and_answer(job, queue, config.timeout, body.response_format, str(request.base_url))

    # -- jobs ---------------------------------------------------------------------------------
    @app.post("/v1/jobs", status_code=202, summary="Queue a job; returns its id at once")
    async def create_job(body: ImageRequest, request: Request):
        job = await asyncio.to_thread(submit, body, request) if body.lora else submit(body, request)
        return job.snapshot(queue.position(job))

    @app.get("/v1/jobs/{job_id}", summary="Status, queue position, step progress")
    async def job_status(job_id: str, request: Request):
        job = get_job(job_id, request)
        return job.snapshot(queue.position(job))

    @app.get("/v1/jobs/{job_id}/result", summary="The finished job as an images response")
    async def job_result(job_id: str, request: Request, response_format: str = "b64_json"):
        job = get_job(job_id, request)
        if job.status != "succeeded":
            raise RequestError(f"job {job_id} is {job.status}, no images", "id", 409, "not_succeeded")
        return image_response(job, response_format, str(request.base_url))

    @app.get("/v1/jobs/{job_id}/images/{index}", summary="One finished image as PNG")
    async def job_image(job_id: str, index: int, request: Request):
        job = get_job(job_id, request)
        if job.status != "succeeded":
            raise RequestError(f"job {job_id} is {job.status}, no images", "id", 409, "not_succeeded")
        if not 0 <= index < len(job.images):
            raise RequestError(f"image index must be in 0..{len(job.images) - 1}", "index", 404)
        return Response(png_bytes(job.images[index]), media_type="image/png")

    @app.get("/v1/jobs/{job_id}/events", summary="Server-sent events: progress (and previews) until the job ends")
    async def job_events(job_id: str, request: Request):
        job = get_job(job_id, request)

        async def stream():
            seen = -1
            while True:
                version, final = job.version, job.status in FINAL
                if version != seen:
                    seen = version
                    snap = job.snapshot(queue.position(job))
                    if job.preview_png is not None:
                        snap["preview"] = base64.b64encode(job.preview_png).decode()
                    yield f"event: {'done' if final else 'progress'}\ndata: {json.dumps(snap)}\n\n"
                if final:
                    return
                await asyncio.sleep(0.05)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.delete("/v1/jobs/{job_id}", summary="Cancel this job (queued: now; running: at the next step)")
    async def cancel_job(job_id: str, request: Request):
        get_job(job_id, request)  # another key's job is unknown here
        try:
            job = queue.cancel(job_id)
        except KeyError:
            raise RequestError(f"no job {job_id!r} (unknown, or its result expired)", "id", 404, "job_not_found") from None
        except JobConflict as e:
            raise RequestError(str(e), "id", 409, "job_finished") from None
        snap = job.snapshot(queue.position(job))
        snap["cancel_requested"] = True
        return snap



def run_server(config: ServeConfig) -> None:
    """Serve until interrupted (SIGINT/SIGTERM shut down gracefully, see `ServeConfig.grace`)."""
    import uvicorn

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    service = Service(config)
    service.manager.load(list(config.models), log=_stderr)  # bad folders or buckets fail here, before listening
    app = create_app(config, service)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=config.grace + 5)
