"""Named LoRA adapters for `serve`: the operator's catalog, the request field `lora`, converted feeds cached.

The operator names the adapters at start-up (`--lora-dir DIR`: every `*.safetensors` in DIR under its file
name without the extension; `--lora NAME=FILE`, repeatable). A client only ever sends names: they resolve
inside that catalog, never to a path of the client's choosing. At start-up every adapter is checked against
every served model that has LoRA insertion points; the ones that fit are listed in `/v1/models` (`loras`).
An adapter set (names and scales) is converted to the insertion points' feeds once per model and kept in an
LRU of `--lora-cache` sets; a request then costs a dictionary lookup (and a stat of its files, so a file
replaced on disk is read again rather than served stale).
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..folder.manifest import Manifest

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_PER_REQUEST = 8  # adapters in one request (ranks concatenate: the feeds grow with each)
EXAMPLE = '[{"name": "style", "scale": 0.8}] or ["style:0.8"]'


class LoraRequestError(UserError):
    """A request's `lora` the server refuses; `code` and `status` go into OpenAI's error object."""

    def __init__(self, message: str, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


def _shown(value, limit: int = 64) -> str:
    """A client's value in a message, bounded (a name may be anything a client sends)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- start-up: the catalog ----------------------------------------------------------------------
def adapter_files(lora_dir: str | None, specs: tuple[str, ...] | list[str]) -> dict[str, Path]:
    """name -> file from `--lora-dir` and `--lora NAME=FILE` (FILE alone: its name without the extension);
    every name checked, every file present; one line on bad input."""
    files: dict[str, Path] = {}

    def add(name: str, path: Path, option: str) -> None:
        if not NAME.match(name):
            raise UserError(f"{option}: adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-' "
                            f"(starting with a letter or digit)")
        if name in files:
            raise UserError(f"{option}: two adapters are named {name!r} ({files[name]} and {path}); name them "
                            f"with --lora NAME=FILE")
        files[name] = path.resolve()

    if lora_dir is not None:
        folder = Path(lora_dir)
        if not folder.is_dir():
            raise UserError(f"--lora-dir {lora_dir}: not a folder")
        found = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
        if not found:
            raise UserError(f"--lora-dir {lora_dir}: no *.safetensors file in it")
        for path in found:
            add(path.stem, path, f"--lora-dir {lora_dir}")
    for spec in specs:
        name, sep, rest = str(spec).partition("=")
        path = Path(rest) if sep and name and "/" not in name else Path(spec)
        if not (sep and name and "/" not in name):
            name = path.stem
        if not path.is_file():
            raise UserError(f"--lora {spec}: no such file")
        if path.suffix.lower() != ".safetensors":
            raise UserError(f"--lora {spec}: adapters are .safetensors files (pickles can run code when loaded)")
        add(name, path, f"--lora {spec}")
    return files


# -- a request's field ----------------------------------------------------------------------------
def parse_field(raw) -> list[tuple[str, float]]:
    """The request's `lora`: a list of {"name", "scale"} objects or "name[:scale]" strings -> [(name, scale)]."""
    from ..adapters.feeds import SCALE_RANGE

    if raw is None:
        return []
    if not isinstance(raw, list):
        raise LoraRequestError(f"lora must be a list of adapters, e.g. {EXAMPLE}")
    if len(raw) > MAX_PER_REQUEST:
        raise LoraRequestError(f"lora names {len(raw)} adapters; at most {MAX_PER_REQUEST} are taken per request")
    items: list[tuple[str, float]] = []
    for i, item in enumerate(raw):
        where = f"lora[{i}]"
        if isinstance(item, str):
            name, sep, tail = item.rpartition(":") if ":" in item else (item, "", "")
            try:
                scale = float(tail) if sep else 1.0
            except ValueError:
                raise LoraRequestError(f"{where}: the scale after ':' must be a number, got {_shown(tail)}") from None
        elif isinstance(item, dict):
            unknown = set(item) - {"name", "scale"}
            if unknown:
                raise LoraRequestError(f"{where}: unknown field {_shown(sorted(unknown)[0])} (an adapter has `name` "
                                       f"and `scale`)")
            name, scale = item.get("name"), item.get("scale", 1.0)
        else:
            raise LoraRequestError(f"{where}: each adapter is an object {{\"name\", \"scale\"}} or a string "
                                   f"\"name:scale\", got {type(item).__name__}")
        if not isinstance(name, str) or not name:
            raise LoraRequestError(f"{where}: `name` must be a non-empty string (an adapter listed in /v1/models)")
        # compared, not converted: NaN fails the comparison and a huge JSON integer cannot overflow a float
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
            raise LoraRequestError(f"{where}: scale must be a number in [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}], "
                                   f"got {_shown(scale)}", "invalid_lora_scale")
        if any(name == n for n, _ in items):
            raise LoraRequestError(f"{where}: adapter {_shown(name)} is named twice; give it once with one scale")
        items.append((name, float(scale)))
    return items


@dataclass(frozen=True, eq=False)
class LoraSet:
    """One request's adapters, resolved: what is echoed, the batch key, and the converted feeds."""

    items: tuple[tuple[str, float], ...]  # (name, scale) as requested
    key: tuple  # equal keys: equal feeds (same model, names, scales and file versions)
    feeds: object  # adapters.feeds.AdapterFeeds, read-only once built (batches share it)

    def settings(self) -> list[dict]:
        return [{"name": n, "scale": s} for n, s in self.items]


def has_points(manifest: Manifest) -> bool:
    return any(entry.lora for entry in manifest.components.values())


class LoraCatalog:
    """The operator's adapters by name, which of them fit each model, and the LRU of converted adapter sets."""

    def __init__(self, files: dict[str, Path], cache_size: int = 8):
        from ..adapters.feeds import LoraCache

        self.files = dict(files)
        self.cache_size = cache_size
        self.unfit: dict[tuple[str, str], str] = {}  # (model, adapter) -> why it does not fit
        self._parsed = LoraCache(size=max(1, cache_size))  # files read once, however many scales ask for them
        self._sets: OrderedDict[tuple, LoraSet] = OrderedDict()
        self._lock = threading.Lock()
        self._build = threading.Lock()  # one conversion at a time: a burst of the same new set converts it once

    def check(self, entries, log=print) -> None:
        """Set each serving model's `loras`: None without insertion points, else the adapters that fit it."""
        from ..adapters.feeds import build_feeds
        from .manager import one_line

        for entry in entries:
            if not has_points(entry.pipeline.manifest):
                entry.loras = None
                continue
            fit = []
            for name, path in self.files.items():
                try:
                    build_feeds(entry.pipeline.manifest, [(path, 1.0)], self._parsed)
                    fit.append(name)
                except Exception as e:  # noqa: BLE001 - one odd file must not keep the server from starting
                    why = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
                    log(f"{entry.id}: adapter {name} is not served for it ({one_line(why)})")
                    self.unfit[(entry.id, name)] = one_line(why.replace(str(path), name))  # clients see no paths
            entry.loras = tuple(fit)
        served = {n for e in entries for n in (e.loras or ())}
        if self.files and not any(e.loras is not None for e in entries):
            log("no served model has LoRA insertion points (`onnxdiffusion lora points MODEL OUT`): requests with "
                "`lora` get 400")
        elif self.files and not served:
            log("no adapter fits a served model: requests with `lora` get 400")

    def resolve(self, raw, entry) -> LoraSet | None:
        """The request's `lora` for the model that renders it; None when it names no adapter."""
        items = parse_field(raw)
        if not items:
            return None
        if not self.files:
            raise LoraRequestError("this server serves no LoRA adapters (its operator names them with --lora-dir or "
                                   "--lora)", "lora_not_found")
        if getattr(entry, "loras", None) is None:
            raise LoraRequestError(f"model {entry.id} has no LoRA insertion points, so it takes no `lora` (make a "
                                   f"copy with them: onnxdiffusion lora points MODEL OUT)", "model_without_lora_points")
        for i, (name, _) in enumerate(items):
            if name not in self.files:
                have = ", ".join(entry.loras) if entry.loras else "none"
                raise LoraRequestError(f"lora[{i}]: unknown adapter {_shown(name)}; adapters of model {entry.id}: "
                                       f"{have} (GET /v1/models)", "lora_not_found")
            if name not in entry.loras:
                why = self.unfit.get((entry.id, name), "not checked against it")
                raise LoraRequestError(f"lora[{i}]: adapter {name} does not fit model {entry.id}: {why}",
                                       "lora_not_compatible")
        return self._set(entry, tuple(items))

    def _set(self, entry, items: tuple[tuple[str, float], ...]) -> LoraSet:
        paths = [self.files[name] for name, _ in items]
        try:
            stamps = tuple((st.st_size, st.st_mtime_ns) for st in map(os.stat, paths))
        except OSError:
            raise LoraRequestError(f"an adapter of this request ({', '.join(n for n, _ in items)}) is no longer "
                                   f"readable on the server", "lora_unavailable", 503) from None
        key = (entry.id, items, stamps)
        hit = self._get(key)
        if hit is not None:
            return hit
        from ..adapters.feeds import build_feeds

        with self._build:
            hit = self._get(key)
            if hit is not None:
                return hit
            try:
                feeds = build_feeds(entry.pipeline.manifest, [(p, s) for p, (_, s) in zip(paths, items)], self._parsed)
            except UserError as e:  # a file changed on disk since start-up
                message = str(e)
                for path, (name, _) in zip(paths, items):
                    message = message.replace(str(path), name)  # clients see names, not the server's paths
                raise LoraRequestError(f"an adapter of this request cannot be used now: {message}",
                                       "lora_unavailable", 503) from None
            made = LoraSet(items, key, feeds)
            with self._lock:
                self._sets[key] = made
                while len(self._sets) > self.cache_size:
                    self._sets.popitem(last=False)
        return made

    def _get(self, key: tuple) -> LoraSet | None:
        with self._lock:
            hit = self._sets.get(key)
            if hit is not None:
                self._sets.move_to_end(key)
            return hit

    def cached(self) -> int:
        return len(self._sets)
