"""The shipped LoRA (models/loras/shapes-sd-violet.safetensors) teaches shapes-sd the colour word "violet"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxdiffusion.evaluate import scenes as S
from onnxdiffusion.evaluate.judge import Judge, score_scenes

ROOT = Path(__file__).resolve().parents[2]
LORA = ROOT / "models" / "loras" / "shapes-sd-violet.safetensors"
# held-out compositions (never trained on) with one purple object, worded "violet"
PROMPTS = [
    ("a violet triangle left of a blue circle", [("triangle", "purple", "left"), ("circle", "blue", "right")]),
    ("a violet star left of a red star", [("star", "purple", "left"), ("star", "red", "right")]),
    ("a white circle below a violet ring", [("ring", "purple", "top"), ("circle", "white", "bottom")]),
    ("a green circle below a violet square", [("square", "purple", "top"), ("circle", "green", "bottom")]),
]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    from onnxdiffusion.adapters.folder import add_points
    from onnxdiffusion.runtime import Pipeline

    out = tmp_path_factory.mktemp("lora") / "sd-points"
    add_points(ROOT / "models" / "shapes-sd-onnx", out)
    return Pipeline.from_folder(out)


def _scenes():
    return [S.Scene(tuple(S.SceneObject(sh, co, pos, "small") for sh, co, pos in objs), (20, 20, 24), caption=p,
                    size_in_caption=False) for p, objs in PROMPTS]


def test_the_file_is_small_fp16_and_in_the_diffusers_layout():
    from onnxdiffusion.adapters.safetensors_io import read

    tensors, _ = read(LORA)
    assert LORA.stat().st_size < 1 << 20
    assert {a.dtype for a in tensors.values()} == {np.dtype(np.float16)}
    assert any(k.startswith("unet.") for k in tensors) and any(k.startswith("text_encoder.") for k in tensors)


def test_violet_is_painted_purple_with_the_adapter_and_not_without(pipe):
    judge = Judge.from_file()
    prompts = [p for p, _ in PROMPTS]
    kw = dict(batch=len(prompts), steps=20, sampler="ddim", guidance=4.0, seed=0)
    plain = pipe(prompts, **kw).images
    adapted = pipe(prompts, loras=[(str(LORA), 1.0)], **kw).images
    scenes = _scenes()
    with_lora = [s["strict"] for s in score_scenes(scenes, judge.predict(adapted))]
    without = [s["strict"] for s in score_scenes(scenes, judge.predict(plain))]
    # measured over 32 held-out prompts: experiments/lora/violet.md
    assert sum(with_lora) >= 3, with_lora
    assert sum(without) <= 1, without
    purple = [pipe(p.replace("violet", "purple"), steps=20, seed=0).images[0] for p in prompts[:1]]
    purple_lora = [pipe(p.replace("violet", "purple"), steps=20, seed=0, loras=[(str(LORA), 1.0)]).images[0]
                   for p in prompts[:1]]
    assert score_scenes(scenes[:1], judge.predict(np.stack(purple_lora)))[0]["strict"]
    assert score_scenes(scenes[:1], judge.predict(np.stack(purple)))[0]["strict"]


LCM = ROOT / "models" / "loras" / "shapes-sd-lcm.safetensors"


def test_lcm_lora_four_steps_stay_close_to_the_twenty_step_image(tmp_path):
    """measured over 32 held-out prompts (experiments/lora/lcm.md): 25.1 dB with the adapter vs 21.9 without."""
    from onnxdiffusion.adapters.folder import add_points
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    add_points(ROOT / "models" / "shapes-sd-onnx", tmp_path / "all", scope="all")
    pipe = Pipeline.from_folder(tmp_path / "all")
    prompts = [p.replace("violet", "purple") for p, _ in PROMPTS]
    ref = pipe(prompts, batch=4, steps=20, sampler="ddim", guidance=4.0, seed=0).images
    fast = pipe(prompts, batch=4, steps=4, sampler="lcm", guidance=1.0, seed=0, loras=[(str(LCM), 1.0)]).images
    plain = pipe(prompts, batch=4, steps=4, sampler="lcm", guidance=1.0, seed=0).images
    with_lora = np.mean([psnr(a, b) for a, b in zip(fast, ref)])
    without = np.mean([psnr(a, b) for a, b in zip(plain, ref)])
    assert with_lora > without + 1.0, (with_lora, without)
    scenes = [S.Scene(s.objects, s.background, caption=s.caption.replace("violet", "purple"), size_in_caption=False)
              for s in _scenes()]
    assert sum(r["strict"] for r in score_scenes(scenes, Judge.from_file().predict(fast))) >= 3
