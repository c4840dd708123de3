"""Offline rendering of a prompt file: one PNG per item, resumable, locally or on Ray Data actors.

Each finished image is written atomically as `OUT/<id>.png` the moment its batch ends, so a killed
run loses at most the batches in flight; a rerun skips every item whose PNG exists. `results.jsonl`
(every finished item's settings) is rewritten at the end of each run.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..fields import option
from ..folder.manifest import PipelineInfo, Recommended

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class BatchOptions:
    """run_batch's options (the batch verb's, made from the option fields)."""
    model: Path | None = option(None, "model folder (default: the embedded model)")
    batch_size: int = option(4, "items per backbone batch (compatible items only)")
    ray: bool = option(False, "render on Ray Data actors (the `ray` extra)", flags=("--ray",))
    actors: int = option(2, "--ray: actors (one model load each)")
    threads: int | None = 1
    progress: bool = option(True, "no progress bar", flags=("--quiet/--no-quiet",), invert=True)


@dataclass(frozen=True)
class BatchItem:
    id: str
    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    # None: the model's recommended setting (manifest), as `generate` resolves it
    steps: int | None = None
    sampler: str | None = None
    guidance: float | None = None
    width: int | None = None
    height: int | None = None
    n: int = 1  # one image per item (the render helpers take a request's image count)

    @classmethod
    def from_dict(cls, d: dict) -> BatchItem:
        return cls(**{k: (v.item() if isinstance(v, np.generic) else v) for k, v in d.items()})


def read_items(path: Path) -> list[BatchItem]:
    """JSON lines; `prompt` required; `id` (a safe file name) defaults to the 1-based line number."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file not found: {path}")
    items, seen = [], set()
    fields = set(BatchItem.__dataclass_fields__) - {"n"}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(d, dict) or not isinstance(d.get("prompt"), str):
            raise UserError(f"{path}:{lineno}: each line must be an object with a string 'prompt'")
        if "size" in d:
            w, sep, h = str(d.pop("size")).partition("x")
            if not (sep and w.isdigit() and h.isdigit()):
                raise UserError(f"{path}:{lineno}: size must look like 64x64")
            d["width"], d["height"] = int(w), int(h)
        unknown = set(d) - fields
        if unknown:
            raise UserError(f"{path}:{lineno}: unknown field(s) {', '.join(sorted(unknown))}")
        d["id"] = str(d.get("id", f"{lineno:05d}"))
        if not _ID.match(d["id"]):
            raise UserError(f"{path}:{lineno}: id {d['id']!r} must be a plain file name (letters, digits, _ . -)")
        if d["id"] in seen:
            raise UserError(f"{path}:{lineno}: duplicate id {d['id']!r}")
        seen.add(d["id"])
        try:
            items.append(BatchItem(**d))
        except TypeError as e:
            raise UserError(f"{path}:{lineno}: {e}") from None
    if not items:
        raise UserError(f"{path}: no prompts")
    return items


def image_path(out: Path, item: BatchItem) -> Path:
    return Path(out) / f"{item.id}.png"


def fill_defaults(pipe, items: list[BatchItem]) -> list[BatchItem]:
    """Unset size and steps/sampler/guidance resolved as `generate` resolves them for this model."""
    return [fill_item(i, pipe.info, pipe.recommended) for i in items]


def fill_item(item: BatchItem, info: PipelineInfo, recommended: Recommended) -> BatchItem:
    from ..runtime.pipeline import GenerateOptions, resolve_options

    o = resolve_options(GenerateOptions(steps=item.steps, sampler=item.sampler, guidance=item.guidance), recommended)
    return replace(item, width=item.width or info.default_width, height=item.height or info.default_height,
                   steps=o.steps, sampler=o.sampler, guidance=o.guidance)


def render_and_write(pipe, items: list[BatchItem], out: Path, max_images: int) -> list[str]:
    """Render items (compatible ones batched up to `max_images`) and write each PNG atomically; returns ids."""
    from ..folder.imageio import save_images
    from .render import render_mixed

    items = fill_defaults(pipe, items)
    done = []
    for item, images in zip(items, render_mixed(pipe, items, max_images)):
        save_images(images, image_path(out, item))
        done.append(item.id)
    return done


def _options(item: BatchItem):
    from ..runtime.pipeline import GenerateOptions

    return GenerateOptions(steps=item.steps, sampler=item.sampler, guidance=item.guidance, seed=item.seed,
                           width=item.width, height=item.height)


def run_batch(prompts: Path, out: Path, options: BatchOptions, remote=None) -> dict:
    """`remote`: with options.ray, the renderer of the pending items (serve.ray.render_on_ray: passed in,
    so this module does not import the one that imports it)."""
    from tqdm import tqdm

    from ..folder.artifacts import atomic_write_bytes

    if options.batch_size < 1 or options.actors < 1:
        raise UserError("batch-size and actors must be >= 1")
    items = read_items(prompts)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output exists and is not a folder: {out}")
    out.mkdir(parents=True, exist_ok=True)
    pending = [i for i in items if not image_path(out, i).exists()]
    from ..runtime import Pipeline

    pipe = Pipeline.from_folder(options.model, threads=options.threads)
    for item in fill_defaults(pipe, pending):  # every item checked before any image is rendered
        pipe.prepare(_options(item), None, None)
    from .render import batch_invariant

    # a model whose images depend on batch-mates (int8-dynamic) renders one item at a time, so every
    # image is what `generate` gives and a rerun or --ray cannot change it
    max_images = options.batch_size if batch_invariant(pipe) else 1
    bar = tqdm(total=len(items), initial=len(items) - len(pending), desc="rendering", unit="img",
               disable=not options.progress)
    if pending and options.ray:
        if remote is None:
            raise UserError("--ray: no remote renderer given (serve.ray.render_on_ray)")
        remote(pending, out, options, max_images, on_done=bar.update)
    elif pending:
        for start in range(0, len(pending), options.batch_size):
            chunk = pending[start : start + options.batch_size]
            bar.update(len(render_and_write(pipe, chunk, out, max_images)))
    bar.close()
    finished = [asdict(i) for i in fill_defaults(pipe, items) if image_path(out, i).exists()]
    atomic_write_bytes(out / "results.jsonl", "".join(json.dumps(d) + "\n" for d in finished).encode())
    return {"total": len(items), "skipped": len(items) - len(pending), "rendered": len(pending),
            "finished": len(finished)}
