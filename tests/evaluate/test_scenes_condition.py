"""The ControlNet condition (render_condition) and the position-free captions of the scene world."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.evaluate import scenes as S

SEEDS = range(40)


def _all_scenes():
    return [S.sample_scene(i, split) for split in S.SPLITS for i in SEEDS]


def test_condition_is_deterministic_grey_uint8():
    for sc in _all_scenes()[:20]:
        a, b = S.render_condition(sc), S.render_condition(sc)
        assert a.shape == (S.IMAGE_SIZE, S.IMAGE_SIZE, 3) and a.dtype == np.uint8
        assert np.array_equal(a, b)
        assert np.array_equal(a[:, :, 0], a[:, :, 1]) and np.array_equal(a[:, :, 0], a[:, :, 2])
        assert a.max() == 255 and a.min() == 0


def test_condition_lies_where_render_draws_the_objects():
    """Inside the silhouette render() shows an object colour, outside it shows only background."""
    for sc in _all_scenes():
        cond = S.render_condition(sc)[:, :, 0]
        img = S.render(sc).astype(int)
        colours = np.array([S.COLOURS[o.colour] for o in sc.objects])
        inside, outside = cond == 255, cond == 0
        dist = np.abs(img[:, :, None, :] - colours[None, None]).sum(-1).min(-1)  # to the nearest object colour
        assert (dist[inside] == 0).all()
        bgs = np.array([sc.background] + ([sc.background2] if sc.background2 else []))
        bg_dist = np.abs(img[:, :, None, :] - bgs[None, None]).sum(-1).min(-1)
        assert (bg_dist[outside] == 0).all()


def test_condition_marks_each_objects_slot():
    """Each object's white mass is centred on its slot (plus jitter); two objects split the picture in halves."""
    yy, xx = np.mgrid[0 : S.IMAGE_SIZE, 0 : S.IMAGE_SIZE]
    for sc in _all_scenes():
        cond = S.render_condition(sc)[:, :, 0].astype(float)
        for o, (jx, jy) in zip(sc.objects, sc.jitter):
            cx, cy = S.POSITIONS[o.position]
            w = cond.copy()
            if len(sc.objects) == 2:  # keep the half this object lies in
                half = (xx < 32) if o.position == "left" else (xx >= 32) if o.position == "right" else \
                    (yy < 32) if o.position == "top" else (yy >= 32)
                w = w * half
            mx, my = (w * xx).sum() / w.sum(), (w * yy).sum() / w.sum()
            # a triangle's centroid sits r/6 below its centre; the other shapes are symmetric
            assert abs(mx - (cx + jx)) < 1.0 and abs(my - (cy + jy)) < 2.5, (sc, o, mx, my)


def test_condition_differs_with_position_size_and_shape():
    sc = S.sample_scene(2, "train")
    o = sc.objects[0]
    base = S.render_condition(sc)
    for change in ({"position": "left" if o.position != "left" else "right"},
                   {"size": "small" if o.size == "large" else "large"},
                   {"shape": "square" if o.shape != "square" else "circle"}):
        moved = S.Scene((S.SceneObject(**{**o.__dict__, **change}),) + sc.objects[1:], sc.background,
                        sc.background2, sc.split_vertical, sc.jitter, sc.caption, sc.size_in_caption)
        assert not np.array_equal(S.render_condition(moved), base), change
    recoloured = S.Scene((S.SceneObject(o.shape, "red" if o.colour != "red" else "blue", o.position, o.size),)
                         + sc.objects[1:], (0, 0, 0), None, False, sc.jitter, "", True)
    assert np.array_equal(S.render_condition(recoloured), base)  # colour and background are the prompt's


@pytest.mark.parametrize("split", S.SPLITS)
def test_caption_without_position_has_no_position_words(split):
    position_words = set()
    for phrases in S._POS_PHRASES.values():
        for p in phrases:
            position_words.update(p.split())
    for rels in S._RELATIONS.values():
        for rel, _ in rels:
            position_words.update(rel.split())
    position_words -= {"a", "one"}
    vocab = set(S.vocabulary())
    for i in range(200):
        sc = S.sample_scene(i, split)
        cap = S.caption_without_position(sc)
        words = cap.replace(",", " ").split()
        assert not position_words & set(words), cap
        assert set(words) <= vocab, cap
        for o in sc.objects:
            assert f"{o.colour} {o.shape}" in cap
            assert (f"{o.size} {o.colour} {o.shape}" in cap) == sc.size_in_caption
        assert cap == S.caption_without_position(sc)


def test_caption_without_position_order_says_nothing_about_place():
    """Swapping two objects' places leaves the caption unchanged."""
    for i in range(200):
        sc = S.sample_scene(i, "train")
        if len(sc.objects) != 2:
            continue
        a, b = sc.objects
        swapped = S.Scene((S.SceneObject(a.shape, a.colour, b.position, a.size),
                           S.SceneObject(b.shape, b.colour, a.position, b.size)), sc.background,
                          sc.background2, sc.split_vertical, sc.jitter, sc.caption, sc.size_in_caption)
        assert S.caption_without_position(swapped) == S.caption_without_position(sc)
