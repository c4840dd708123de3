import os

os.environ["HF_HUB_OFFLINE"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from onnxdiffusion.evaluate import scenes as S  # noqa: E402
from onnxdiffusion.evaluate import judge as J  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge, per_image, score, score_scenes, summarize  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
N_HELDOUT = 600


@pytest.fixture(scope="module")
def judge() -> Judge:
    pytest.importorskip("onnxruntime")
    return Judge.from_file(threads=1)


@pytest.fixture(scope="module")
def heldout():
    # Seeds past the 0..2999 range the training report evaluates on.
    scs = S.scenes("heldout", N_HELDOUT, start=50_000)
    return scs, np.stack([S.render(sc) for sc in scs])


def _perfect(scene: S.Scene) -> dict[str, np.ndarray]:
    lab = S.slot_labels(scene)
    return {**lab, "occupied": lab["shape"] > 0}


def _scene(*objects: S.SceneObject, size_in_caption: bool = True) -> S.Scene:
    return S.Scene(objects=tuple(objects), background=S.BACKGROUNDS[0], size_in_caption=size_in_caption)


RED_LEFT = S.SceneObject("circle", "red", "left", "small")
BLUE_RIGHT = S.SceneObject("star", "blue", "right", "large")


# ---------------------------------------------------------------- model file and predictions


def test_default_path_is_repo_models_judge():
    assert J.DEFAULT_JUDGE_PATH == REPO / "models" / "judge" / "judge.onnx"
    assert J.DEFAULT_JUDGE_PATH.is_file()
    assert J.DEFAULT_JUDGE_PATH.stat().st_size <= 1_600_000


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="judge model not found"):
        Judge.from_file(tmp_path / "nope.onnx")


def test_predict_shapes_and_batching(judge, heldout):
    _, images = heldout
    a = judge.predict(images[:20])
    assert set(a) >= {"shape", "colour", "size", "occupied", "embedding"}
    assert a["shape"].shape == a["colour"].shape == a["size"].shape == (20, len(S.POSITION_NAMES))
    assert a["shape"].dtype == np.int64 and a["occupied"].dtype == bool
    assert 64 <= a["embedding"].shape[1] <= 128 and a["embedding"].dtype == np.float32
    assert a["shape"].max() <= len(S.SHAPES) and a["colour"].max() <= len(S.COLOUR_NAMES)
    assert a["size"].max() <= len(S.SIZE_NAMES)
    b = judge.predict(list(images[:20]), batch_size=7)
    for k in ("shape", "colour", "size"):
        assert np.array_equal(a[k], b[k])
    assert np.allclose(a["embedding"], b["embedding"], atol=1e-4)
    one = judge.predict(images[0])
    assert one["shape"].shape == (1, len(S.POSITION_NAMES))
    with pytest.raises(TypeError):
        judge.predict(images[:2].astype(np.float32))
    with pytest.raises(ValueError):
        judge.predict(np.zeros((2, 32, 32, 3), np.uint8))


def test_judge_reads_heldout_scenes(judge, heldout):
    scs, images = heldout
    pred = judge.predict(images)
    labels = {k: np.stack([S.slot_labels(sc)[k] for sc in scs]) for k in ("shape", "colour", "size")}
    occ = labels["shape"] > 0
    for k in ("shape", "colour", "size"):
        acc = (pred[k] == labels[k])[occ].mean()
        assert acc >= 0.97, f"{k} accuracy {acc:.4f}"
    assert (pred["occupied"] == occ).mean() >= 0.97
    # The same through the prompt scorer, with every size scored.
    summary = summarize([score(sc.objects, True, p) for sc, p in zip(scs, per_image(pred))])
    assert summary["count"] == N_HELDOUT
    for k in ("attribute", "position", "shape", "colour", "size"):
        assert summary[f"{k}_accuracy"] >= 0.97, (k, summary)
    assert summary["strict_accuracy"] >= 0.9, summary


def test_strict_margin_is_positive_exactly_where_the_verdict_is_strict(judge, heldout):
    scs, images = heldout
    scs, images = scs[:200], images[:200]
    noisy = np.clip(images.astype(np.int16) + np.random.default_rng(0).integers(-60, 61, images.shape), 0, 255)
    for batch in (images, noisy.astype(np.uint8)):
        strict = [s["strict"] for s in score_scenes(scs, judge.predict(batch))]
        margins = J.strict_margins(scs, judge.logits(batch))
        assert [m > 0 for m in margins] == strict
    assert not all(strict)  # the noisy pictures lose some verdicts: both signs were read


def test_embedding_separates_real_from_degraded(judge, heldout):
    from onnxdiffusion.evaluate.metrics import frechet_distance, gaussian_stats

    _, images = heldout
    half = N_HELDOUT // 2
    e_a = judge.embed(images[:half])
    e_b = judge.embed(images[half:])
    noisy = np.clip(
        images[half:].astype(np.int16) + np.random.default_rng(0).integers(-60, 61, images[half:].shape), 0, 255
    ).astype(np.uint8)
    e_noisy = judge.embed(noisy)
    real_vs_real = frechet_distance(*gaussian_stats(e_a), *gaussian_stats(e_b))
    real_vs_noisy = frechet_distance(*gaussian_stats(e_a), *gaussian_stats(e_noisy))
    assert real_vs_noisy > 2 * real_vs_real


# ---------------------------------------------------------------- scoring logic


def test_perfect_prediction_is_strict():
    sc = _scene(RED_LEFT, BLUE_RIGHT)
    s = score(sc.objects, True, _perfect(sc))
    assert s["strict"] == 1
    assert s["attribute_accuracy"] == 1.0
    assert s["attribute_total"] == 8  # 2 objects x (position, shape, colour, size)
    assert s["extra_objects"] == 0
    assert all(all(o.values()) for o in s["objects"])


def test_wrong_colour_drops_colour_and_strict():
    sc = _scene(RED_LEFT, BLUE_RIGHT)
    p = _perfect(sc)
    p["colour"][S.POSITION_NAMES.index("left")] = S.COLOUR_NAMES.index("green") + 1
    s = score(sc.objects, True, p)
    assert s["strict"] is False
    assert s["objects"][0] == {"position": True, "shape": True, "colour": False, "size": True}
    assert all(s["objects"][1].values())
    assert s["correct"]["colour"] == 1 and s["total"]["colour"] == 2
    assert s["attribute_accuracy"] == pytest.approx(7 / 8)


def test_extra_object_drops_strict_only():
    sc = _scene(RED_LEFT)
    p = _perfect(sc)
    j = S.POSITION_NAMES.index("top")
    p["shape"][j], p["colour"][j], p["size"][j] = 3, 2, 1
    s = score(sc.objects, True, p)
    assert s["attribute_accuracy"] == 1.0
    assert s["extra_objects"] == 1
    assert s["strict"] is False


def test_missing_object_and_size_only_when_captioned():
    sc = _scene(RED_LEFT, BLUE_RIGHT, size_in_caption=False)
    p = _perfect(sc)
    right = S.POSITION_NAMES.index("right")
    p["size"][S.POSITION_NAMES.index("left")] = S.SIZE_NAMES.index("large") + 1  # wrong, but unscored
    s = score(sc.objects, False, p)
    assert s["strict"] is True and s["attribute_total"] == 6
    assert s["objects"][0]["size"] is None
    p["shape"][right] = p["colour"][right] = p["size"][right] = 0  # object missing
    s = score(sc.objects, False, p)
    assert s["objects"][1] == {"position": False, "shape": False, "colour": False, "size": None}
    assert s["strict"] is False and s["attribute_accuracy"] == pytest.approx(3 / 6)


def test_score_accepts_mappings():
    objs = [{"shape": "ring", "colour": "white", "position": "centre", "size": "large"}]
    p = {k: np.zeros(5, np.int64) for k in ("shape", "colour", "size")}
    c = S.POSITION_NAMES.index("centre")
    p["shape"][c], p["colour"][c], p["size"][c] = S.SHAPES.index("ring") + 1, S.COLOUR_NAMES.index("white") + 1, 2
    assert score(objs, True, p)["strict"] is True


def test_summarize():
    a = _scene(RED_LEFT, BLUE_RIGHT)
    b = _scene(RED_LEFT, size_in_caption=False)
    pa, pb = _perfect(a), _perfect(b)
    pb["colour"][S.POSITION_NAMES.index("left")] = 0
    pred = {k: np.stack([pa[k], pb[k]]) for k in ("shape", "colour", "size")}
    scores = score_scenes([a, b], pred)
    summ = summarize(scores)
    assert summ["count"] == 2 and summ["object_count"] == 3
    assert summ["strict_accuracy"] == 0.5
    assert summ["colour_accuracy"] == pytest.approx(2 / 3)
    assert summ["shape_accuracy"] == summ["position_accuracy"] == 1.0
    assert summ["size_accuracy"] == 1.0  # only the captioned scene's two objects
    assert summ["attribute_accuracy"] == pytest.approx(10 / 11)
    assert summ["extra_object_rate"] == 0.0
    empty = summarize([])
    assert empty["count"] == 0 and empty["strict_accuracy"] is None


def test_no_torch_or_scipy_at_import():
    code = (
        "import sys; import onnxdiffusion.evaluate, onnxdiffusion.evaluate.metrics, "
        "onnxdiffusion.evaluate.judge; "
        "bad = [m for m in ('torch', 'scipy') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
