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
GOLDEN_SETTINGS = {"steps": 10, "sampler": "ddim", "guidance": 4.0, "seed": 1234}


def parse_size(text: str) -> tuple[int, int]:
    """'WIDTHxHEIGHT' (OpenAI's size form) -> (width, height)."""
    w, sep, h = str(text).lower().partition("x")
    if not sep or not w.strip().isdigit() or not h.strip().isdigit():
        raise UserError(f"size must look like 64x64 (WIDTHxHEIGHT), got {text!r}")
    return int(w), int(h)


def parse_buckets(text: str) -> tuple[tuple[int, int], ...]:
    """'64x64,128x128' -> ((64, 64), (128, 128)); order kept, duplicates dropped."""
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
    pipeline: object  # runtime.Pipeline (imported lazily)
    precision: str  # "fp32" or the quantization recipe name
    unet_sha256: str | None
    quantized_from: str | None  # sha256 of the fp32 backbone it came from
    sibling: str | None = None  # id of the full-precision model it falls back to
    status: str = "ok"  # ok | degraded | unchecked
    # False when a request's image depends on its batch-mates (e.g. int8-dynamic: one activation scale
    # per tensor over the whole batch); such a model is never micro-batched. Probed at start-up.
    batch_invariant: bool = True
    golden_psnr_db: float | None = None
    checked_at: float | None = None
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0

    @property
    def optimized(self) -> bool:
        return self.quantized_from is not None

    def describe(self) -> dict:
        return {
            "id": self.id, "object": "model", "owned_by": "onnxdiffusion", "precision": self.precision,
            "status": self.status, "fallback_to": self.sibling if self.status == "degraded" else None,
            "sibling": self.sibling, "batch_invariant": self.batch_invariant, "golden_psnr_db": self.golden_psnr_db, "checked_at": self.checked_at,
            "load_seconds": round(self.load_seconds, 3), "warmup_seconds": round(self.warmup_seconds, 3),
        }


def model_spec(text: str) -> tuple[str | None, Path]:
    """'NAME=FOLDER' or 'FOLDER' (the id is then the folder's name)."""
    name, sep, path = str(text).partition("=")
    if sep and name and "/" not in name:
        return name, Path(path)
    return None, Path(text)


class ModelManager:
    def __init__(self, buckets: tuple[tuple[int, int], ...], threshold_db: float = 30.0,
                 threads: int | None = 1, provider: str = "cpu", profile: str | None = None, memory: str | None = None):
        self.buckets = buckets
        self.threshold_db = threshold_db
        self.threads = threads
        self.provider = provider
        self.profile = profile
        self.memory = memory
        self.models: dict[str, ModelEntry] = {}
        self.ready = False

    # -- loading ------------------------------------------------------------------------------
    def load(self, specs: list[str], log=print) -> None:
        """Open every folder (hashes verified) and check the buckets fit it; fast, so bad input fails at once."""
        from ..paths import default_model_folder
        from ..runtime import Pipeline

        if not specs:
            specs = [str(default_model_folder())]
        for spec in specs:
            name, folder = model_spec(spec)
            model_id = name or folder.resolve().name
            if model_id in self.models:
                raise UserError(f"two models are named {model_id!r}; name them with NAME=FOLDER")
            t0 = time.perf_counter()
            pipe = Pipeline.from_folder(folder, provider=self.provider, threads=self.threads, profile=self.profile,
                                        memory=self.memory)
            self._check_buckets(model_id, pipe)
            unet = pipe.manifest["components"][pipe.family.backbone]  # named by the model family
            entry = ModelEntry(
                id=model_id, folder=folder, pipeline=pipe,
                precision=unet.get("precision", "fp32"),
                unet_sha256=pipe.manifest.get("files", {}).get(unet["path"]),
                quantized_from=(unet.get("quantized_from") or {}).get("sha256"),
                load_seconds=time.perf_counter() - t0,
            )
            self.models[model_id] = entry
            log(f"loaded {model_id} ({entry.precision}) in {entry.load_seconds:.2f}s")
        self._link_siblings()

    def prepare(self, warmup: bool = True, log=print) -> None:
        """Warm every model up at every bucket, then golden-check the optimized ones; then ready."""
        if warmup:
            for entry in self.models.values():
                t0 = time.perf_counter()
                for w, h in self.buckets:  # one step per bucket: ORT plans each shape now, not on a user's request
                    entry.pipeline(prompt="", steps=1, guidance=1.0, width=w, height=h)
                entry.warmup_seconds = time.perf_counter() - t0
        for entry in self.models.values():
            entry.batch_invariant = self.probe_batch_invariance(entry)
            if not entry.batch_invariant:
                log(f"{entry.id}: images depend on batch-mates; micro-batching is off for it")
        for entry in self.models.values():
            if entry.optimized:
                self.check(entry.id)
                psnr = "n/a" if entry.golden_psnr_db is None else f"{entry.golden_psnr_db:.1f} dB"
                log(f"golden check {entry.id}: {entry.status} ({psnr} vs {entry.sibling})")
        self.ready = True

    def _check_buckets(self, model_id: str, pipe) -> None:
        m = pipe.info["size_multiple"]
        bad = [f"{w}x{h}" for w, h in self.buckets if w % m or h % m]
        if bad:
            raise UserError(f"bucket(s) {', '.join(bad)} are not multiples of {m}, which model {model_id} needs")

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

        return batch_invariant(entry.pipeline, *self.buckets[0])

    # -- golden-sample check ------------------------------------------------------------------
    def golden_images(self, entry: ModelEntry) -> np.ndarray:
        w, h = self.buckets[0]
        result = entry.pipeline(list(GOLDEN_PROMPTS), batch=len(GOLDEN_PROMPTS), width=w, height=h, **GOLDEN_SETTINGS)
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
        return next(iter(self.models))

    def route(self, model_id: str | None) -> tuple[ModelEntry, ModelEntry]:
        """(requested, serving): a degraded model is served by its full-precision sibling."""
        requested = self.get(model_id or self.default_id)
        if requested.status == "degraded" and requested.sibling:
            return requested, self.models[requested.sibling]
        return requested, requested

    def snap(self, width: int, height: int) -> tuple[int, int]:
        return nearest_bucket(width, height, self.buckets)
