"""How a pipeline trades memory for load time: the `memory` setting of `Pipeline.from_folder`.

`default` keeps every session loaded with ONNX Runtime's defaults (weights pre-packed for its
kernels, a growing CPU arena, a planned activation block from the second run on). `lean` lowers
the peak resident set at full size: the text encoders are let go as soon as the prompt is encoded
(and loaded again, from their files, for the next prompt), and ORT's memory pattern is off (its
block is taken beside what the arena already holds). `bounded` also lets the backbone go before the VAE
decode and keeps ORT from making packed copies of the weights (issue 43: a model larger than half the memory). The larger saving is the folder's layout:
weights in external-data files (folder/relayout.py), which `quantize` writes. What each choice costs and saves at SD1.5 size is measured in
`bench/report_sd15/README.md`; the ORT option strings themselves live in `session.py`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

from ..errors import UserError
from .vae_tiling import check_overlap


@dataclass(frozen=True)
class MemoryOptions:
    release_text_encoders: bool = False  # drop the text encoder sessions after each encoding; reload on the next
    prepacking: bool = True  # ORT pre-packs constant weights for its kernels (a packed copy beside the original)
    arena: bool = True  # ORT's CPU memory arena (grows by powers of two and keeps what it took)
    mem_pattern: bool = True  # ORT plans one block for a run's activations after the first run (taken beside
    #                           what the arena already holds from that first run)
    release_backbone: bool = False  # drop the backbone's session after the denoising loop, before the VAE decode
    #                                 (loaded again, from its files, for the next generation)
    vae_tile: int = 0  # > 0: decode in overlapping tiles of this many image pixels a side (runtime/vae_tiling.py;
    #                    the decoder's activations are a tile's; the image changes slightly, see there)
    vae_overlap: int = 0  # image pixels two neighbouring tiles share at least (cross-faded); 0: a quarter of
    #                       vae_tile (diffusers' tiled decoding's share)

    @property
    def vae_tile_overlap(self) -> int:
        return self.vae_overlap or self.vae_tile // 4

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


MAX_TILE = 16384  # the largest image side guards.py allows

MEMORY_MODES = {
    "default": MemoryOptions(),
    # pre-packing stays on: without it ORT's int8 kernels (QLinearConv) run 2.6x slower at SD1.5 size
    "lean": MemoryOptions(release_text_encoders=True, mem_pattern=False),
    # one component resident at a time (encode, free, denoise, free, decode): a generation's peak is the largest
    # component plus its working set. No packed copies and no arena: the weights ORT maps from page-aligned
    # external data are the only copy (file-backed pages the kernel can drop), at some speed (measured in
    # experiments/families/fullsize_run.md)
    "bounded": MemoryOptions(release_text_encoders=True, mem_pattern=False, release_backbone=True, prepacking=False,
                             arena=False),
}


def memory_options(spec: str | MemoryOptions | None) -> MemoryOptions:
    """A mode name (`default`, `lean`), `MODE,KEY=VALUE,...` / `KEY=VALUE,...` (booleans 0/1, sizes in
    pixels: `lean,vae_tile=256`), or MemoryOptions."""
    if spec is None:
        return MEMORY_MODES["default"]
    if isinstance(spec, MemoryOptions):
        return spec
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    base = MEMORY_MODES["default"]
    if parts and "=" not in parts[0]:
        if parts[0] not in MEMORY_MODES:
            raise UserError(f"unknown memory mode {parts[0]!r}; choose from {', '.join(MEMORY_MODES)} "
                            f"or KEY=VALUE with KEY in {', '.join(f.name for f in fields(MemoryOptions))}")
        base, parts = MEMORY_MODES[parts[0]], parts[1:]
    kinds = {f.name: f.type for f in fields(MemoryOptions)}
    changes: dict = {}
    for p in parts:
        key, _, value = p.partition("=")
        if kinds.get(key) in (bool, "bool") and value in ("0", "1", "true", "false"):
            changes[key] = value in ("1", "true")
        elif kinds.get(key) in (int, "int") and value.isdigit() and int(value) <= MAX_TILE:
            changes[key] = int(value)
        else:
            sizes = ", ".join(k for k, t in kinds.items() if t in (int, "int"))
            raise UserError(f"bad memory setting {p!r}: expected KEY=0|1 with KEY in "
                            f"{', '.join(sorted(k for k, t in kinds.items() if t in (bool, 'bool')))}, "
                            f"or {sizes}=PIXELS (0..{MAX_TILE})")
    out = replace(base, **changes)
    if out.vae_tile:
        check_overlap(out.vae_tile, out.vae_overlap)
    return out


class LazySession:
    """A session made on first use; with `release` it is dropped when its last user is done.

    Thread-safe: serve's workers encode prompts concurrently, and the session is let go only when
    none of them holds it (`with holder.use() as session: ...`).
    """

    def __init__(self, make, release: bool, session=None):
        self._make, self.release = make, release
        self._session = session
        self._users = 0
        self._lock = threading.Lock()
        self.loads = 0 if session is None else 1

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def get(self):
        """The session, loaded if need be (kept until the next release point)."""
        with self._lock:
            if self._session is None:
                self._session = self._make()
                self.loads += 1
            return self._session

    def set(self, session) -> None:
        """Hold a caller's own session (None: let it go; the next `get` makes one again)."""
        with self._lock:
            self._session = session

    @contextmanager
    def use(self):
        with self._lock:
            self._users += 1
        try:
            yield self.get()
        finally:
            with self._lock:
                self._users -= 1
                if self.release and self._users == 0:
                    self._session = None
