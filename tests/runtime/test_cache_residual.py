"""The residual cache (cache=residual:INTERVAL[:ORDER]): the spec, its ramping schedule of full steps,
INTERVAL 1 bit-identical to no cache, refusal on a UNet, and parity with a torch twin of the method on
diffusers' SD3 transformer (the blocks after the first skipped on cached steps, their residual
Taylor-extrapolated and added to the first block's fresh output)."""

import math

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.techniques import caching
from onnxdiffusion.runtime.backbone_split import pruned
from onnxdiffusion.techniques.cache_residual import Residual
from onnxdiffusion.techniques.caching import parse_cache

PROMPT = "a red circle on the left"
SIZE = (32, 32)


@pytest.mark.parametrize("text,want", [("residual:5", Residual(interval=5)),
                                       ("residual:4:2", Residual(interval=4, order=2)),
                                       ("residual:3:0", Residual(interval=3, order=0))])
def test_spec_parses_and_reads_back(text, want):
    assert parse_cache(text) == want and parse_cache(str(want)) == want
    assert str(parse_cache("residual:5")) == "residual:5:1"


@pytest.mark.parametrize("text", ["residual", "residual:0", "residual:x", "residual:2:9", "residual:1:2:3",
                                  "residual:2:-1", "residual:L1"])
def test_bad_spec_is_one_line_error(text):
    with pytest.raises(UserError) as info:
        parse_cache(text)
    assert "\n" not in str(info.value) and "residual" in str(info.value)


def _spy(monkeypatch) -> list:
    made, real = [], caching.cached_backbone

    def spy(*a):
        made.append(real(*a))
        return made[-1]

    monkeypatch.setattr(caching, "cached_backbone", spy)
    return made


@pytest.mark.slow
@pytest.mark.parametrize("spec,full", [("residual:2", [0, 1, 3, 5, 7, 9, 11]), ("residual:3", [0, 1, 3, 6, 9]),
                                       ("residual:5", [0, 1, 3, 6, 10]), ("residual:9:0", [0, 1, 3, 6, 10])])
def test_full_steps_ramp_up_to_the_interval(tiny_sd3_onnx, monkeypatch, spec, full):
    made = _spy(monkeypatch)
    pipe = Pipeline.from_folder(tiny_sd3_onnx, verify=False)
    base = pipe(PROMPT, steps=12, seed=2)
    got = pipe(PROMPT, steps=12, seed=2, cache=spec)
    assert made[-1].full_steps == full and made[-1].computed == len(full)
    assert psnr(got.images, base.images) < 60.0  # the cached steps moved the image


@pytest.mark.slow
def test_cached_steps_run_the_first_piece_cut_to_the_image_stream(tiny_sd3_onnx, monkeypatch):
    """A cached step needs the first block's image-stream output (and the tail's reads), not its text stream:
    it runs a fourth piece, fewer nodes than the first, the same values for what it gives."""
    made = _spy(monkeypatch)
    pipe = Pipeline.from_folder(tiny_sd3_onnx, verify=False)
    pipe(PROMPT, steps=8, seed=2, cache="residual:3")
    cb = made[-1]
    (first, f_in, f_out), (lite, l_in, l_out) = cb.pieces
    (_, _, _, lite_session), sg = pipe.technique_state.get("cache", dict)[("residual", 0)]
    assert lite is lite_session and set(l_out) < set(f_out) and set(sg.hidden_in) <= set(l_out)
    made_by = {o.name for o in sg.first.graph.output}
    cut = pruned(sg.first, [t for t in l_out if t in made_by], "lite")
    assert len(cut.graph.node) < len(sg.first.graph.node)  # the text stream after attention is gone
    rng = np.random.default_rng(0)
    shapes = {"sample": (2, 16, 8, 8), "encoder_hidden_states": (2, 8, 80), "pooled_projections": (2, 64)}
    feeds = {n: rng.standard_normal(shape, dtype=np.float32) for n, shape in shapes.items()}
    feeds["timestep"] = np.full([2], 500.0, np.float32)
    feeds = {n: feeds[n] for n in f_in}
    want = dict(zip(f_out, first.run(None, feeds)))
    got = dict(zip(l_out, lite.run(None, {n: feeds[n] for n in l_in})))
    assert all(np.array_equal(got[k], want[k]) for k in l_out)


@pytest.mark.slow
def test_interval_one_is_bit_identical(tiny_sd3_onnx):
    pipe = Pipeline.from_folder(tiny_sd3_onnx, verify=False)
    base = pipe(PROMPT, steps=6, seed=2)
    assert np.array_equal(pipe(PROMPT, steps=6, seed=2, cache="residual:1").images, base.images)
    assert np.array_equal(pipe(PROMPT, steps=6, seed=2, cache="residual:1:3").images, base.images)


def test_refused_on_a_unet(tiny_onnx):
    with pytest.raises(UserError, match="deepcache") as info:
        Pipeline.from_folder(tiny_onnx, verify=False)(PROMPT, steps=3, cache="residual:3")
    assert "\n" not in str(info.value)


def residual_forward(tr, state: dict, interval: int, order: int):
    """SD3Transformer2DModel.forward (no ControlNet, no skip layers) with the residual cache: block 0 always
    runs; the other blocks run on the ramping schedule (gaps 1, 2, ... up to `interval`) and otherwise
    stand in as block 0's output + the Taylor series (in the step index) of their residual."""
    import torch

    def forward(hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None, *args,
                return_dict=False, **kwargs):
        step = state["step"]
        state["step"] += 1
        height, width = hidden_states.shape[-2:]
        h = tr.pos_embed(hidden_states)
        temb = tr.time_text_embed(timestep, pooled_projections)
        ctx = tr.context_embedder(encoder_hidden_states)
        ctx, h = tr.transformer_blocks[0](hidden_states=h, encoder_hidden_states=ctx, temb=temb)
        if step >= state["next"]:
            h0 = h
            for block in tr.transformer_blocks[1:]:
                ctx, h = block(hidden_states=h, encoder_hidden_states=ctx, temb=temb)
            new = [h - h0]
            for k in range(min(order, len(state["factors"]))):
                new.append((new[k] - state["factors"][k]) / (step - state["last"]))
            state.update(factors=new, last=step, next=step + state["gap"], gap=min(state["gap"] + 1, interval))
            state["full"].append(step)
        else:
            d = step - state["last"]
            h = h + sum(f * (d ** k / math.factorial(k)) for k, f in enumerate(state["factors"]))
        h = tr.proj_out(tr.norm_out(h, temb))
        p, c = tr.config.patch_size, tr.out_channels
        h = h.reshape(h.shape[0], height // p, width // p, p, p, c)
        return (torch.einsum("nhwpqc->nchpwq", h).reshape(h.shape[0], c, height, width),)

    return forward


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["residual:3", "residual:4:2"])
def test_matches_a_torch_twin_on_sd3(tiny_sd3_diffusers, tiny_sd3_onnx, spec):
    import torch
    from diffusers import StableDiffusion3Pipeline

    c = parse_cache(spec)
    pipe = Pipeline.from_folder(tiny_sd3_onnx, verify=False)
    base = pipe(PROMPT, steps=12, sampler="flow_euler", guidance=5.0, seed=3)
    ours = pipe(PROMPT, steps=12, sampler="flow_euler", guidance=5.0, seed=3, cache=spec)
    ref = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_diffusers, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    kw = dict(latents=torch.from_numpy(base.init_latents), height=SIZE[0], width=SIZE[1], num_inference_steps=12,
              guidance_scale=5.0, output_type="np")
    plain = (ref(PROMPT, **kw).images * 255).round().astype(np.uint8)
    full_twin = residual_forward(ref.transformer, {"step": 0, "next": 0, "gap": 1, "factors": [], "full": []}, 1, 1)
    x, ctx, pooled = torch.randn(2, 16, 8, 8), torch.randn(2, 10, 80), torch.randn(2, 64)
    with torch.no_grad():  # interval 1: every step full, the transformer itself
        want = ref.transformer(x, ctx, pooled, torch.tensor([500.0, 500.0])).sample
        assert torch.allclose(full_twin(x, ctx, pooled, torch.tensor([500.0, 500.0]))[0], want, atol=1e-5)
    state = {"step": 0, "next": 0, "gap": 1, "factors": [], "full": []}
    ref.transformer.forward = residual_forward(ref.transformer, state, c.interval, c.order)
    twin = (ref(PROMPT, **kw).images * 255).round().astype(np.uint8)
    moved, db = psnr(twin, plain), psnr(ours.images, twin)
    print(f"\n{spec}: twin cached vs uncached {moved:.1f} dB; ours vs twin {db:.1f} dB; twin full steps {state['full']}")
    assert state["step"] == 12 and len(state["full"]) < 12 and moved < 60.0
    assert db >= 35.0
