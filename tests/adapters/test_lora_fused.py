"""LoRA fused at switch (adapters/fused.py): a points folder's host loop runs the plain graph without an adapter
and merged weights with one; the merged step computes what the insertion points' branch computes."""

import numpy as np
import onnx
import pytest

from lora_helpers import make_lora
from onnxdiffusion.adapters.folder import add_points
from onnxdiffusion.adapters.fused import _requantize, merged_feeds, strip_branches
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.onnxio import fp16_storage
from onnxdiffusion.runtime import Pipeline

PROMPT = "a red circle on the left"
KW = dict(steps=6, seed=3, guidance=5.0)


@pytest.fixture(scope="module")
def lora(tiny_diffusers, tmp_path_factory):
    return make_lora(tiny_diffusers, tmp_path_factory.mktemp("lora") / "plain", seed=1)


@pytest.fixture(scope="module")
def points(tiny_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("points") / "model"
    add_points(tiny_onnx, out)
    return out


def _signature(model: onnx.ModelProto):
    g = model.graph
    return ([(n.name, n.op_type, list(n.input), list(n.output)) for n in g.node], [i.name for i in g.input],
            [t.name for t in g.initializer], [o.name for o in g.output])


def test_stripping_the_branches_gives_the_original_graph(tiny_onnx, points):
    src = tiny_onnx / "unet" / "model.onnx"
    original = onnx.load(str(src), load_external_data=False)
    fp16_storage.expand(original, str(src))
    model = onnx.load(str(points / "unet" / "model.onnx"), load_external_data=False)
    assert any(n.name.startswith("/lora/") for n in model.graph.node)
    strip_branches(model)
    assert _signature(model) == _signature(original)


def test_sessions_made_on_use(points, lora):
    """Without an adapter only the plain session is made, and an adapter-only pipeline never makes it."""
    pipe = Pipeline.from_folder(points)
    pipe(PROMPT, **KW)
    assert pipe.backbone_loaded and pipe.lora.fused._fused is None
    other = Pipeline.from_folder(points)
    other(PROMPT, loras=[(lora, 0.7)], **KW)
    assert not other.backbone_loaded and other.lora.fused._fused is not None


def test_merged_step_equals_the_branch_step(points, lora):
    """One guided backbone call: merged weights (fused session) against the insertion points' branch (the points
    graph, A/B bound); and the no-adapter step of the plain session against the points graph's."""
    from onnxdiffusion.runtime.backbone import FedBackbone

    pipe = Pipeline.from_folder(points)
    adapter = pipe.lora_feeds([(lora, 0.7)])
    shape = pipe.latent_shape_for(1)
    merged = pipe.guided_backbone([PROMPT], None, KW["guidance"], 32, 32, shape, adapter=adapter)
    assert merged.session is pipe.lora.fused.fused()
    from onnxdiffusion.runtime.session import make_session

    graph = make_session(points / "unet" / "model.onnx", threads=1)
    cond = {k: v for k, v in merged.conditioning.items()}
    branch = FedBackbone(graph, shape, {k: v[1:] for k, v in cond.items()}, {k: v[:1] for k, v in cond.items()},
                         KW["guidance"], extra=adapter.for_component("unet"))
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    a, b = merged(x, 500.0), branch(x, 500.0)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert np.abs(a - pipe.guided_backbone([PROMPT], None, KW["guidance"], 32, 32, shape)(x, 500.0)).max() > 1e-2
    plain = pipe.guided_backbone([PROMPT], None, KW["guidance"], 32, 32, shape)
    pointed = FedBackbone(graph, shape, {k: v[1:] for k, v in cond.items()}, {k: v[:1] for k, v in cond.items()},
                          KW["guidance"])
    np.testing.assert_array_equal(plain(x, 500.0), pointed(x, 500.0))


def test_switching_sets_and_scales(points, lora, tiny_diffusers, tmp_path):
    """Per-request switching: two sets and two scales on one pipeline, each image as a fresh pipeline gives it;
    merged weights are computed once per set and kept on its AdapterFeeds."""
    other = make_lora(tiny_diffusers, tmp_path / "other", seed=5)
    pipe = Pipeline.from_folder(points)
    sets = [[(lora, 0.7)], [(other, 1.0)], [(lora, 0.7), (other, 0.5)], [(lora, -0.3)]]
    for loras in sets + sets[:1]:
        fresh = Pipeline.from_folder(points)(PROMPT, loras=loras, **KW).images
        np.testing.assert_array_equal(pipe(PROMPT, loras=loras, **KW).images, fresh)
    adapter = pipe.lora_feeds(sets[0])
    first = pipe.lora.fused.feeds(adapter)
    assert pipe.lora.fused.feeds(adapter) is first
    assert psnr(pipe(PROMPT, loras=adapter, **KW).images, pipe(PROMPT, **KW).images) < 37.0


def test_requantize_keeps_the_grid():
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, (8, 6)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, 6).astype(np.float32)
    same_q, same_s = _requantize(q, scale, np.zeros((8, 6), np.float32), axis=1)
    np.testing.assert_array_equal(same_q, q)
    np.testing.assert_array_equal(same_s, scale)
    delta = np.zeros((8, 6), np.float32)
    delta[:, 0] = 0.3 * scale[0]  # stays on the grid: q + round(0.3) = q
    delta[0, 1] = 10.0  # outgrows channel 1's grid: its scale grows
    new_q, new_s = _requantize(q, scale, delta, axis=1)
    np.testing.assert_array_equal(new_q[:, 0], q[:, 0])
    assert new_s[1] > scale[1] and np.array_equal(new_s[2:], scale[2:])
    assert abs(float(new_q[0, 1]) * new_s[1] - (q[0, 1] * scale[1] + 10.0)) <= new_s[1] / 2 + 1e-6


def test_conv_int8_bias_follows_a_grown_scale():
    from onnxdiffusion.adapters.fused import FusedLayer

    layer = FusedLayer("m", "conv_int8", "w", "s", "b")
    w = np.array([[[[100]]], [[[-50]]]], np.int8)
    bases = {"w": w, "s": np.array([0.01, 0.02], np.float32), "b": np.array([1000, -400], np.int32)}
    a = np.ones((1, 1, 1, 1), np.float32)  # [r, in, 1, 1]
    b = np.array([[[[1.0]]], [[[0.0]]]], np.float32)  # [out, r, 1, 1]: channel 0 grows past 127 * 0.01
    out = merged_feeds({"m": layer}, bases, {"m.lora_A": a, "m.lora_B": b})
    assert out["s"][0] == pytest.approx(2.0 / 127) and out["s"][1] == bases["s"][1]
    assert out["b"][1] == -400 and out["b"][0] == round(1000 * 0.01 / out["s"][0])


def test_external_weights_in_hard_linked_files(tiny_onnx, lora, tmp_path):
    """A folder whose weights are external data, and its points copy (data files hard-linked, as `lora points`
    writes it): the derived sessions read the weights where they are; same images as the inline folder."""
    from onnxdiffusion.folder.relayout import store_external

    ext = tmp_path / "external"
    assert "unet" in store_external(tiny_onnx, ext, min_bytes=0)
    add_points(ext, tmp_path / "points")
    assert (tmp_path / "points" / "unet" / "model.onnx_data").stat().st_nlink > 1
    inline = tmp_path / "inline_points"
    add_points(tiny_onnx, inline)
    for loras in (None, [(lora, 0.7)]):
        np.testing.assert_array_equal(Pipeline.from_folder(tmp_path / "points")(PROMPT, loras=loras, **KW).images,
                                      Pipeline.from_folder(inline)(PROMPT, loras=loras, **KW).images)
