"""Crafted LoRA files for bench/fuzz_folders.py (`--kind adapters`): the adapter loader's untrusted input.

Each case starts from a valid random LoRA for one embedded model's insertion-point folder (`lora points`, built
once per run): a few of the folder's own targets in the diffusers/peft layout, with or without
`lora_adapter_metadata`, at a random rank. Then one change: the safetensors header (a leaf of its JSON, its length,
garbage), the body (truncated, flipped bytes), the tensors (shapes, ranks, dtypes, non-finite values), the keys
(unknown modules or components, half a pair, kohya or older diffusers names, alphas), the metadata (odd ranks,
alphas, patterns that are not regular expressions) or the scale. The worker loads it as a run-time adapter
(`Pipeline(..., loras=[(file, scale)])`, one step); a UserError is clean, anything else a finding.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np

KINDS = ("header-leaf", "header-length", "header-garbage", "body-trunc", "bytes-flip", "shape", "rank-mismatch",
         "dtype", "values", "key-unknown", "key-half", "key-layout", "alpha", "metadata", "scale", "empty", "valid")
ODD_SCALES = (1.0, 0.5, -4.0, 4.0, 4.0001, -1e9, 1e308, float("nan"), float("inf"), 0, True, "0.5", None, [1.0])


def points_folders(bases: dict[str, Path], work: Path) -> dict[str, Path]:
    """Each embedded model with LoRA insertion points (the folder the adapters are fed to)."""
    from onnxdiffusion.adapters.folder import add_points

    out = {}
    for key, base in bases.items():
        out[key] = work / f"points-{key}"
        if not out[key].exists():
            add_points(base, out[key])
    return out


def _targets(folder: Path) -> list[tuple[str, str, dict]]:
    manifest = json.loads((folder / "manifest.json").read_text())
    return [(comp, module, spec) for comp, entry in sorted(manifest["components"].items())
            for module, spec in sorted(((entry.get("lora") or {}).get("targets") or {}).items())]


def valid_lora(folder: Path, rng: random.Random) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    targets = _targets(folder)
    picked = rng.sample(targets, min(len(targets), rng.randint(1, 8)))
    r = rng.choice([1, 2, 4])
    tensors: dict[str, np.ndarray] = {}
    g = np.random.default_rng(rng.randrange(1 << 30))
    for comp, module, spec in picked:
        kernel = list(spec.get("kernel", []))
        a = g.standard_normal((r, int(spec["in"]), *kernel)).astype(np.float32) * 0.01
        b = g.standard_normal((int(spec["out"]), r, *([1, 1] if kernel else []))).astype(np.float32) * 0.01
        tensors[f"{comp}.{module}.lora_A.weight"], tensors[f"{comp}.{module}.lora_B.weight"] = a, b
    meta = {}
    if rng.random() < 0.5:
        comps = sorted({c for c, _, _ in picked})
        meta["lora_adapter_metadata"] = json.dumps({k: v for c in comps for k, v in
                                                    ((f"{c}.r", r), (f"{c}.lora_alpha", rng.choice([r, 2 * r])))})
    return tensors, meta


def encode(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> tuple[dict, bytes]:
    """(header, body) as safetensors lays them out."""
    header: dict = {"__metadata__": meta} if meta else {}
    chunks, offset = [], 0
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
             np.dtype(np.int8): "I8", np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8"}
    for key, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[key] = {"dtype": names[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    return header, b"".join(chunks)


def pack(header, body: bytes, length: int | None = None) -> bytes:
    text = json.dumps(header, allow_nan=True).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + body


def _retensor(tensors: dict, rng: random.Random, kind: str) -> None:
    key = rng.choice(sorted(tensors))
    arr = tensors[key]
    if kind == "shape":
        shape = list(arr.shape)
        i = rng.randrange(len(shape))
        shape[i] = rng.choice([0, 1, shape[i] + 1, shape[i] * 2, 3])
        if rng.random() < 0.3:
            shape = shape[::-1] if rng.random() < 0.5 else shape + [1]
        tensors[key] = np.zeros(shape, np.float32)
    elif kind == "rank-mismatch":
        tensors[key] = np.zeros((arr.shape[0] + 1, *arr.shape[1:]), np.float32) if key.endswith("lora_A.weight") \
            else np.zeros((arr.shape[0], arr.shape[1] + 1, *arr.shape[2:]), np.float32)
    elif kind == "dtype":
        tensors[key] = arr.astype(rng.choice([np.float16, np.float64, np.int8, np.int64, np.bool_, np.uint8]))
    elif kind == "values":
        out = arr.copy()
        out.reshape(-1)[rng.randrange(out.size)] = rng.choice([np.nan, np.inf, -np.inf, 1e38])
        if rng.random() < 0.3:
            out[...] = rng.choice([np.nan, 1e38])
        tensors[key] = out


def _rekey(tensors: dict, rng: random.Random, kind: str) -> None:
    key = rng.choice(sorted(tensors))
    value = tensors.pop(key)
    comp, _, rest = key.partition(".")
    if kind == "key-unknown":
        new = rng.choice([f"{comp}.down_blocks.99.nope.{rest.rsplit('.', 2)[-2]}.weight", f"vae.{rest}", f"nope.{rest}",
                          f".{rest}", rest, f"{comp}..{rest}", f"{comp}.{rest}.extra", key + "\u0000", "x" * 3000])
        tensors[new] = value
    elif kind == "key-half":
        pass  # one matrix of the pair left
    elif kind == "key-layout":
        new = rng.choice([key.replace(".lora_A.weight", ".lora.down.weight").replace(".lora_B.weight", ".lora.up.weight"),
                          "lora_unet_" + rest.replace(".", "_"), key.replace("lora_A", "lora_B"),
                          key.replace(".weight", ".bias"), key.replace("lora_A.weight", "dora_scale")])
        tensors[new] = value
        tensors.setdefault(key, value) if rng.random() < 0.5 else None
    elif kind == "alpha":
        tensors[key] = value
        tensors[key.rsplit(".lora_", 1)[0] + ".alpha"] = rng.choice(
            [np.array(rng.choice([0.0, -1.0, np.nan, np.inf, 1e38]), np.float32), np.zeros((0,), np.float32),
             np.zeros((3, 3), np.float32), np.array([1, 2], np.int64)])


def _metadata(meta: dict, tensors: dict, rng: random.Random) -> dict:
    from fuzz_folders import ODD_VALUES, mutate_json

    comp = next(iter(tensors)).partition(".")[0]
    module = next(iter(tensors)).partition(".")[2].rsplit(".lora_", 1)[0]
    r = rng.random()
    if r < 0.3:
        config = {f"{comp}.r": rng.choice(ODD_VALUES), f"{comp}.lora_alpha": rng.choice(ODD_VALUES)}
    elif r < 0.55:
        config = {f"{comp}.r": 4, f"{comp}.{rng.choice(['alpha_pattern', 'rank_pattern'])}":
                  {rng.choice(["(", "[", "*", "a{99999999}", "(?P<x", module, "\\", ""]): rng.choice(ODD_VALUES)}}
    elif r < 0.7:
        config = {f"{comp}.r": 4, f"{comp}.use_rslora": rng.choice(ODD_VALUES), f"{comp}.lora_alpha": 0}
    else:
        config = mutate_json(json.loads(meta.get("lora_adapter_metadata", "{}")) or {f"{comp}.r": 4}, rng)
    out = dict(meta)
    text = json.dumps(config, allow_nan=True) if rng.random() < 0.9 else "{not json"
    out[rng.choice(["lora_adapter_metadata"] * 4 + ["format"])] = text if rng.random() < 0.9 else "onnxdiffusion-lora"
    return out


def craft(folder: Path, out: Path, seed: int) -> dict:
    """Write case `seed` (a LoRA file for `folder`) to `out`; returns what was changed and the scale to load it at."""
    from fuzz_folders import mutate_json

    rng = random.Random(seed)
    tensors, meta = valid_lora(folder, rng)
    kind = rng.choice(KINDS)
    scale = rng.choice([1.0, 0.7, -0.5, 2.0])
    length = None
    if kind in ("shape", "rank-mismatch", "dtype", "values"):
        _retensor(tensors, rng, kind)
    elif kind in ("key-unknown", "key-half", "key-layout", "alpha"):
        _rekey(tensors, rng, kind)
    elif kind == "metadata":
        meta = _metadata(meta, tensors, rng)
    elif kind == "scale":
        scale = rng.choice(ODD_SCALES)
    elif kind == "empty":
        tensors = {} if rng.random() < 0.5 else {k: v[:0] for k, v in tensors.items()}
    header, body = encode(tensors, meta)
    if kind == "header-leaf":
        header = mutate_json(header, rng)
    elif kind == "header-length":
        length = rng.choice([0, 1, 7, 2**63, 2**64 - 1, len(json.dumps(header)) + rng.randint(-20, 20)])
    data = pack(header, body, length)
    if kind == "header-garbage":
        b = bytearray(data)
        for _ in range(rng.randint(1, 16)):
            b[8 + rng.randrange(max(1, min(len(b) - 8, 200)))] = rng.randrange(256)
        data = bytes(b)
    elif kind == "body-trunc":
        data = data[: rng.randrange(len(data) + 1)]
    elif kind == "bytes-flip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 32)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        data = bytes(b)
    out.write_bytes(data)
    return {"seed": seed, "class": "adapter", "what": f"adapter {kind} (scale {scale!r})", "_scale": scale}
