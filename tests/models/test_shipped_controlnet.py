"""The shipped ControlNet (models/controlnets/shapes-sd-position) puts objects where its condition says.

Only its ONNX copy (models/shapes-sd-onnx/controlnets/position) is tracked; the diffusers folder's weights are
rebuilt from it (models/training/controlnet_weights.py, `make controlnet-weights`), here once per run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from onnxdiffusion.evaluate import scenes as S

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "controlnets" / "shapes-sd-position"


@pytest.fixture(scope="session")
def net(tmp_path_factory) -> Path:
    """The diffusers ControlNet folder: its config and the weights rebuilt from the ONNX copy (checked byte for
    byte against the folder's weights.sha256 before they are written)."""
    from conftest import shared_folder
    from controlnet_weights import write_weights

    return shared_folder(tmp_path_factory, "shipped_controlnet", lambda root: write_weights(out=root / "net"))


def test_the_weights_are_rebuilt_byte_for_byte(net):
    import hashlib

    from controlnet_weights import parameters

    want = (SHIPPED / "weights.sha256").read_text().split()
    assert want[1] == "diffusion_pytorch_model.safetensors"
    assert hashlib.sha256((net / want[1]).read_bytes()).hexdigest() == want[0]
    # every constant of the graph is one parameter: none left over, none twice (parameters() raises otherwise)
    assert len(parameters(ROOT / "models" / "shapes-sd-onnx" / "controlnets" / "position" / "model.onnx")) == 168


def test_the_folder_is_small_fp16_diffusers_controlnet(net):
    from onnxdiffusion.adapters.safetensors_io import read

    cfg = json.loads((net / "config.json").read_text())
    assert cfg["_class_name"] == "ControlNetModel"
    # two stride-2 convolutions: 64x64 conditions -> the 16x16 latents of shapes-sd (VAE factor 4)
    assert len(cfg["conditioning_embedding_out_channels"]) == 3
    weights = net / "diffusion_pytorch_model.safetensors"
    assert weights.stat().st_size < 5_200_000
    tensors, _ = read(weights)
    assert {a.dtype for a in tensors.values()} == {np.dtype(np.float16)}
    assert "controlnet_cond_embedding.conv_in.weight" in tensors
    # trained: the zero-initialised output convolutions are no longer zero
    assert np.abs(tensors["controlnet_mid_block.weight"].astype(np.float32)).max() > 1e-3


@pytest.mark.slow
def test_objects_land_in_the_conditioned_slots(net):
    """Position-free prompts: the condition alone decides where the objects go (experiments/controlnet)."""
    import torch
    from diffusers import ControlNetModel, DDIMScheduler, StableDiffusionControlNetPipeline

    from onnxdiffusion.evaluate.judge import Judge, score_scenes

    model = ROOT / "models" / "shapes-sd"
    pipe = StableDiffusionControlNetPipeline.from_pretrained(
        model, controlnet=ControlNetModel.from_pretrained(net, torch_dtype=torch.float32),
        torch_dtype=torch.float32, safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = DDIMScheduler.from_pretrained(model / "scheduler")
    pipe.set_progress_bar_config(disable=True)
    scenes = S.scenes("heldout", 8)
    # the same scenes with every object moved to another slot: the pictures must follow the condition
    moved = [S.Scene(tuple(S.SceneObject(o.shape, o.colour, _other(o.position, len(sc.objects)), o.size)
                           for o in sc.objects), sc.background, None, False, sc.jitter, "", sc.size_in_caption)
             for sc in scenes]
    judge = Judge.from_file()
    for batch in (scenes, moved):
        from PIL import Image

        gen = torch.Generator().manual_seed(0)
        images = pipe([S.caption_without_position(s) for s in batch], height=64, width=64,
                      image=[Image.fromarray(S.render_condition(s)) for s in batch], num_inference_steps=20,
                      guidance_scale=4.0, generator=gen, output_type="np").images
        scores = score_scenes(batch, judge.predict((images * 255).round().astype(np.uint8)))
        hits = [o["position"] for s in scores for o in s["objects"]]
        assert np.mean(hits) >= 0.8, hits


def _other(position: str, count: int) -> str:
    swap = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}
    if count == 2:
        return swap[position]
    return {"left": "top", "top": "right", "right": "bottom", "bottom": "centre", "centre": "left"}[position]


@pytest.mark.slow  # 7-13 s each: the whole suite (make test) runs it, test-fast does not
def test_the_onnx_folder_carries_the_net_and_its_objects_follow_the_condition():
    """The shipped ONNX folder's `position` net (add-controlnet of the diffusers folder) through the run time:
    the same scenes as above, and again with every object moved, land where the condition says."""
    from onnxdiffusion.evaluate.judge import Judge, score_scenes
    from onnxdiffusion.evaluate.run import item_latents
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.techniques.controlnet import ControlNetSpec

    pipe = Pipeline.from_folder(ROOT / "models" / "shapes-sd-onnx")
    assert set(pipe.manifest["controlnets"]) == {"position"}
    scenes = S.scenes("heldout", 4)
    moved = [S.Scene(tuple(S.SceneObject(o.shape, o.colour, _other(o.position, len(sc.objects)), o.size)
                           for o in sc.objects), sc.background, None, False, sc.jitter, "", sc.size_in_caption)
             for sc in scenes]
    judge = Judge.from_file()
    shape = pipe.latent_shape_for(1)[1:]
    for batch in (scenes, moved):
        images = np.concatenate([pipe(S.caption_without_position(s), latents=item_latents(shape, [i]), steps=20,
                                      controlnets=[ControlNetSpec("position", S.render_condition(s))]).images
                                 for i, s in enumerate(batch)])
        hits = [o["position"] for s in score_scenes(batch, judge.predict(images)) for o in s["objects"]]
        assert np.mean(hits) >= 0.8, hits
