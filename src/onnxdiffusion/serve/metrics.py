"""Prometheus metrics of one server (its own registry, so several apps in one process never clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServeMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "onnxdiffusion_"
        self.requests = Counter(p + "requests_total", "HTTP requests by route and outcome", ["route", "outcome"], registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "Image request latency (submit to result)",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.jobs = Counter(p + "jobs_total", "Finished jobs by serving model and outcome", ["model", "outcome"], registry=r)
        self.depth = Gauge(p + "queue_depth", "Jobs waiting in the queue", registry=r)
        self.fallbacks = Counter(p + "fallbacks_total", "Requests for a degraded model served by its full-precision sibling",
                                 ["model"], registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Seconds per sampling step (whole backbone batch)", ["model"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.batch_images = Histogram(p + "batch_images", "Images per backbone batch", ["model"],
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.degraded = Gauge(p + "model_degraded", "1 when the golden check failed and traffic falls back", ["model"],
                              registry=r)
        self.golden_psnr = Gauge(p + "model_golden_psnr_db", "Worst golden-sample PSNR vs the full-precision sibling",
                                 ["model"], registry=r)

    # what the job queue calls
    def queue_depth(self, n: int) -> None:
        self.depth.set(n)

    def step(self, model: str, seconds: float) -> None:
        self.step_seconds.labels(model).observe(seconds)

    def batch(self, model: str, images: int) -> None:
        self.batch_images.labels(model).observe(images)

    def job_done(self, model: str, outcome: str, seconds: float) -> None:
        self.jobs.labels(model, outcome).inc()
        if outcome == "succeeded":
            self.latency.labels(model).observe(seconds)

    # what the app calls
    def request(self, route: str, outcome: str) -> None:
        self.requests.labels(route, outcome).inc()

    def fallback(self, model: str) -> None:
        self.fallbacks.labels(model).inc()

    def models(self, entries) -> None:
        for e in entries:
            self.degraded.labels(e.id).set(1 if e.status == "degraded" else 0)
            if e.golden_psnr_db is not None:
                self.golden_psnr.labels(e.id).set(e.golden_psnr_db)

    def render(self) -> bytes:
        return generate_latest(self.registry)
