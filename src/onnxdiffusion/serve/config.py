"""The server's settings in one typed object (the CLI, the tests and the Ray deployment build it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..fields import option


def _bytes(text, what="--max-memory"):
    return parse_bytes(text, what) if text is not None else None


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ServeConfig:
    models: tuple[str, ...] = ()  # FOLDER or NAME=FOLDER; empty: the embedded model
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "TCP port to listen on")
    # WIDTHxHEIGHT list, the first the default size and the golden-check size; None: each model's own sizes
    # (its trained size first, then manager.DEFAULT_BUCKETS it can run)
    buckets: str | None = option(None, "sizes WIDTHxHEIGHT, comma-separated; requests snap to the nearest; the first is the default (default: each model's trained size and those of 64x64,128x128,96x96,64x128,128x64 it can run)")
    max_queue: int = option(64, "queued jobs before new ones get 503 + Retry-After")
    timeout: float = option(120.0, "per-request timeout in seconds (0: none)")  # seconds from submission
    workers: int = option(help="concurrent backbone batches (default: one per usable core)", default_factory=usable_cores,
                          cli_default=None, cli_type=int | None, convert=lambda v: v or usable_cores())
    threads: int = option(1, "ONNX Runtime threads per session")  # workers x threads <= cores
    max_batch: int = option(4, "images per micro-batch of compatible requests (1: off)")
    max_n: int = 4  # images per request
    max_steps: int = 100
    max_side: int = 1024  # larger requested sizes are refused rather than snapped
    max_body: int = 64 * 1024  # bytes of a JSON request
    max_edit_body: int = option(16 * 1024 * 1024, "largest /v1/images/edits request body (image + mask + fields; 16M, 4M): larger ones get 413", cli_type=str, cli_default="16M", convert=lambda v: _bytes(v or "16M", "--max-edit-body"))
    retention: float = option(600.0, "seconds finished results are kept")
    max_finished: int = 512
    golden_threshold_db: float = option(30.0, "PSNR (dB) an optimized model needs vs its full-precision sibling", flags=("--golden-threshold",))
    warmup: bool = True
    grace: float = option(10.0, "on SIGTERM/SIGINT: seconds in-flight requests get to finish")  # then cancelled
    provider: str = "cpu"
    profile: str | None = option(None, "hardware profile (name or YAML file) every model loads with; overrides the CPU default")
    memory: str | None = option(None, "default | lean (text encoders let go between requests, no ORT memory pattern) | KEY=0|1,... (default: the profile's, else default)")
    web: str | None = option(None, "a page folder from `export-web`, served at /web (cross-origin isolated)", cli_type=Path | None, convert=lambda v: str(v) if v else None)
    # bytes one backbone batch may need by runtime.guards' activation estimate; a request over it is refused
    # (400) and micro-batches stop below it, instead of the OS killing the server (None: no budget)
    max_memory: int | None = option(None, "memory budget of one backbone batch (4G, 512M): requests whose estimate exceeds it get 400, micro-batches stay under it", cli_type=str | None, convert=lambda v: _bytes(v))
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no authentication (see serve/auth.py)
    protect_metrics: bool = option(True, "with API keys: whether /metrics needs one", flags=("--protect-metrics/--open-metrics",))
    # queued + running jobs one key may hold (0: max_queue // 2 with two or more keys, else no per-key bound);
    # workers also take jobs round-robin by key, so one caller's backlog cannot starve another's
    key_max_jobs: int = option(0, "queued + running jobs one API key may hold (0: max-queue/2 with 2+ keys, else none)")
    # named LoRA adapters (serve/loras.py): every *.safetensors of lora_dir, and NAME=FILE specs
    lora_dir: str | None = option(None, "LoRA adapters clients may name in `lora`: every *.safetensors in this folder, named by its file name without the extension", cli_type=Path | None, convert=lambda v: str(v) if v else None)
    loras: tuple[str, ...] = option((), "a LoRA adapter clients may name, NAME=FILE (FILE alone: named by its file name without the extension); repeatable", flags=("--lora",))
    lora_cache: int = option(8, "converted adapter sets (model, names, scales) kept in memory; the least recently used goes first")

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
