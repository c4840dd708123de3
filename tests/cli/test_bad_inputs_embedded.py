"""The bad-input harness (test_bad_inputs.py) on both embedded models, not only the tiny SD export.

Every CLI case runs with the embedded UNet model (models/shapes-sd-onnx) and the embedded MMDiT
(models/shapes-mmdit-onnx) as its model (export cases: their diffusers sources), and every Python
API case against a Pipeline of each; the MMDiT adds the size limit its position table sets. A case
whose setup names the SD backbone folder (`unet`) is retargeted at the MMDiT's (`transformer`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import invoke
from test_bad_inputs import (API_GENERATE, CASES, Ctx, backbone_manifest_cases, exp, gen, gen_case, loop, nothing,
                             snapshot, src_index, with_src)

from onnxdiffusion.errors import UserError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"sd": (ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-sd"),
          "mmdit": (ROOT / "models" / "shapes-mmdit-onnx", ROOT / "models" / "shapes-mmdit")}
# the MMDiT refuses sizes past its position table (64x64) before the memory estimate or the size cap
MMDIT_FRAGMENTS = {"generate-memory": "at most 64", "generate-height-huge": "at most 64",
                   "generate-both-huge": "at most 64",
                   "manifest-latent-channels-wrong": "graph and manifest disagree",
                   "loop-cache-layer-too-deep": "UNet's deep path"}  # DeepCache's layers: a UNet's only
MMDIT_CASES = [gen_case("mmdit-height-72", ["--height", "72"], "at most 64 for this model (the transformer's position table"),
               gen_case("mmdit-width-128", ["--width", "128"], "pos_embed_max_size 8 x patch 2 x VAE factor 4"),
               gen_case("mmdit-height-60", ["--height", "60"], "multiple of 8")]
# The manifest and folder mutations that name the backbone run on the MMDiT against its `transformer`
# (test_bad_inputs.backbone_manifest_cases); the SD-named versions are not run there.
SD_BACKBONE = {f"manifest-{c[0]}" for c in backbone_manifest_cases("unet")}
MMDIT_BACKBONE = [(f"manifest-{n}", setup, gen(model="copy"), 2, frag)
                  for n, setup, frag in backbone_manifest_cases("transformer")]
MMDIT_EXPORT = [
    ("export-component-class-transformer", src_index(lambda mi: {**mi, "transformer": ["diffusers", "Nope"]}), exp(), 2,
     "'transformer'"),
    ("export-out-inside-src-transformer", with_src(nothing), exp("--overwrite", out="src/transformer/sub"), 2,
     "overlaps the input"),
]
# What the MMDiT has no analogue of: fields its flow-matching scheduler does not read (beta_schedule,
# trained_betas, spacing, the scheduler's prediction_type: a valid folder ignores them), and the SD export cases
# whose MMDiT versions are MMDIT_EXPORT.
MMDIT_NOT_APPLICABLE = {
    "manifest-sched-schedule-unknown", "manifest-sched-prediction-unknown", "manifest-sched-spacing-unknown",
    "manifest-sched-trained-betas", "export-component-class", "export-out-inside-src",
    "loop-cache-wrong-backbone",  # first_block fits a transformer: MMDIT_LOOP asks it for deepcache instead
}
MMDIT_LOOP = [("loop-cache-wrong-backbone-transformer", nothing, loop("--cache", "deepcache"), 2, "UNet's deep path")]
NO_ALIAS = {c[0] for c in MMDIT_BACKBONE}
ALL = ([("sd", c) for c in CASES]
       + [("mmdit", c) for c in CASES if c[0] not in MMDIT_NOT_APPLICABLE and c[0] not in SD_BACKBONE]
       + [("mmdit", c) for c in MMDIT_CASES + MMDIT_BACKBONE + MMDIT_EXPORT + MMDIT_LOOP])


def test_case_count_on_embedded_models():
    assert len(ALL) >= 2 * len(CASES) - len(MMDIT_NOT_APPLICABLE) + len(MMDIT_CASES), len(ALL)


class EmbeddedCtx(Ctx):
    """Ctx over an embedded folder; for the MMDiT, edits naming `unet` go to `transformer`."""

    backbone = "unet"

    alias = True

    def manifest(self) -> dict:
        m = super().manifest()
        if self.alias and self.backbone != "unet" and "unet" not in m.get("components", {}) and isinstance(m.get("components"), dict):
            m["components"]["unet"] = m["components"][self.backbone]  # the case edits this alias ...
            self.notes["alias"] = True
        return m

    def write_manifest(self, m) -> None:
        if self.notes.pop("alias", False) and isinstance(m, dict) and isinstance(m.get("components"), dict):
            m["components"][self.backbone] = m["components"].pop("unet")  # ... which lands on the transformer
        super().write_manifest(m)


@pytest.mark.parametrize("model, case", ALL, ids=[f"{m}-{c[0]}" for m, c in ALL])
def test_cli_bad_input_on_embedded_models(tmp_path, model, case):
    name, setup, argv, code, fragment = case
    folder, source = MODELS[model]
    ctx = EmbeddedCtx(tiny=folder, tmp=tmp_path, diffusers=source)
    ctx.backbone = "unet" if model == "sd" else "transformer"
    ctx.alias = name not in NO_ALIAS
    if model == "mmdit":
        fragment = MMDIT_FRAGMENTS.get(name, fragment)
    setup(ctx)
    args = [str(a).replace(f"{ctx.model if ctx._model else folder}/unet", f"{ctx.model if ctx._model else folder}/{ctx.backbone}")
            if model == "mmdit" else a for a in argv(ctx)]
    before = snapshot(ctx.tmp)
    res = invoke(*args, timeout=180)
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    assert res.returncode == code, res.stderr
    assert fragment in errors[0], errors[0]
    assert "internal error" not in errors[0]
    assert snapshot(ctx.tmp) == before
    assert json.loads((folder / "manifest.json").read_text())  # the embedded folder itself untouched (hard check below)


@pytest.fixture(scope="module", params=sorted(MODELS))
def pipe(request):
    from onnxdiffusion.runtime import Pipeline

    return Pipeline.from_folder(MODELS[request.param][0], threads=1)


@pytest.mark.parametrize("name, kwargs, fragment", API_GENERATE, ids=[c[0] for c in API_GENERATE])
def test_api_bad_input_on_embedded_models(pipe, name, kwargs, fragment):
    import numpy as np

    kwargs = dict(kwargs)
    shape = pipe.latent_shape_for(1)
    special = {"complex": np.zeros(shape, np.complex64), "strings": np.full(shape, "a"),
               "nan": np.full(shape, np.nan, np.float32), "inf": np.full(shape, np.inf, np.float32)}
    if isinstance(kwargs.get("latents"), str):
        kwargs["latents"] = special[kwargs["latents"]]
    if kwargs.get("sampler") == "euler_a" and pipe.info["prediction_type"] == "flow":
        kwargs["sampler"] = "flow_euler"  # the noise cases need a sampler this schedule takes
    if isinstance(kwargs.get("noise"), str):
        kwargs["noise"] = np.full((2, *shape), np.nan, np.float32)
    prompt = kwargs.pop("prompt", "a red circle")
    kwargs.setdefault("steps", 2)
    with pytest.raises(UserError) as e:
        pipe(prompt, **kwargs)
    assert "\n" not in str(e.value)
    if not (name.startswith("noise") and pipe.info["prediction_type"] == "flow"):
        assert fragment in str(e.value)
