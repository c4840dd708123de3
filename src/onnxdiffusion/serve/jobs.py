"""Jobs: a bounded queue, worker threads, per-step progress, cancellation, timeouts, micro-batching.

A worker takes the oldest queued job plus any queued jobs it is compatible with (same serving
model, bucket, steps, sampler and guidance) up to `max_batch` images, and runs them as one backbone
batch through `Pipeline.iter_generate`. Each job's initial latents (and ancestral noise) are drawn
from its own seed exactly as `generate --seed S --batch n` draws them, so a batched job's image
equals the image of the same request run alone. Between steps the worker publishes progress and
drops cancelled or timed-out jobs; when none is left it stops the loop.
"""

from __future__ import annotations

import io
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelRunError, UserError
from .job_request import JobRequest

FINAL = ("succeeded", "failed", "cancelled", "timeout")


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class KeyBusy(Exception):
    """One caller holds its share of jobs already (serve's per-key limit)."""

    def __init__(self, limit: int, retry_after: int):
        super().__init__(f"this API key already has {limit} jobs queued or running (the per-key limit); "
                         f"retry after {retry_after} s")
        self.limit, self.retry_after = limit, retry_after


class NotAccepting(Exception):
    """The server is shutting down."""


class JobConflict(Exception):
    """The job exists but is already finished (nothing to cancel)."""


@dataclass
class Job:
    request: JobRequest
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: str = "queued"  # queued | running | succeeded | failed | cancelled | timeout
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    step: int = 0
    error: str | None = None
    images: np.ndarray | None = None
    preview_png: bytes | None = None
    # previews asked for while it runs (A1111's /progress): decoded from the next step on, not for unwatched jobs
    watched: bool = False
    batch_size: int = 0  # images in the backbone batch this job ran in
    owner: str | None = None  # the caller (`key-N`) when the server has API keys; None: open server
    cancel_requested: bool = False
    version: int = 0  # bumps on every visible change (SSE polls it)
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    _callbacks: list = field(default_factory=list, repr=False)

    def add_done_callback(self, fn) -> None:
        """fn() runs once the job is final (at once if it already is); used to wake async waiters."""
        if self.done.is_set():
            fn()
        else:
            self._callbacks.append(fn)

    def _finish(self, status: str, error: str | None = None) -> None:
        if self.status in FINAL:
            return
        self.status, self.error, self.finished = status, error, time.time()
        self.version += 1
        self.done.set()
        for fn in self._callbacks:
            fn()

    def snapshot(self, position: int | None = None) -> dict:
        r = self.request
        return {
            "id": self.id, "object": "job", "status": self.status, "queue_position": position,
            "step": self.step, "steps": r.steps, "progress": round(self.step / r.steps, 4) if r.steps else 0.0,
            "created": self.created, "started": self.started, "finished": self.finished, "error": self.error,
            "batch_size": self.batch_size, "settings": r.settings(),
            "images": [f"/v1/jobs/{self.id}/images/{i}" for i in range(r.n)] if self.status == "succeeded" else [],
        }


def _log_stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def png_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


class NullMetrics:
    def __getattr__(self, name):
        return lambda *a, **k: None


class JobQueue:
    def __init__(self, manager, max_queue: int = 64, timeout: float = 120.0, workers: int = 1, max_batch: int = 4,
                 retention: float = 600.0, max_finished: int = 512, preview_every: int = 1, metrics=None,
                 remote=None, per_key: int | None = None, max_memory: int | None = None):
        self.manager = manager
        self.max_queue, self.timeout, self.workers, self.max_batch = max_queue, timeout, workers, max_batch
        self.retention, self.max_finished, self.preview_every = retention, max_finished, preview_every
        self.metrics = metrics or NullMetrics()
        self.per_key = per_key  # queued + running jobs one owner may hold (None: no bound)
        self.max_memory = max_memory  # bytes a backbone batch may need (micro-batches stop below it)
        self.remote = remote  # callable(list[JobRequest]) -> list of (n, H, W, 3) arrays, or None: render here
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.pending: list[Job] = []
        self.cv = threading.Condition()
        self.accepting = True
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._job_seconds = 1.0  # moving average, for Retry-After
        self._served: dict = {}  # owner -> the turn it was last served (fair order between API keys)
        self._turn = 0

    # -- client side --------------------------------------------------------------------------
    def start(self) -> None:
        for i in range(self.workers):
            t = threading.Thread(target=self._worker, name=f"serve-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, request: JobRequest, owner: str | None = None) -> Job:
        job = Job(request, owner=owner)
        with self.cv:
            if not self.accepting:
                raise NotAccepting("server is shutting down")
            retry = max(1, int(np.ceil(len(self.pending) * self._job_seconds / max(1, self.workers))))
            if len(self.pending) >= self.max_queue:
                raise QueueFull(retry)
            if owner is not None and self.per_key is not None:
                held = sum(1 for j in self.jobs.values() if j.owner == owner and j.status in ("queued", "running"))
                if held >= self.per_key:
                    raise KeyBusy(self.per_key, retry)
            self._prune()
            self.jobs[job.id] = job
            self.pending.append(job)
            self.metrics.queue_depth(len(self.pending))
            self.cv.notify()
        return job

    def get(self, job_id: str) -> Job:
        with self.cv:
            self._prune()
            job = self.jobs.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return job

    def position(self, job: Job) -> int | None:
        """0-based place among queued jobs; None once it runs or is finished."""
        with self.cv:
            try:
                return self.pending.index(job)
            except ValueError:
                return None

    def cancel(self, job_id: str) -> Job:
        """Cancel one job: a queued job at once, a running one at its next step boundary."""
        job = self.get(job_id)
        with self.cv:
            if job.status in FINAL:
                raise JobConflict(f"job {job_id} is already {job.status}")
            job.cancel_requested = True
            if job in self.pending:
                self.pending.remove(job)
                self.metrics.queue_depth(len(self.pending))
                self._end(job, "cancelled", "cancelled by request")
        return job

    def expire(self, job: Job) -> None:
        """A waiter gave up after the timeout: a queued job ends now, a running one at its next step."""
        with self.cv:
            if job in self.pending:
                self.pending.remove(job)
                self.metrics.queue_depth(len(self.pending))
                self._end(job, "timeout", f"timed out after {self.timeout:g} s in the queue")

    def depth(self) -> int:
        return len(self.pending)

    def running(self) -> int:
        return sum(1 for j in list(self.jobs.values()) if j.status == "running")

    def shutdown(self, grace: float = 10.0) -> None:
        """Stop accepting; let queued and running jobs finish for `grace` s, then cancel what is left."""
        with self.cv:
            self.accepting = False
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.pending or self.running()):
            time.sleep(0.05)
        with self.cv:
            for job in self.pending:
                job._finish("cancelled", "server shut down before the job started")
            self.pending.clear()
            for job in self.jobs.values():
                if job.status == "running":
                    job.cancel_requested = True
            self._stop = True
            self.cv.notify_all()
        for t in self._threads:
            t.join(timeout=30)

    def _prune(self) -> None:
        """Bounded retention of finished jobs: older than `retention` s, or beyond `max_finished`."""
        now = time.time()
        finished = [j for j in self.jobs.values() if j.status in FINAL]
        excess = len(finished) - self.max_finished
        for j in finished:
            if excess > 0 or now - (j.finished or now) > self.retention:
                self.jobs.pop(j.id, None)
                excess -= 1

    # -- worker side --------------------------------------------------------------------------
    def _take_batch(self) -> list[Job] | None:
        with self.cv:
            while not self.pending and not self._stop:
                self.cv.wait(0.5)
            if self._stop:
                return None
            first = self._next_fair()
            self.pending.remove(first)
            batch, images = [first], first.request.n
            key = first.request.batch_key()
            entry = self.manager.models.get(first.request.model)
            if entry is not None and not entry.serving:  # failed while this job waited
                self._end(first, "failed", f"model {entry.id} is unavailable: {entry.error}")
                return []
            mates = list(self.pending) if entry is None or entry.batch_invariant else []
            for job in mates:
                if images + job.request.n > self.max_batch:
                    continue
                if self.max_memory is not None and entry is not None and self.manager.estimate_bytes(
                        entry, images + job.request.n, first.request.width, first.request.height) > self.max_memory:
                    continue
                if job.request.batch_key() == key:
                    self.pending.remove(job)
                    batch.append(job)
                    images += job.request.n
            now = time.time()
            for job in batch:
                job.status, job.started, job.batch_size = "running", now, images
                job.version += 1
            self.metrics.queue_depth(len(self.pending))
            return batch

    def _next_fair(self) -> Job:
        """The oldest queued job of the owner with the fewest running jobs, ties to the owner served least
        recently (round-robin between callers; with no keys every owner is None and this is plain FIFO)."""
        running: dict = {}
        for j in self.jobs.values():
            if j.status == "running":
                running[j.owner] = running.get(j.owner, 0) + 1
        job = min(self.pending, key=lambda j: (running.get(j.owner, 0), self._served.get(j.owner, -1)))
        self._turn += 1
        self._served[job.owner] = self._turn
        return job

    def _worker(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                self._run_batch(batch)
            except UserError as e:
                if isinstance(e, ModelRunError) and hasattr(self.manager, "fault"):  # the graph raised mid-run
                    self.manager.fault(batch[0].request.model, e, log=_log_stderr)
                for job in batch:
                    self._end(job, "failed", str(e))
            except Exception as e:  # keep the worker alive; the message, not a traceback, reaches the client
                import logging

                from .manager import one_line

                logging.getLogger("onnxdiffusion.serve").error("batch of %s failed: %s: %s", batch[0].request.model,
                                                               type(e).__name__, one_line(e))
                # a session that raised: reload it or take it out of service, before its jobs end, so a client
                # that sees the failure sees the model's new state in /ready
                if hasattr(self.manager, "fault"):
                    self.manager.fault(batch[0].request.model, e, log=_log_stderr)
                for job in batch:
                    self._end(job, "failed", f"internal error in model {job.request.model}: {type(e).__name__} "
                                             f"(the model is reloaded, or marked failed in /ready)")
            dt = time.perf_counter() - t0
            self._job_seconds = 0.8 * self._job_seconds + 0.2 * dt
            self.metrics.batch(batch[0].request.model, sum(j.request.n for j in batch))

    def _end(self, job: Job, status: str, error: str | None = None) -> None:
        if job.status in FINAL:
            return
        job._finish(status, error)
        self.metrics.job_done(job.request.model, status, job.finished - job.created)

    def _expired(self, job: Job) -> bool:
        return self.timeout > 0 and time.time() - job.created > self.timeout

    def _run_batch(self, batch: list[Job]) -> None:
        from ..runtime import GenerationResult
        from .render import seeded_inputs

        r0 = batch[0].request
        pipe = self.manager.models[r0.model].pipeline
        for job in batch:  # timed out or cancelled while waiting
            if self._expired(job):
                self._end(job, "timeout", f"timed out after {self.timeout:g} s in the queue")
        live = [j for j in batch if j.status == "running"]
        if not live:
            return
        if self.remote is not None:  # rendered elsewhere (Ray replicas): no per-step events
            for job, images in zip(live, self.remote([j.request for j in live])):
                if job.status == "running":
                    job.images, job.step = images, r0.steps
                    self._end(job, "cancelled" if job.cancel_requested else "succeeded",
                              "cancelled by request" if job.cancel_requested else None)
            return
        events = pipe.iter_generate(**seeded_inputs(pipe, [j.request for j in live]))
        offsets = np.cumsum([0] + [j.request.n for j in live])
        t_step = time.perf_counter()
        for event in events:
            if isinstance(event, GenerationResult):
                for job, a, b in zip(live, offsets[:-1], offsets[1:]):
                    if job.status == "running":
                        job.images = event.images[a:b]
                        job.step = r0.steps
                        self._end(job, "succeeded")
                return
            now = time.perf_counter()
            self.metrics.step(r0.model, now - t_step)
            t_step = now
            for job, a in zip(live, offsets[:-1]):
                if job.status != "running":
                    continue
                if job.cancel_requested:
                    self._end(job, "cancelled", "cancelled by request")
                elif self._expired(job):
                    self._end(job, "timeout", f"timed out after {self.timeout:g} s at step {event.step + 1}")
                else:
                    job.step = event.step + 1
                    if (job.request.preview or job.watched) and (job.step % self.preview_every == 0 or job.step == r0.steps):
                        job.preview_png = self._preview(pipe, event.denoised[a : a + 1])
                    job.version += 1
            if all(j.status in FINAL for j in live):
                events.close()  # nobody is waiting for this batch any more
                return

    @staticmethod
    def _preview(pipe, denoised: np.ndarray) -> bytes:
        """The step's x0 estimate, decoded and shrunk to at most 64 px: a cheap look at where it goes."""
        from PIL import Image

        from ..families.tiny_vae import DECODER

        # a folder's tiny autoencoder, when it has one: a glance at the x0 estimate need not cost a VAE decode
        decoder = "tiny" if DECODER in pipe.manifest.components else "full"
        img = Image.fromarray(pipe.decode(denoised, decoder=decoder)[0])
        img.thumbnail((64, 64))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()
