"""The scene judge: reads a 64x64 scene back into per-slot attributes and scores prompts.

The shipped model (``models/judge/judge.onnx``, trained by ``models/training/train_judge.py``)
predicts, for each slot of ``scenes.POSITION_NAMES``, a shape, colour and size class, where
class 0 means "empty" and k+1 the k-th name of ``scenes.SHAPES`` / ``COLOUR_NAMES`` /
``SIZE_NAMES`` (the layout of ``scenes.slot_labels``). A slot counts as occupied when its
predicted shape is not empty. It also returns an embedding (penultimate features) for a
Frechet distance between real and generated images.

    judge = Judge.from_file()
    pred = judge.predict(images)                 # N x 64 x 64 x 3 uint8
    scores = [score(sc.objects, sc.size_in_caption, p) for sc, p in zip(scenes, per_image(pred))]
    summary = summarize(scores)

Only numpy and onnxruntime are needed (onnxruntime is imported when a judge is loaded).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onnxdiffusion.evaluate import scenes as S
from onnxdiffusion.folder.paths import models_root

__all__ = [
    "DEFAULT_JUDGE_PATH",
    "ATTRIBUTES",
    "Judge",
    "per_image",
    "score",
    "score_scenes",
    "summarize",
]

DEFAULT_JUDGE_PATH = models_root() / "judge" / "judge.onnx"
IMAGE_SIZE = S.IMAGE_SIZE
# Attributes scored per prompted object, in order; "size" only when the caption names it.
ATTRIBUTES = ("position", "shape", "colour", "size")
_SLOT_KEYS = ("shape", "colour", "size")


class Judge:
    """ONNX Runtime (CPU) session around the judge model."""

    def __init__(self, session: Any, path: Path | None = None, info: dict | None = None):
        self.session = session
        self.path = path
        self.info = info or {}
        self.input_name = session.get_inputs()[0].name
        self.output_names = [o.name for o in session.get_outputs()]

    @classmethod
    def from_file(cls, path: str | Path | None = None, *, threads: int | None = None) -> "Judge":
        """Load the judge; ``path`` defaults to the repository's ``models/judge/judge.onnx``.

        ``threads`` sets ONNX Runtime's intra-op thread count (its default when None). The
        training report ``judge.json`` next to the model, if present, is read into ``info``.
        """
        p = Path(path) if path is not None else DEFAULT_JUDGE_PATH
        if not p.is_file():
            raise FileNotFoundError(
                f"judge model not found at {p}; train and export it with "
                "`python models/training/train_judge.py --out models/judge`, "
                "or pass the path of a judge.onnx to Judge.from_file(path)"
            )
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads is not None:
            opts.intra_op_num_threads = int(threads)
            opts.inter_op_num_threads = 1
        session = ort.InferenceSession(str(p), sess_options=opts, providers=["CPUExecutionProvider"])
        info_path = p.with_suffix(".json")
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        return cls(session, p, info)

    @property
    def embedding_dim(self) -> int:
        return int(self.session.get_outputs()[self.output_names.index("embedding")].shape[-1])

    def predict(self, images, batch_size: int = 256) -> dict[str, np.ndarray]:
        """Read a batch of images.

        ``images``: N x 64 x 64 x 3 uint8 RGB (an array, or a sequence of HxWx3 uint8 arrays
        or PIL images; a single HxWx3 image is treated as N = 1).

        Returns ``shape``, ``colour``, ``size``: (N, 5) int64 class ids per slot
        (0 = empty); ``occupied``: (N, 5) bool (shape not empty); ``embedding``: (N, D)
        float32.
        """
        x = _as_uint8_batch(images)
        if len(x) == 0:
            d = self.embedding_dim
            empty = np.zeros((0, len(S.POSITION_NAMES)), np.int64)
            return {
                "shape": empty,
                "colour": empty.copy(),
                "size": empty.copy(),
                "occupied": empty.astype(bool),
                "embedding": np.zeros((0, d), np.float32),
            }
        return self.read(self.logits(x, batch_size))

    @staticmethod
    def read(logits: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``predict``'s result from ``logits``' (one run of the model gives both)."""
        shape = logits["shape_logits"].argmax(-1).astype(np.int64)
        return {
            "shape": shape,
            "colour": logits["colour_logits"].argmax(-1).astype(np.int64),
            "size": logits["size_logits"].argmax(-1).astype(np.int64),
            "occupied": shape > 0,
            "embedding": logits["embedding"].astype(np.float32),
        }

    def logits(self, images, batch_size: int = 256) -> dict[str, np.ndarray]:
        """The model's raw outputs (``shape_logits``, ``colour_logits``, ``size_logits``: (N, 5, classes);
        ``embedding``) for N >= 1 images (``predict``'s input)."""
        x = _as_uint8_batch(images)
        outs: dict[str, list[np.ndarray]] = {k: [] for k in self.output_names}
        for i in range(0, len(x), batch_size):
            chunk = x[i : i + batch_size].astype(np.float32).transpose(0, 3, 1, 2) / 255.0
            res = self.session.run(self.output_names, {self.input_name: np.ascontiguousarray(chunk)})
            for k, v in zip(self.output_names, res):
                outs[k].append(v)
        return {k: np.concatenate(v) for k, v in outs.items()}

    def embed(self, images, batch_size: int = 256) -> np.ndarray:
        """(N, D) embeddings only (for ``metrics.gaussian_stats`` / ``frechet_distance``)."""
        return self.predict(images, batch_size)["embedding"]


def _as_uint8_batch(images) -> np.ndarray:
    if isinstance(images, np.ndarray):
        x = images
    else:
        x = np.stack([np.asarray(im) for im in images]) if len(images) else np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    if x.ndim == 3:
        x = x[None]
    if x.dtype != np.uint8:
        raise TypeError(f"judge expects uint8 RGB images, got dtype {x.dtype}")
    if x.ndim != 4 or x.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"judge expects N x {IMAGE_SIZE} x {IMAGE_SIZE} x 3 images, got shape {x.shape}")
    return x


def per_image(prediction: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Split a batch prediction from ``Judge.predict`` into one dict per image."""
    n = len(prediction["shape"])
    return [{k: np.asarray(v)[i] for k, v in prediction.items()} for i in range(n)]


def _field(obj: Any, name: str) -> str:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def score(
    scene_objects: Sequence[Any],
    size_in_caption: bool,
    prediction: Mapping[str, np.ndarray],
) -> dict[str, Any]:
    """Score one image against the objects its prompt asked for.

    ``scene_objects``: the prompted objects (``scenes.SceneObject`` or mappings with
    ``shape``/``colour``/``position``/``size`` names). ``prediction``: one image's
    prediction (``per_image(judge.predict(...))[i]``), i.e. (5,) class ids per key.

    Per object: ``position`` (its slot predicted non-empty), ``shape`` and ``colour`` (the
    predicted class at its slot equals the prompted one) and ``size`` (same, only when
    ``size_in_caption``). ``strict`` is True when every attribute of every object is right
    AND no other slot is predicted occupied.

    Returns ``objects`` (per-object dicts of booleans, ``size`` None when not scored),
    ``correct`` / ``total`` per attribute (dicts), ``attribute_correct``,
    ``attribute_total``, ``attribute_accuracy``, ``extra_objects`` (occupied slots nobody
    asked for) and ``strict``.
    """
    shape = np.asarray(prediction["shape"])
    colour = np.asarray(prediction["colour"])
    size = np.asarray(prediction["size"])
    occupied = shape > 0
    prompted_slots: set[int] = set()
    objects = []
    correct = dict.fromkeys(ATTRIBUTES, 0)
    total = dict.fromkeys(ATTRIBUTES, 0)
    for obj in scene_objects:
        j = S.POSITION_NAMES.index(_field(obj, "position"))
        prompted_slots.add(j)
        res: dict[str, bool | None] = {
            "position": bool(occupied[j]),
            "shape": bool(shape[j] == S.SHAPES.index(_field(obj, "shape")) + 1),
            # an empty slot has no colour or size, whatever those heads say
            "colour": bool(occupied[j] and colour[j] == S.COLOUR_NAMES.index(_field(obj, "colour")) + 1),
            "size": bool(occupied[j] and size[j] == S.SIZE_NAMES.index(_field(obj, "size")) + 1)
            if size_in_caption
            else None,
        }
        for k, v in res.items():
            if v is not None:
                total[k] += 1
                correct[k] += int(v)
        objects.append(res)
    extra = int(sum(bool(occupied[j]) for j in range(len(occupied)) if j not in prompted_slots))
    n_correct = sum(correct.values())
    n_total = sum(total.values())
    return {
        "objects": objects,
        "correct": correct,
        "total": total,
        "attribute_correct": n_correct,
        "attribute_total": n_total,
        "attribute_accuracy": n_correct / n_total if n_total else float("nan"),
        "extra_objects": extra,
        "strict": bool(n_correct == n_total and extra == 0),
    }


def score_scenes(scenes: Sequence[S.Scene], prediction: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    """``score`` each scene (its ``objects`` and ``size_in_caption``) against a batch prediction."""
    preds = per_image(prediction)
    if len(preds) != len(scenes):
        raise ValueError(f"{len(scenes)} scenes but {len(preds)} predictions")
    return [score(sc.objects, sc.size_in_caption, p) for sc, p in zip(scenes, preds)]


def strict_margin(scene_objects: Sequence[Any], size_in_caption: bool, logits: Mapping[str, np.ndarray]) -> float:
    """How far one image's ``strict`` verdict is from flipping, in logits: the smallest margin of the decisions
    ``score`` reads (at a prompted slot, its shape, colour and, when the caption names it, size class against the
    best other class; at any other slot, "empty" against the best shape). > 0: strict; < 0: not; near 0: a
    verdict a small change to the picture flips. ``logits``: one image's (5, classes) rows of ``Judge.logits``."""
    wanted = {S.POSITION_NAMES.index(_field(o, "position")): o for o in scene_objects}
    margins = []
    for j in range(len(S.POSITION_NAMES)):
        o = wanted.get(j)
        if o is None:
            heads = [("shape_logits", 0)]
        else:
            heads = [("shape_logits", S.SHAPES.index(_field(o, "shape")) + 1),
                     ("colour_logits", S.COLOUR_NAMES.index(_field(o, "colour")) + 1)]
            if size_in_caption:
                heads.append(("size_logits", S.SIZE_NAMES.index(_field(o, "size")) + 1))
        for head, c in heads:
            row = np.asarray(logits[head][j], dtype=np.float64)
            margins.append(float(row[c] - np.delete(row, c).max()))
    return min(margins)


def strict_margins(scenes: Sequence[S.Scene], logits: Mapping[str, np.ndarray]) -> list[float]:
    """``strict_margin`` of each scene against a batch of ``Judge.logits``."""
    return [strict_margin(sc.objects, sc.size_in_caption, {k: v[i] for k, v in logits.items()})
            for i, sc in enumerate(scenes)]


def summarize(scores: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregate per-image ``score`` results.

    ``attribute_accuracy``: correct / scored attributes, pooled over all objects of all
    images; ``strict_accuracy``: fraction of images with ``strict``; ``<attr>_accuracy``
    for position, shape, colour and size (pooled over objects; None when nothing was
    scored, e.g. size with no sized captions); ``extra_object_rate``: fraction of images
    with an unprompted object; ``count``: images; ``object_count``: prompted objects.
    """
    n = len(scores)
    correct = dict.fromkeys(ATTRIBUTES, 0)
    total = dict.fromkeys(ATTRIBUTES, 0)
    for s in scores:
        for k in ATTRIBUTES:
            correct[k] += s["correct"][k]
            total[k] += s["total"][k]
    n_total = sum(total.values())
    out: dict[str, Any] = {
        "attribute_accuracy": sum(correct.values()) / n_total if n_total else None,
        "strict_accuracy": sum(bool(s["strict"]) for s in scores) / n if n else None,
    }
    for k in ATTRIBUTES:
        out[f"{k}_accuracy"] = correct[k] / total[k] if total[k] else None
    out["extra_object_rate"] = sum(s["extra_objects"] > 0 for s in scores) / n if n else None
    out["count"] = n
    out["object_count"] = total["position"]
    return out
