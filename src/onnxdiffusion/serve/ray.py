"""Scale-out on Ray (the `ray` extra): a Ray Serve deployment of the same app, and Ray Data batch rendering.

`serve --ray --replicas N`: the ingress deployment runs the same FastAPI app (one replica: it owns
the job table, so job ids, progress and cancel stay consistent); its queue hands each job to a
`Renderer` deployment with N replicas (or autoscaling bounds), whose `serve.batch` method gathers
concurrent requests and renders compatible ones as one backbone batch. In this mode progress is
reported when a job starts and ends (the steps run in another process), and cancelling a running
job drops its result.

`batch --ray`: Ray Data `map_batches` over actors, one model load per actor; each actor writes its
PNGs atomically as it finishes them, so a killed worker loses only the batch it was rendering.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np

from .batch import BatchItem, BatchOptions, render_and_write


# -- Ray Data: offline batch ------------------------------------------------------------------
class BatchRenderer:
    """A Ray Data actor: loads the model once, renders and writes each batch it is given."""

    def __init__(self, model: str | None, out: str, max_images: int, threads: int | None):
        from pathlib import Path

        from ..runtime import Pipeline

        self.pipe = Pipeline.from_folder(model, threads=threads)
        self.out, self.max_images = Path(out), max_images

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        count = len(batch["id"])
        items = [BatchItem.from_dict({k: batch[k][i] for k in batch}) for i in range(count)]
        return {"id": np.array(render_and_write(self.pipe, items, self.out, self.max_images))}


def _with_sizes(items: list[BatchItem], model) -> list[BatchItem]:
    """Explicit settings before the items become table columns (no nulls in int columns)."""
    from ..folder.artifacts import read_manifest
    from ..folder.paths import default_model_folder
    from .batch import fill_item

    manifest = read_manifest(model if model is not None else default_model_folder())
    return [fill_item(i, manifest.pipeline, manifest.recommended) for i in items]


def _init_ray(num_cpus: int | None = None) -> None:
    import ray

    if not ray.is_initialized():
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except Exception as e:  # e.g. the raylet timing out on an overloaded machine
            from ..errors import UserError

            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"Ray could not start a local cluster: {first[:300]}") from None


def render_on_ray(pending: list[BatchItem], out, options: BatchOptions, max_images: int, on_done) -> None:
    import ray

    _init_ray()
    rows = [asdict(i) for i in _with_sizes(pending, options.model)]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // options.batch_size)))
    rendered = ds.map_batches(
        BatchRenderer, batch_size=options.batch_size, concurrency=options.actors, num_cpus=1,
        fn_constructor_kwargs={"model": None if options.model is None else str(options.model), "out": str(out),
                               "max_images": max_images, "threads": options.threads},
    )
    for batch in rendered.iter_batches(batch_size=None, batch_format="numpy"):
        on_done(len(batch["id"]))


# -- Ray Serve: the service -------------------------------------------------------------------
def _request_dict(r) -> dict:
    return {k: getattr(r, k) for k in ("prompt", "negative_prompt", "n", "width", "height", "steps", "sampler",
                                       "guidance", "seed", "model", "edit")}


def run_ray_serve(config, replicas: int = 1, max_replicas: int | None = None, blocking: bool = True):
    """Deploy ingress + renderer on a local Ray cluster; blocks until interrupted when `blocking`."""
    from ray import serve

    from .render import render_mixed

    _init_ray()
    serve.start(http_options={"host": config.host, "port": config.port})
    scaling = ({"autoscaling_config": {"min_replicas": replicas, "max_replicas": max_replicas}}
               if max_replicas else {"num_replicas": replicas})

    @serve.deployment(ray_actor_options={"num_cpus": config.threads}, max_ongoing_requests=4 * config.max_batch,
                      **scaling)
    class Renderer:
        def __init__(self, cfg):
            from types import SimpleNamespace

            from .manager import ModelManager, parse_buckets

            self.manager = ModelManager(parse_buckets(cfg.buckets), cfg.golden_threshold_db, threads=cfg.threads,
                                        profile=cfg.profile, memory=cfg.memory, explicit=cfg.buckets is not None)
            self.manager.load(list(cfg.models), log=lambda m: None)
            self.manager.prepare(warmup=cfg.warmup and True, log=lambda m: None)
            self.ns = SimpleNamespace
            self.max_batch = cfg.max_batch

        @serve.batch(max_batch_size=config.max_batch, batch_wait_timeout_s=0.01)
        async def render(self, requests: list[dict]) -> list[np.ndarray]:
            import asyncio

            by_model: dict[str, list[int]] = {}
            for i, r in enumerate(requests):
                by_model.setdefault(r["model"], []).append(i)
            out: list = [None] * len(requests)
            for model, idx in by_model.items():
                entry = self.manager.models[model]
                reqs = [self.ns(**requests[i]) for i in idx]
                limit = self.max_batch if entry.batch_invariant else 1  # see ModelEntry.batch_invariant
                images = await asyncio.to_thread(render_mixed, entry.pipeline, reqs, limit)
                for i, img in zip(idx, images):
                    out[i] = img
            return out

    def build_app():
        from ray import serve as rs

        from .app import Service, create_app

        handle = rs.get_deployment_handle("Renderer", app_name="onnxdiffusion")
        # enough jobs in flight for every replica to fill its serve.batch
        n = (max_replicas or replicas) * config.max_batch
        cfg = replace(config, workers=n, max_batch=1)
        service = Service(cfg)
        service.queue.remote = lambda reqs: [handle.render.remote(_request_dict(r)).result() for r in reqs]
        return create_app(cfg, service)

    ingress = serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})(serve.ingress(build_app)())
    app = ingress.bind(Renderer.bind(config))
    if not blocking:
        return serve.run(app, name="onnxdiffusion", route_prefix="/", blocking=False)
    import signal

    import ray

    def interrupt(signum, frame):  # SIGTERM shuts down like Ctrl-C: Serve, then the local Ray cluster
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        serve.run(app, name="onnxdiffusion", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
