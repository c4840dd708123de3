"""The embedded model's text-encoder parse objective (models/training/train_pipeline.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("train_pipeline")

from onnxdiffusion.evaluate import scenes as S  # noqa: E402


def test_parse_targets_follow_the_scene_not_the_caption_order():
    seeds = range(400)
    targets = T.caption_slot_targets(seeds)
    assert targets.shape == (400, len(S.POSITION_NAMES), 3)
    swapped_seen = omitted_seen = 0
    for i in seeds:
        sc = S.sample_scene(i, "train")
        lab = S.slot_labels(sc)
        assert np.array_equal(targets[i, :, 0], lab["shape"]) and np.array_equal(targets[i, :, 1], lab["colour"])
        if sc.size_in_caption:
            assert np.array_equal(targets[i, :, 2], lab["size"])
        else:  # a caption without sizes cannot be parsed for them: ignored, but empty slots stay 0
            omitted_seen += 1
            assert np.all(targets[i, lab["shape"] > 0, 2] == T.IGNORE) and np.all(targets[i, lab["shape"] == 0, 2] == 0)
        if len(sc.objects) == 2 and (" right of " in sc.caption or " below " in sc.caption):
            swapped_seen += 1  # first-named object sits in the second slot of its layout
            first = sc.caption.split()[2 if sc.size_in_caption else 1]
            j = S.POSITION_NAMES.index(sc.objects[1].position)
            assert S.COLOUR_NAMES[targets[i, j, 1] - 1] == first
    assert swapped_seen > 20 and omitted_seen > 20


def test_parse_head_learns_a_separable_toy_and_ignores_masked_slots():
    torch.manual_seed(0)
    head = T.ParseHead(128)  # wider than the batch: separable
    targets = torch.from_numpy(T.caption_slot_targets(range(64)))
    pooled = torch.randn(64, 128)
    start = head.loss(pooled, targets).item()
    assert np.isfinite(start) and 0.0 <= head.accuracy(pooled, targets) <= 1.0
    masked = torch.full_like(targets, T.IGNORE)
    masked[0] = targets[0]
    # rows that are all IGNORE (dropped captions) contribute nothing
    assert head.loss(pooled, masked).item() == pytest.approx(head.loss(pooled[:1], targets[:1]).item(), rel=1e-5)
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(200):
        loss = head.loss(pooled, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * start and head.accuracy(pooled, targets) > 0.9
