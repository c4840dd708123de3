"""The server's settings in one typed object (the CLI, the tests and the Ray deployment build it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import UserError


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ServeConfig:
    models: tuple[str, ...] = ()  # FOLDER or NAME=FOLDER; empty: the embedded model
    host: str = "127.0.0.1"
    port: int = 8000
    # WIDTHxHEIGHT list, the first the default size and the golden-check size; None: each model's own sizes
    # (its trained size first, then manager.DEFAULT_BUCKETS it can run)
    buckets: str | None = None
    max_queue: int = 64
    timeout: float = 120.0  # per request, seconds from submission (0: none)
    workers: int = field(default_factory=usable_cores)  # concurrent backbone batches: one per core
    threads: int = 1  # ONNX Runtime intra-op threads per session (workers x threads <= cores)
    max_batch: int = 4  # images per backbone batch (1: no micro-batching)
    max_n: int = 4  # images per request
    max_steps: int = 100
    max_side: int = 1024  # larger requested sizes are refused rather than snapped
    max_body: int = 64 * 1024  # bytes of a JSON request
    max_edit_body: int = 16 * 1024 * 1024  # bytes of a /v1/images/edits upload (image + mask + fields)
    retention: float = 600.0  # seconds a finished job's result is kept
    max_finished: int = 512
    golden_threshold_db: float = 30.0
    warmup: bool = True
    grace: float = 10.0  # shutdown: seconds in-flight jobs get to finish before they are cancelled
    provider: str = "cpu"
    profile: str | None = None  # hardware profile (name or YAML file): its provider/options for every model
    memory: str | None = None  # runtime.memory mode (default | lean | KEY=0|1,...); None: the profile's, else default
    web: str | None = None  # a page folder from `export-web`, served at /web
    # bytes one backbone batch may need by runtime.guards' activation estimate; a request over it is refused
    # (400) and micro-batches stop below it, instead of the OS killing the server (None: no budget)
    max_memory: int | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no authentication (see serve/auth.py)
    protect_metrics: bool = True  # with keys: /metrics needs one too (False: open to scrapers)
    # queued + running jobs one key may hold (0: max_queue // 2 with two or more keys, else no per-key bound);
    # workers also take jobs round-robin by key, so one caller's backlog cannot starve another's
    key_max_jobs: int = 0
    # named LoRA adapters (serve/loras.py): every *.safetensors of lora_dir, and NAME=FILE specs
    lora_dir: str | None = None
    loras: tuple[str, ...] = ()
    lora_cache: int = 8  # converted adapter sets (model, names, scales) kept in memory, least recently used out

    def __post_init__(self):
        for name in ("max_queue", "workers", "threads", "max_batch", "max_n", "max_steps", "max_side", "max_body",
                     "max_edit_body", "lora_cache"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_memory is not None and self.max_memory <= 0:
            raise UserError(f"max-memory must be positive, got {self.max_memory}")
        if self.key_max_jobs < 0:
            raise UserError(f"key-max-jobs must be >= 0, got {self.key_max_jobs}")
        if self.timeout < 0 or self.retention < 0 or self.grace < 0:
            raise UserError("timeout, retention and grace must be >= 0")
        from .manager import parse_buckets

        parse_buckets(self.buckets)  # syntax errors fail before anything loads
        from ..runtime.memory import memory_options

        memory_options(self.memory)
        from .loras import adapter_files

        adapter_files(self.lora_dir, self.loras)  # a bad name or a missing file fails before anything loads
        if not 0 < self.port < 65536:
            raise UserError(f"port must be in 1..65535, got {self.port}")

    def per_key_limit(self) -> int | None:
        if self.key_max_jobs:
            return self.key_max_jobs
        return max(1, self.max_queue // 2) if len(self.api_keys) >= 2 else None


def parse_bytes(text: str | None, option: str = "--max-memory") -> int | None:
    """'4G', '512M', '1.5GiB', '1000000' -> bytes (binary units); None or '' -> None."""
    if text is None or not str(text).strip():
        return None
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in "KMGT" else t
    try:
        value = float(number)
    except ValueError:
        raise UserError(f"{option} must look like 4G, 512M or a byte count, got {text!r}") from None
    if not value > 0 or value * scale > 1 << 60:
        raise UserError(f"{option} must be positive, got {text!r}")
    return int(value * scale)
