"""The rotation probes' scratch caches (calibration trajectories, GPTQ Hessians, dequantized weights) as .npz files
read with allow_pickle=False: a cache file is data, never code. Written to a temporary name, then renamed."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Callable

import numpy as np


def _save(path: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    keys = list(arrays)
    np.savez(tmp, __meta__=json.dumps({**meta, "keys": keys}), **{f"a{i}": np.asarray(arrays[k]) for i, k in enumerate(keys)})
    tmp.replace(path)


def _load(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["__meta__"]))
        return {k: z[f"a{i}"] for i, k in enumerate(meta.pop("keys"))}, meta


def arrays(path: Path, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """A dict of arrays by name, built once and kept at `path` (.npz)."""
    if path.exists():
        return _load(path)[0]
    out = build()
    _save(path, out, {})
    return out


def calibration(path: Path, build: Callable[[], object]):
    """quantize's CalibrationSet, built once and kept at `path` (.npz): its arrays, extras and provenance."""
    from onnxdiffusion.quantize.calibration import CalibrationSet

    if path.exists():
        stored, meta = _load(path)
        extras = {k[len("extras/"):]: v for k, v in stored.items() if k.startswith("extras/")}
        plain = {k: v for k, v in stored.items() if not k.startswith("extras/")}
        return CalibrationSet(**plain, extras=extras, provenance=meta["provenance"], guidance=meta["guidance"])
    calib = build()
    skip = {"extras", "provenance", "guidance"}
    stored = {f.name: getattr(calib, f.name) for f in fields(calib) if f.name not in skip and getattr(calib, f.name) is not None}
    stored.update({f"extras/{k}": v for k, v in calib.extras.items()})
    _save(path, stored, {"provenance": calib.provenance, "guidance": calib.guidance})
    return calib
