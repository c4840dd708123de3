"""What `tune` remembers: every measurement as one JSON line, appended to OUT/journal.jsonl (an interrupted run
resumes from it) and to a store under the cache ($ONNXDIFFUSION_CACHE/tune/KEY/, KEY a content hash of the model's
files, the prompt sets and the settings that decide a picture), so a second run on the same model, with any bound,
measures nothing again. Latencies are kept per CPU model: another machine measures its own. The reference images
are kept beside them as .npy."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..folder.manifest import Manifest

STORE_VERSION = 3  # 2: scores carry per-image PSNR and per-prompt verdicts; 3: and the verdicts' margins


def search_key(manifest: Manifest, sets: list[dict], guidance: float, cpu: str) -> tuple[str, str]:
    """(the key of the pictures' store, the key of this CPU's latencies)."""
    from .. import __version__

    what = {"files": dict(manifest.files), "pipeline": manifest.pipeline.to_dict(), "family": manifest.family,
            "sets": sets, "guidance": guidance, "version": __version__, "store": STORE_VERSION}
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return key, hashlib.sha256(cpu.encode()).hexdigest()[:12]


class Store:
    def __init__(self, root: Path, journal: Path, cpu_key: str):
        self.root, self.journal, self.cpu_key = Path(root), Path(journal), cpu_key
        self.root.mkdir(parents=True, exist_ok=True)
        self.records: dict[tuple[str, str], dict] = {}
        for path in (self.root / "records.jsonl", self.journal):
            for rec in _read_lines(path):
                self.records[(rec["kind"], rec["id"])] = rec

    def _id(self, kind: str, ident: str) -> str:
        return f"{self.cpu_key}/{ident}" if kind == "timing" else ident

    def get(self, kind: str, ident: str) -> dict | None:
        return self.records.get((kind, self._id(kind, ident)))

    def put(self, kind: str, ident: str, value: dict) -> dict:
        rec = {"kind": kind, "id": self._id(kind, ident), **value}
        self.records[(kind, rec["id"])] = rec
        line = json.dumps(rec, sort_keys=True) + "\n"
        for path in (self.root / "records.jsonl", self.journal):
            _append(path, line)
        return rec

    def has_array(self, name: str) -> bool:
        return (self.root / f"{name}.npy").is_file()

    def array(self, name: str, make) -> np.ndarray:
        """A reference array kept in the store (made once by `make()`)."""
        path = self.root / f"{name}.npy"
        if path.is_file():
            try:
                return np.load(path, allow_pickle=False)
            except (OSError, ValueError):
                pass  # a torn file from a killed run: made again
        arr = make()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, path)
        return arr


def _append(path: Path, line: str) -> None:
    # one write of one whole line: a run killed mid-way leaves at most a torn last line, which _read_lines skips
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def _read_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("kind"), str) and isinstance(rec.get("id"), str):
            out.append(rec)
    return out
