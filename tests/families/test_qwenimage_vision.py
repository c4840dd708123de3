"""Qwen2.5-VL's picture side in numpy (families/qwenimage_vision.py) against transformers: the image processor's
patches and grid (the folder's min/max pixels), the 3D rope positions of get_rope_index, and the vision tower
fed the numpy layout (export/vl_encoder.py's wrapper) against the tower itself, for pictures of several sizes
and aspect ratios, two in one prompt (Edit-Plus) and batch rows of different lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.families import qwenimage_vision as vision

SIZES = [(100, 180), (120, 90), (13, 700), (2000, 1500)]  # (height, width): wide, tall, a strip, past max_pixels


@pytest.fixture(scope="module")
def vl():
    from tiny_qwenedit import MAX_PIXELS, MIN_PIXELS, _no_video_class, _text_encoder, edit_tokenizer
    from transformers import Qwen2VLImageProcessor

    torch.manual_seed(0)
    tokenizer = edit_tokenizer()
    images = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    model = _text_encoder(tokenizer)
    cfg = vision.VisionConfig.from_dict(vision.vision_config(images.to_dict(), model.config.vision_config.to_dict()))
    return _no_video_class()(images, tokenizer), model, cfg


def _pictures(sizes, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("size", SIZES)
def test_patches_and_grid_are_the_processors(vl, size):
    processor, _, cfg = vl
    (pic,) = _pictures([size])
    want = processor.image_processor(images=[pic], return_tensors="np")
    patches, grid = vision.pixel_patches(pic, cfg)
    assert [list(grid)] == want["image_grid_thw"].tolist()
    assert grid[1] * grid[2] * 14 * 14 <= cfg.max_pixels
    np.testing.assert_allclose(patches, want["pixel_values"], rtol=0, atol=1e-6)


def test_rope_positions_and_tower_are_transformers(vl):
    from onnxdiffusion.export.vl_encoder import VisionLanguageHiddenStates

    processor, model, cfg = vl
    template = "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: " \
               "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    pics = _pictures([(100, 180), (120, 90), (120, 90), (200, 100)], seed=1)
    texts = [template.format("make it blue"), template.format("a longer instruction: make the red circle green")]
    inp = processor(text=texts, images=pics, padding=True, return_tensors="pt")
    mine = [vision.pixel_patches(p, cfg) for p in pics]
    ids, mask = inp["input_ids"].numpy(), inp["attention_mask"].numpy()
    assert mask[0].sum() < mask[1].sum()  # a padded row
    want, _ = model.model.get_rope_index(inp["input_ids"], inp["image_grid_thw"], None, None, inp["attention_mask"])
    got = vision.rope_positions(ids, mask, [g for _, g in mine], model.config.image_token_id,
                                model.config.vision_start_token_id, cfg.merge)
    np.testing.assert_array_equal(got, want.numpy())
    feeds = {k: torch.from_numpy(v) for k, v in vision.vision_feeds(mine, cfg).items()}
    wrapper = VisionLanguageHiddenStates(model).eval()
    with torch.no_grad():
        tower = model.model.visual(inp["pixel_values"], grid_thw=inp["image_grid_thw"])
        ours = wrapper.tower(feeds["pixel_values"], feeds["vision_position_ids"], feeds["vision_window_ids"],
                             feeds["vision_image_ids"], feeds["vision_merge_order"])
        torch.testing.assert_close(ours, tower, rtol=0, atol=1e-5)
        ref = model(**inp, output_hidden_states=True).hidden_states[-1]
        hidden = wrapper(inp["input_ids"], inp["attention_mask"], torch.from_numpy(got), *feeds.values())
    keep = inp["attention_mask"].bool()
    torch.testing.assert_close(hidden[keep], ref[keep], rtol=0, atol=1e-5)


def test_windows_cover_every_token_once(vl):
    _, _, cfg = vl
    mine = [vision.pixel_patches(p, cfg) for p in _pictures([(100, 180), (60, 60)])]
    feeds = vision.vision_feeds(mine, cfg)
    n = sum(len(x) for x, _ in mine)
    assert feeds["pixel_values"].shape[0] == n
    assert sorted(feeds["vision_merge_order"].tolist()) == list(range(n // cfg.merge ** 2))
    # windows never span two pictures
    for w in np.unique(feeds["vision_window_ids"]):
        assert len(np.unique(feeds["vision_image_ids"][feeds["vision_window_ids"] == w])) == 1


def test_bad_preprocessor_configs_are_one_line_errors():
    good = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    with pytest.raises(UserError, match="disagree"):
        vision.vision_config({**good, "patch_size": 16}, {"patch_size": 14})
    with pytest.raises(UserError, match="do_normalize"):
        vision.vision_config({**good, "do_normalize": False}, {})
    with pytest.raises(UserError, match="vision"):
        vision.VisionConfig.from_dict({"patch": "x"})
    with pytest.raises(UserError, match="aspect"):
        vision.smart_resize(1, 300, 28, 3136, 10000)
