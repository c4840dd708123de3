"""The model manager: model folders loaded once, warmed up, routed by id; buckets; golden-sample check.

An optimized folder (its manifest has a `quantization` section) is compared at start-up with its
full-precision sibling on fixed golden prompts; below the PSNR threshold it is marked degraded and
`route()` sends its traffic to the sibling, saying so (`fallback`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError

# Fixed, so every start-up and every re-check renders the same images.
GOLDEN_PROMPTS = (
    "a small red circle on the left",
    "a blue star above a yellow square",
    "a large green triangle",
    "a purple square below an orange circle",
)
GOLDEN_SETTINGS = {"steps": 10, "guidance": 4.0, "seed": 1234}  # sampler: the folder's own (ddim on SD)


def parse_size(text: str) -> tuple[int, int]:
    """'WIDTHxHEIGHT' (OpenAI's size form) -> (width, height)."""
    w, sep, h = str(text).lower().partition("x")
    if not sep or not w.strip().isdigit() or not h.strip().isdigit():
        raise UserError(f"size must look like 64x64 (WIDTHxHEIGHT), got {text!r}")
    return int(w), int(h)


# Sizes tried when `--buckets` is not given: each model keeps its trained size (first) and those of these its
# family's limits allow, so any model serves with no flag.
DEFAULT_BUCKETS = "64x64,128x128,96x96,64x128,128x64"


def parse_buckets(text: str | None) -> tuple[tuple[int, int], ...]:
    """'64x64,128x128' -> ((64, 64), (128, 128)); order kept, duplicates dropped; None: the default candidates."""
    if text is None:
        text = DEFAULT_BUCKETS
    out: list[tuple[int, int]] = []
    for item in str(text).split(","):
        if item.strip():
            size = parse_size(item.strip())
            if min(size) <= 0:
                raise UserError(f"bucket sides must be positive, got {item!r}")
            if size not in out:
                out.append(size)
    if not out:
        raise UserError("--buckets needs at least one WIDTHxHEIGHT")
    return tuple(out)


def nearest_bucket(width: int, height: int, buckets: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The bucket closest in log-size (aspect and scale both count); ties go to the first listed."""
    lw, lh = math.log(width), math.log(height)
    return min(buckets, key=lambda b: (abs(math.log(b[0]) - lw) + abs(math.log(b[1]) - lh)))


@dataclass
class ModelEntry:
    id: str
    folder: Path
    pipeline: object  # runtime.Pipeline (imported lazily); None when the folder failed to load
    precision: str  # "fp32" or the quantization recipe name
    unet_sha256: str | None
    quantized_from: str | None  # sha256 of the fp32 backbone it came from
    sibling: str | None = None  # id of the full-precision model it falls back to
    status: str = "ok"  # ok | degraded | unchecked | failed (load, warm-up or a session fault: not served)
    # False when a request's image depends on its batch-mates (e.g. int8-dynamic: one activation scale
    # per tensor over the whole batch); such a model is never micro-batched. Probed at start-up.
    batch_invariant: bool = True
    golden_psnr_db: float | None = None
    checked_at: float | None = None
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0
    buckets: tuple[tuple[int, int], ...] = ()  # the server's buckets this model can run (the first: its default)
    dropped: tuple[str, ...] = ()  # buckets left out, each with the limit it breaks
    limits: dict | None = None  # families.SizeLimits.describe()
    error: str | None = None  # why it is failed (one line)
    faults: int = 0  # sessions that raised mid-job
    reloads: int = 0  # successful reloads after a fault
    loras: tuple[str, ...] | None = None  # adapters it serves (serve/loras.py); None: no LoRA insertion points

    @property
    def optimized(self) -> bool:
        return self.quantized_from is not None

    @property
    def serving(self) -> bool:
        return self.status != "failed"

    def describe(self) -> dict:
        out = {
            "id": self.id, "object": "model", "owned_by": "onnxdiffusion", "precision": self.precision,
            "status": self.status, "error": self.error, "fallback_to": self.sibling if self.status == "degraded" else None,
            "sibling": self.sibling, "batch_invariant": self.batch_invariant, "golden_psnr_db": self.golden_psnr_db, "checked_at": self.checked_at,
            "load_seconds": round(self.load_seconds, 3), "warmup_seconds": round(self.warmup_seconds, 3),
            "buckets": [f"{w}x{h}" for w, h in self.buckets], "dropped_buckets": list(self.dropped),
            "size_limits": self.limits, "faults": self.faults, "reloads": self.reloads,
        }
        if self.loras is not None:  # only a folder with insertion points takes adapters
            out["loras"] = list(self.loras)
        return out

    def fail(self, error: str) -> None:
        self.status, self.error = "failed", one_line(error)


def one_line(message: object, limit: int = 400) -> str:
    """An error for /ready and the log: its first line, bounded (ORT's messages run to pages)."""
    text = str(message).strip().splitlines()[0] if str(message).strip() else type(message).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def model_spec(text: str) -> tuple[str | None, Path]:
    """'NAME=FOLDER' or 'FOLDER' (the id is then the folder's name)."""
    name, sep, path = str(text).partition("=")
    if sep and name and "/" not in name:
        return name, Path(path)
    return None, Path(text)


class ModelManager:
    def __init__(self, buckets: tuple[tuple[int, int], ...], threshold_db: float = 30.0,
                 threads: int | None = 1, provider: str = "cpu", profile: str | None = None, memory: str | None = None,
                 explicit: bool = True):
        self.buckets = buckets
        # False: `buckets` are candidates (no --buckets): each model takes its trained size and the candidates
        # it can run, and a candidate no model runs is dropped quietly; True: the operator's list, all of it served
        self.explicit = explicit
        self.threshold_db = threshold_db
        self.threads = threads
        self.provider = provider
        self.profile = profile
        self.memory = memory
        self.models: dict[str, ModelEntry] = {}
        self.ready = False
        self._locks: dict = {}
        self.loras = None  # the served LoRA adapters (serve/loras.LoraCatalog), set by the service

    # -- loading ------------------------------------------------------------------------------
    def load(self, specs: list[str], log=print) -> None:
        """Open every folder (hashes verified) and keep the buckets each can run; fast, so bad input fails at
        once. With several models, one that fails to load is kept as `failed` (named in /ready) and the
        others serve; when none loads, or a bucket fits no model, that is an error."""
        from ..folder.paths import default_model_folder

        if not specs:
            specs = [str(default_model_folder())]
        first_error: UserError | None = None
        for spec in specs:
            name, folder = model_spec(spec)
            model_id = name or folder.resolve().name
            if model_id in self.models:
                raise UserError(f"two models are named {model_id!r}; name them with NAME=FOLDER")
            try:
                entry = self._open(model_id, folder)
            except UserError as e:
                first_error = first_error or e
                entry = ModelEntry(id=model_id, folder=folder, pipeline=None, precision="unknown", unet_sha256=None,
                                   quantized_from=None)
                entry.fail(f"load failed: {e}")
                log(f"{model_id}: {entry.error}")
            self.models[model_id] = entry
            if entry.serving:
                log(f"loaded {model_id} ({entry.precision}) in {entry.load_seconds:.2f}s; buckets "
                    f"{', '.join(f'{w}x{h}' for w, h in entry.buckets)}"
                    + (f"; dropped {', '.join(d.split(':')[0] for d in entry.dropped)} ({entry.dropped[0].split(': ', 1)[1]})"
                       if entry.dropped else ""))
        if not any(e.serving for e in self.models.values()):
            raise first_error or UserError("no model could be loaded")
        unused = [b for b in self.buckets if not any(b in e.buckets for e in self.models.values())]
        if not self.explicit:  # the served sizes: every model's own, in the order first seen
            self.buckets = tuple(dict.fromkeys(b for e in self.models.values() for b in e.buckets))
        elif unused:
            why = "; ".join(d for e in self.models.values() for d in e.dropped if d.split(":")[0] in
                            {f"{w}x{h}" for w, h in unused})
            raise UserError(f"bucket(s) {', '.join(f'{w}x{h}' for w, h in unused)} fit no served model ({why})")
        self._link_siblings()

    def _open(self, model_id: str, folder: Path) -> ModelEntry:
        from ..runtime import Pipeline
        from ..runtime.guards import size_limits

        t0 = time.perf_counter()
        if self.loras is not None and self.loras.files:  # adapters served: a plain export gets its points copy
            import sys

            from ..adapters.folder import with_points

            folder = with_points(folder, log=lambda m: print(m, file=sys.stderr, flush=True))
        pipe = Pipeline.from_folder(folder, provider=self.provider, threads=self.threads, profile=self.profile,
                                    memory=self.memory)
        limits = size_limits(pipe.manifest)
        kept, dropped = [], []
        trained = (pipe.info.default_width, pipe.info.default_height)
        for w, h in self.buckets if self.explicit else dict.fromkeys((trained, *self.buckets)):
            problem = limits.problem(h, w)
            (dropped.append(f"{w}x{h}: {problem}") if problem else kept.append((w, h)))
        if not kept:
            raise UserError(f"no bucket fits model {model_id}: {'; '.join(dropped)}")
        backbone = pipe.manifest.components[pipe.family.backbone]
        return ModelEntry(
            id=model_id, folder=folder, pipeline=pipe,
            precision=backbone.precision or "fp32",
            unet_sha256=pipe.manifest.files.get(backbone.path),
            quantized_from=(backbone.quantized_from or {}).get("sha256"),
            load_seconds=time.perf_counter() - t0, buckets=tuple(kept), dropped=tuple(dropped),
            limits=limits.describe(),
        )

    def prepare(self, warmup: bool = True, log=print, batch: int = 1, max_memory: int | None = None) -> None:
        """Warm every model up at each of its buckets, then golden-check the optimized ones; then ready.
        Warm-up runs the largest micro-batch (`batch` images, fewer where `max_memory` says so) at the model's
        own guidance, so ONNX Runtime's plans and arenas reach their high-water mark now, not under load.
        A model whose warm-up (or probe) raises is marked failed with the reason; the others go on."""
        for entry in self.serving():
            try:
                t0 = time.perf_counter()
                if warmup:
                    for w, h in entry.buckets:  # one step per bucket: ORT plans each shape now, not on a request
                        b = batch
                        while b > 1 and max_memory is not None and self.estimate_bytes(entry, b, w, h) > max_memory:
                            b -= 1
                        from ..runtime.references import probe_feeds

                        entry.pipeline(prompt=[""] * b, batch=b, steps=1, width=w, height=h,
                                       **probe_feeds(entry.pipeline, w, h))
                entry.warmup_seconds = time.perf_counter() - t0
                entry.batch_invariant = self.probe_batch_invariance(entry)
            except Exception as e:  # a model that cannot run is reported, never the reason the others stop
                entry.fail(f"warm-up failed: {type(e).__name__}: {one_line(e)}" if not isinstance(e, UserError)
                           else f"warm-up failed: {e}")
                log(f"{entry.id}: {entry.error}")
                continue
            if not entry.batch_invariant:
                log(f"{entry.id}: images depend on batch-mates; micro-batching is off for it")
        for entry in self.serving():
            if entry.optimized:
                try:
                    self.check(entry.id)
                except Exception as e:
                    entry.fail(f"golden check failed: {one_line(e)}")
                psnr = "n/a" if entry.golden_psnr_db is None else f"{entry.golden_psnr_db:.1f} dB"
                log(f"golden check {entry.id}: {entry.status} ({entry.error or psnr} vs {entry.sibling})")
        self.ready = True

    def fault(self, model_id: str, error: BaseException, log=print) -> ModelEntry:
        """A session of `model_id` raised mid-job (not a bad request): reload the folder and run one step at
        its default bucket; if that works the reload serves, else the model is marked failed with the reason."""
        import threading

        entry = self.get(model_id)
        lock = self._locks.setdefault(model_id, threading.Lock())
        with lock:  # concurrent batches of one model that fault together reload it once
            entry.faults += 1
            if not entry.serving:
                return entry
            failing = entry.pipeline
            if getattr(failing, "_od_replaced", False):
                return entry  # another batch already reloaded it
            reason = f"{type(error).__name__}: {one_line(error)}"
            log(f"{model_id}: session fault mid-job ({reason}); reloading")
            try:
                fresh = self._open(model_id, entry.folder).pipeline
                w, h = entry.buckets[0]
                fresh(prompt="", steps=1, guidance=1.0, width=w, height=h)
            except Exception as e:
                entry.fail(f"session fault mid-job ({reason}); reload failed: {one_line(e)}")
                log(f"{model_id}: {entry.error}")
                return entry
            failing._od_replaced = True
            entry.pipeline, entry.reloads = fresh, entry.reloads + 1
            log(f"{model_id}: reloaded after the fault")
        return entry

    def estimate_bytes(self, entry: ModelEntry, images: int, width: int, height: int) -> int:
        """runtime.guards' activation estimate for one backbone batch of `images` at this size."""
        from ..runtime.generation import GenerateOptions
        from ..runtime.guards import latent_shape, memory_estimate

        pipe = entry.pipeline
        shape = latent_shape(pipe.info, GenerateOptions(batch=images, width=width, height=height))
        return memory_estimate(pipe.folder, pipe.manifest, shape)

    def serving(self) -> list[ModelEntry]:
        return [e for e in self.models.values() if e.serving]

    def _link_siblings(self) -> None:
        """An optimized model's sibling: the loaded full-precision model its backbone was made from."""
        full = [e for e in self.models.values() if not e.optimized]
        for entry in self.models.values():
            if not entry.optimized:
                continue
            same = [e for e in full if e.unet_sha256 == entry.quantized_from]
            entry.sibling = same[0].id if same else (full[0].id if len(full) == 1 else None)
            if entry.sibling is None:
                entry.status = "unchecked"

    def probe_batch_invariance(self, entry: ModelEntry) -> bool:
        from .render import batch_invariant

        if entry.pipeline.family.image_role == "reference":
            return True  # an editing model renders only edits, and an edit renders alone (never micro-batched)
        return batch_invariant(entry.pipeline, *entry.buckets[0])

    # -- golden-sample check ------------------------------------------------------------------
    def golden_images(self, entry: ModelEntry) -> np.ndarray:
        from ..runtime.references import probe_feeds

        w, h = self.models[entry.id].buckets[0]
        result = entry.pipeline(list(GOLDEN_PROMPTS), batch=len(GOLDEN_PROMPTS), width=w, height=h, **GOLDEN_SETTINGS,
                                **probe_feeds(entry.pipeline, w, h))
        return result.images

    def check(self, model_id: str) -> ModelEntry:
        """Render the golden prompts with `model_id` and its sibling; degrade it below the threshold."""
        from ..evaluate.metrics import psnr

        entry = self.get(model_id)
        if not entry.optimized:
            entry.status, entry.checked_at = "ok", time.time()
            return entry
        if entry.sibling is None:
            entry.status = "unchecked"
            return entry
        if not self.models[entry.sibling].serving:
            entry.status = "unchecked"
            return entry
        ref = self.golden_images(self.models[entry.sibling])
        got = self.golden_images(entry)
        value = min(psnr(a, b) for a, b in zip(got, ref))  # the worst golden image decides
        entry.golden_psnr_db = None if not math.isfinite(value) else round(float(value), 2)
        entry.status = "ok" if not math.isfinite(value) or value >= self.threshold_db else "degraded"
        entry.checked_at = time.time()
        return entry

    # -- routing ------------------------------------------------------------------------------
    def get(self, model_id: str) -> ModelEntry:
        if model_id not in self.models:
            raise UserError(f"unknown model {model_id!r}; available: {', '.join(self.models)}")
        return self.models[model_id]

    @property
    def default_id(self) -> str:
        """The first loaded model that serves (a failed first model does not take the default with it)."""
        return next((e.id for e in self.models.values() if e.serving), next(iter(self.models)))

    def route(self, model_id: str | None) -> tuple[ModelEntry, ModelEntry]:
        """(requested, serving): a degraded model is served by its full-precision sibling."""
        requested = self.get(model_id or self.default_id)
        if requested.status == "degraded" and requested.sibling and self.models[requested.sibling].serving:
            return requested, self.models[requested.sibling]
        return requested, requested

    def snap(self, entry: ModelEntry, width: int, height: int) -> tuple[int, int]:
        return nearest_bucket(width, height, entry.buckets)

