"""Step caching (cache=SPEC): the spec, the backbone cut (first -> rest -> tail is the whole graph),
no-op settings bit-identical to no cache, and parity with diffusers' own hooks on tiny pipelines
(first-block cache and TaylorSeer on SD3; DeepCache against a torch twin of its method on SD)."""

import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.families import get_family
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.runtime.backbone_split import run_whole, split
from onnxdiffusion.techniques.cache_deepcache import DeepCache
from onnxdiffusion.techniques.cache_first_block import FirstBlock
from onnxdiffusion.techniques.cache_taylorseer import TaylorSeer
from onnxdiffusion.techniques.caching import parse_cache

pytestmark = pytest.mark.slow

PROMPT = "a red circle on the left"
SD3_SIZE = (32, 32)


@pytest.mark.parametrize("text,want", [
    ("first_block:0.2", FirstBlock(threshold=0.2)), ("taylorseer:3", TaylorSeer(interval=3)),
    ("taylorseer:4:2", TaylorSeer(interval=4, order=2)),
    ("deepcache:3", DeepCache(interval=3)), ("deepcache:2:2", DeepCache(interval=2, branch=2)),
    ("deepcache:4:L1", DeepCache(interval=4, layers=1)),
    ("deepcache:3:l2", DeepCache(interval=3, layers=2)), ("none", None), (None, None)])
def test_spec_parses(text, want):
    assert parse_cache(text) == want
    if want is not None:
        assert parse_cache(str(want)) == want


def test_layer_branch_reads_back_as_written():
    assert str(parse_cache("deepcache:4:l1")) == "deepcache:4:L1" and str(parse_cache("deepcache:4")) == "deepcache:4:1"


@pytest.mark.parametrize("text", ["first_block", "first_block:-1", "first_block:nan", "taylorseer:0", "taylorseer:x",
                                  "deepcache:2:0", "teacache:0.1", "taylorseer:2:9", "deepcache:1:2:3",
                                  "deepcache:2:L0", "deepcache:2:Lx", "deepcache:2:L", "deepcache:L1"])
def test_bad_spec_is_one_line_error(text):
    with pytest.raises(UserError) as info:
        parse_cache(text)
    assert "\n" not in str(info.value) and text.split(":")[0] in str(info.value)


def _session(m):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def _feeds(sess, rng, batch=2, text=8):
    """Random feeds at the graph's shapes: latents 4x4 tokens per side (or 8x8 NCHW), text of `text` tokens."""
    out = {}
    for i in sess.get_inputs():
        shape = [batch if d == "batch_size" else text if d == "sequence_length" else 8 if isinstance(d, str) else d
                 for d in i.shape]
        out[i.name] = (np.full(shape, 500.0, np.float32) if i.name == "timestep"
                       else rng.standard_normal(shape, dtype=np.float32))
    return out


@pytest.mark.parametrize("folder_fixture,method", [("tiny_sd3_onnx", "first_block"), ("tiny_onnx", "deepcache")])
def test_cut_backbone_is_the_whole_graph(request, folder_fixture, method):
    import json

    folder = request.getfixturevalue(folder_fixture)
    manifest = json.loads((folder / "manifest.json").read_text())
    family = get_family(manifest["family"])
    model = onnx.load(str(folder / manifest["components"][family.backbone]["path"]))
    span, probe = family.cache_span(method, [n.name for n in model.graph.node])
    sg = split(model, span, probe)
    assert len(sg.span_outputs) == 1 and (probe is None or sg.probe and sg.hidden_in)
    whole = _session(model)
    feeds = _feeds(whole, np.random.default_rng(0))
    want = whole.run(None, feeds)[0]
    got = run_whole(_session(sg.first), _session(sg.rest), _session(sg.tail), sg, feeds)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_layer_branch_cut_is_the_whole_graph(tiny_onnx, layers):
    """DeepCache at layer granularity: the always-run part is conv_in, `layers` - 1 down layers and the last
    `layers` up resnets (the tiny UNet has 3 down layers after conv_in: one with attention, a downsampler)."""
    import json

    manifest = json.loads((tiny_onnx / "manifest.json").read_text())
    model = onnx.load(str(tiny_onnx / manifest["components"]["unet"]["path"]))
    names = [n.name for n in model.graph.node]
    span, _ = get_family("sd").cache_span("deepcache", names, layers=layers)
    sg = split(model, span)
    whole = _session(model)
    feeds = _feeds(whole, np.random.default_rng(1))
    want = whole.run(None, feeds)[0]
    assert len(sg.span_outputs) == 1
    assert np.abs(run_whole(_session(sg.first), _session(sg.rest), _session(sg.tail), sg, feeds) - want).max() \
        <= 1e-6 * np.abs(want).max()
    # the tail runs exactly the last `layers` up resnets
    ran = {"/".join(n.name.split("/")[2:4]) for n in sg.tail.graph.node
           if "/up_blocks." in n.name and "/resnets." in n.name}
    assert len(ran) == layers
    with pytest.raises(ValueError, match="L4"):
        get_family("sd").cache_span("deepcache", names, layers=4)


def test_wrong_method_for_the_backbone_is_refused(tiny_onnx, tiny_sd3_onnx):
    with pytest.raises(UserError, match="deepcache") as info:
        Pipeline.from_folder(tiny_onnx, verify=False)(PROMPT, steps=3, cache="first_block:0.1")
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="UNet"):
        Pipeline.from_folder(tiny_sd3_onnx, verify=False)(PROMPT, steps=3, cache="deepcache:2")
    with pytest.raises(UserError, match="compile-loop"):  # no Loop graph in this folder
        Pipeline.from_folder(tiny_sd3_onnx, verify=False)(PROMPT, steps=3, cache="first_block:0.1", loop="loop")
    with pytest.raises(UserError, match="host loop and the Loop graph"):
        Pipeline.from_folder(tiny_sd3_onnx, verify=False)(PROMPT, steps=3, cache="first_block:0.1", loop="unrolled")


@pytest.mark.parametrize("spec", ["first_block:0", "taylorseer:1", "deepcache:1", "deepcache:1:L1"])
def test_noop_settings_are_bit_identical(tiny_sd3_onnx, tiny_onnx, spec):
    pipe = Pipeline.from_folder(tiny_onnx if spec.startswith("deep") else tiny_sd3_onnx, verify=False)
    base = pipe(PROMPT, steps=6, seed=2)
    assert np.array_equal(pipe(PROMPT, steps=6, seed=2, cache=spec).images, base.images)


# --- parity with diffusers' hooks (Flux: enable_cache; SD3's transformer has none, and
# apply_first_block_cache fails on it: its last block returns no encoder states) ------------------

FLUX_H = FLUX_W = 16


def _flux_reference(src, latents, steps, config=None):
    from diffusers import FluxPipeline

    ref = FluxPipeline.from_pretrained(src, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    if config is not None:
        ref.transformer.enable_cache(config)
    img = ref(PROMPT, height=FLUX_H, width=FLUX_W, num_inference_steps=steps, guidance_scale=3.5, latents=latents,
              max_sequence_length=16, output_type="np").images
    return (img * 255).round().astype(np.uint8)


@pytest.mark.parametrize("spec", ["first_block:0.4", "first_block:0.8", "taylorseer:2", "taylorseer:3:2"])
def test_cache_matches_diffusers_hooks_on_flux(tiny_flux_diffusers, tiny_flux_onnx, spec):
    import torch
    from diffusers import FluxPipeline
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    c = parse_cache(spec)
    pipe = Pipeline.from_folder(tiny_flux_onnx, verify=False)
    steps = 12
    shape = pipe.latent_shape_for(1, FLUX_H, FLUX_W)
    latents = torch.from_numpy(np.random.default_rng(4).standard_normal(shape, dtype=np.float32))
    base = pipe(PROMPT, steps=steps, guidance=3.5, height=FLUX_H, width=FLUX_W, latents=latents.numpy())
    ours = pipe(PROMPT, steps=steps, guidance=3.5, height=FLUX_H, width=FLUX_W, latents=latents.numpy(), cache=spec)
    if c.method == "first_block":
        config = FirstBlockCacheConfig(threshold=c.threshold)
    else:
        model = onnx.load(str(tiny_flux_onnx / "transformer" / "model.onnx"), load_external_data=False)
        span, _ = get_family("flux").cache_span("taylorseer", [n.name for n in model.graph.node])
        patterns = [p.strip("/").removeprefix("model/").replace(".", r"\.") for p in span]  # our span's blocks
        config = TaylorSeerCacheConfig(cache_interval=c.interval, max_order=c.order, taylor_factors_dtype=torch.float32,
                                       cache_identifiers=patterns)
    ref_base = _flux_reference(tiny_flux_diffusers, latents, steps)
    ref = _flux_reference(tiny_flux_diffusers, latents, steps, config)
    moved, db = psnr(ref, ref_base), psnr(ours.images, ref)
    print(f"\n{spec}: diffusers cached vs uncached {moved:.1f} dB; ours vs diffusers cached {db:.1f} dB; "
          f"uncached ours vs diffusers {psnr(base.images, ref_base):.1f} dB")
    assert moved < 60.0  # the cache visibly moved diffusers' image
    assert db >= 35.0


# --- DeepCache: the DeepCache package targets older diffusers; a torch twin of its method instead ----

def deepcache_forward(unet, state: dict, interval: int, branch: int = 1):
    """UNet2DConditionModel.forward (no added conditioning) where, on all but every `interval`-th call,
    the deep path (down blocks from `branch` on, mid block, up blocks but the last `branch`) is skipped
    and its last output reused: DeepCache's uniform schedule (Ma et al. 2023)."""

    def forward(sample, timestep, encoder_hidden_states, *args, return_dict=False, **kwargs):
        full = state["step"] % interval == 0 or "feature" not in state
        state["step"] += 1
        t = timestep.expand(sample.shape[0]) if timestep.ndim else timestep[None].expand(sample.shape[0])
        emb = unet.time_embedding(unet.time_proj(t).to(sample.dtype))
        h = unet.conv_in(sample)
        res = (h,)
        for i, block in enumerate(unet.down_blocks):
            if i >= branch and not full:
                break
            kw = {"encoder_hidden_states": encoder_hidden_states} if getattr(block, "has_cross_attention", False) else {}
            h, r = block(hidden_states=h, temb=emb, **kw)
            res += r
        n_up = len(unet.up_blocks)
        if full:
            h = unet.mid_block(h, emb, encoder_hidden_states=encoder_hidden_states)
        else:
            h = state["feature"]
            # the skips the deep up blocks would have read (a shallow block's downsampler output among them)
            made = 1 + sum(len(b.resnets) + (b.downsamplers is not None) for b in unet.down_blocks)
            deep = sum(len(b.resnets) for b in unet.up_blocks[:n_up - branch])
            res = res[:made - deep]
        for i, block in enumerate(unet.up_blocks):
            if i < n_up - branch and not full:
                continue
            r, res = res[-len(block.resnets):], res[:-len(block.resnets)]
            kw = {"encoder_hidden_states": encoder_hidden_states} if getattr(block, "has_cross_attention", False) else {}
            h = block(hidden_states=h, temb=emb, res_hidden_states_tuple=r, **kw)
            if i == n_up - branch - 1:
                state["feature"] = h
        h = unet.conv_out(unet.conv_act(unet.conv_norm_out(h)))
        return (h,)

    return forward


def deepcache_layer_forward(unet, state: dict, interval: int, layers: int):
    """DeepCache at layer granularity (the DeepCache package's cache_layer_id / cache_block_id, counted here
    in skip layers): on cached steps conv_in, the next `layers` - 1 down layers (a resnet with its attention,
    or a downsampler) and the last `layers` up resnets run; the feature entering the first of them is reused."""
    import torch

    def attend(block, j, h, ehs):
        return block.attentions[j](h, encoder_hidden_states=ehs, return_dict=False)[0] \
            if getattr(block, "attentions", None) else h

    def forward(sample, timestep, encoder_hidden_states, *args, return_dict=False, **kwargs):
        full = state["step"] % interval == 0 or "feature" not in state
        state["step"] += 1
        t = timestep.expand(sample.shape[0]) if timestep.ndim else timestep[None].expand(sample.shape[0])
        emb = unet.time_embedding(unet.time_proj(t).to(sample.dtype))
        h = unet.conv_in(sample)
        res = [h]
        down_budget = float("inf") if full else layers - 1
        for block in unet.down_blocks:
            for j, resnet in enumerate(block.resnets):
                if len(res) - 1 < down_budget:
                    h = attend(block, j, resnet(h, emb), encoder_hidden_states)
                    res.append(h)
            if block.downsamplers is not None and len(res) - 1 < down_budget:
                h = block.downsamplers[0](h)
                res.append(h)
        ups = [(block, j) for block in unet.up_blocks for j in range(len(block.resnets))]
        start = len(ups) - layers
        if full:
            h = unet.mid_block(h, emb, encoder_hidden_states=encoder_hidden_states)
        for k, (block, j) in enumerate(ups):
            if k < start and not full:
                continue
            if k == start:
                if full:
                    state["feature"] = h
                h = state["feature"]
            h = attend(block, j, block.resnets[j](torch.cat([h, res.pop()], dim=1), emb), encoder_hidden_states)
            if j == len(block.resnets) - 1 and block.upsamplers is not None:
                h = block.upsamplers[0](h)
        h = unet.conv_out(unet.conv_act(unet.conv_norm_out(h)))
        return (h,)

    return forward


@pytest.mark.parametrize("interval", [2, 3])
def test_deepcache_matches_a_torch_twin(tiny_diffusers, tiny_onnx, interval):
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = Pipeline.from_folder(tiny_onnx, verify=False)
    base = pipe(PROMPT, steps=10, guidance=4.0, seed=6)
    ours = pipe(PROMPT, steps=10, guidance=4.0, seed=6, cache=f"deepcache:{interval}")
    ref = StableDiffusionPipeline.from_pretrained(tiny_diffusers, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    lat = torch.from_numpy(base.init_latents)
    kw = dict(latents=lat, num_inference_steps=10, guidance_scale=4.0, output_type="np",
              height=lat.shape[2] * 4, width=lat.shape[3] * 4)
    plain = (ref(PROMPT, **kw).images * 255).round().astype(np.uint8)
    state = {"step": 0}
    full_twin = deepcache_forward(ref.unet, {"step": 0}, 1)
    x = torch.randn(2, 4, 8, 8)
    ehs = torch.randn(2, 16, 32)
    with torch.no_grad():  # the twin at interval 1 is the UNet itself
        assert torch.allclose(full_twin(x, torch.tensor(500.0), ehs)[0], ref.unet(x, 500.0, ehs).sample, atol=1e-5)
    ref.unet.forward = deepcache_forward(ref.unet, state, interval)
    twin = (ref(PROMPT, **kw).images * 255).round().astype(np.uint8)
    moved, db = psnr(twin, plain), psnr(ours.images, twin)
    print(f"\ndeepcache:{interval}: twin cached vs uncached {moved:.1f} dB; ours vs twin {db:.1f} dB")
    assert state["step"] == 10 and moved < 60.0
    assert db >= 35.0


@pytest.mark.parametrize("spec", ["deepcache:3:L1", "deepcache:2:L2"])
def test_layer_deepcache_matches_a_torch_twin(tiny_diffusers, tiny_onnx, spec):
    import torch
    from diffusers import StableDiffusionPipeline

    interval, layers = int(spec.split(":")[1]), int(spec.split(":")[2][1:])
    pipe = Pipeline.from_folder(tiny_onnx, verify=False)
    base = pipe(PROMPT, steps=10, guidance=4.0, seed=6)
    ours = pipe(PROMPT, steps=10, guidance=4.0, seed=6, cache=spec)
    ref = StableDiffusionPipeline.from_pretrained(tiny_diffusers, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    lat = torch.from_numpy(base.init_latents)
    kw = dict(latents=lat, num_inference_steps=10, guidance_scale=4.0, output_type="np",
              height=lat.shape[2] * 4, width=lat.shape[3] * 4)
    plain = (ref(PROMPT, **kw).images * 255).round().astype(np.uint8)
    x, ehs = torch.randn(2, 4, 8, 8), torch.randn(2, 16, 32)
    with torch.no_grad():  # every step full: the UNet itself
        full = deepcache_layer_forward(ref.unet, {"step": 0}, 1, layers)(x, torch.tensor(500.0), ehs)[0]
        assert torch.allclose(full, ref.unet(x, 500.0, ehs).sample, atol=1e-5)
    state = {"step": 0}
    ref.unet.forward = deepcache_layer_forward(ref.unet, state, interval, layers)
    twin = (ref(PROMPT, **kw).images * 255).round().astype(np.uint8)
    moved, db = psnr(twin, plain), psnr(ours.images, twin)
    print(f"\n{spec}: twin cached vs uncached {moved:.1f} dB; ours vs twin {db:.1f} dB")
    assert state["step"] == 10 and moved < 60.0
    assert db >= 35.0
