"""`tune`: the levers, the bound, the journal, the tuned folder picked up by generate and serve (the same images as
the configuration spelled out by hand), and a whole run with a tiny budget on the shipped model (slow)."""

import json

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run_cli_here
from onnxdiffusion.errors import UserError
from onnxdiffusion.folder.artifacts import read_manifest
from onnxdiffusion.folder.manifest import Manifest
from onnxdiffusion.folder.paths import default_model_folder
from onnxdiffusion.runtime.generation import GenerateOptions, resolve_options
from onnxdiffusion.tune.search import Bound
from onnxdiffusion.tune.space import Candidate, changed_levers, step_counts
from onnxdiffusion.tune.store import Store

SD = default_model_folder()


def test_step_counts_go_down_from_the_folders_and_never_below_4():
    assert step_counts(20) == (20, 12, 8, 6, 4)
    assert step_counts(4) == (4,)
    assert step_counts(10) == (10, 6, 4)


def test_changed_levers_counts_sampler_and_steps_as_one():
    d = Candidate("fp32", "ddim", 20, None, "full", "cpu-fp32")
    assert changed_levers(d.with_(sampler="unipc", steps=8), d) == ("sampling",)
    assert changed_levers(d.with_(recipe="int8-static", profile="cpu-int8", decoder="tiny"), d) == ("recipe", "decoder")


def test_bound_psnr_and_accuracy():
    b = Bound(35.0, True, reference_strict=0.9, reference_attribute=0.95)
    assert b.passes({"psnr": 36, "strict": 0.9, "attribute": 0.95})
    assert not b.passes({"psnr": 34, "strict": 1.0, "attribute": 1.0})
    assert not b.passes({"psnr": 40, "strict": 0.85, "attribute": 0.95})
    assert not b.passes({"psnr": 40, "strict": 0.9, "attribute": 0.9})
    assert Bound(None, True, 0.5, 0.5).passes({"psnr": 10, "strict": 0.5, "attribute": 0.5})


def test_store_resumes_from_the_journal_and_skips_a_torn_line(tmp_path):
    s = Store(tmp_path / "store", tmp_path / "journal.jsonl", "cpu1")
    s.put("quality", "a", {"full": {"psnr": 40.0}})
    s.put("timing", "a", {"median_s": 0.1})
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write('{"kind": "quality", "id": "b", "full"')  # a run killed mid-line
    again = Store(tmp_path / "other-store", tmp_path / "journal.jsonl", "cpu1")
    assert again.get("quality", "a")["full"]["psnr"] == 40.0 and again.get("quality", "b") is None
    assert again.get("timing", "a")["median_s"] == 0.1
    assert Store(tmp_path / "store", tmp_path / "j2.jsonl", "cpu2").get("timing", "a") is None  # another CPU's


def test_recommended_cache_decoder_profile_are_defaults_and_checked():
    rec = {"steps": 8, "sampler": "dpmpp_2m", "cache": "deepcache:2:L1", "decoder": "tiny", "profile": "cpu-fp32"}
    o = resolve_options(GenerateOptions(), rec)
    assert (o.steps, o.sampler, o.cache, o.decoder) == (8, "dpmpp_2m", "deepcache:2:L1", "tiny")
    assert resolve_options(GenerateOptions(cache="none", decoder="full"), rec).cache == "none"
    assert resolve_options(GenerateOptions(stop_early="0.1"), rec).cache is None  # a stop asked for replaces it
    assert resolve_options(GenerateOptions(), {}).decoder == "full"
    raw = json.loads((SD / "manifest.json").read_text())
    for bad in ({"decoder": "huge"}, {"profile": "../../etc/x.yaml"}, {"cache": 3}):
        with pytest.raises(UserError, match="recommended"):
            Manifest.parse({**raw, "recommended": {**raw["recommended"], **bad}}, "m")


def test_bad_bounds_are_one_line(tmp_path):
    assert_one_line_error(run_cli_here("tune", tmp_path / "o"), "--min-psnr")
    assert_one_line_error(run_cli_here("tune", tmp_path / "o", "--min-psnr", "200"), "--min-psnr")
    p = tmp_path / "p.txt"
    p.write_text("a red circle\n")
    assert_one_line_error(run_cli_here("tune", tmp_path / "o", "--keep-accuracy", "--prompts", p), "--prompts")
    assert_one_line_error(run_cli_here("tune", SD, SD / "sub", "--min-psnr", "30"), "overlaps")


def _tuned(tmp_path, chosen: Candidate):
    from onnxdiffusion.tune.output import write_outputs

    result = {"bound": "test", "machine": {"cpu": {"model": "x"}}, "speedup": {"vs_default": 1.0},
              "holdout": {"psnr": 40.0}}
    (tmp_path / "out").mkdir()
    write_outputs(tmp_path / "out", SD, chosen, result, log=lambda m: None)
    return tmp_path / "out" / "model"


def test_tuned_folder_through_generate_and_serve_equals_the_hand_spelled_configuration(tmp_path):
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.serve.render import render_group

    chosen = Candidate("fp32", "dpmpp_2m", 6, "deepcache:2:L1", "tiny", "cpu-fp32")
    folder = _tuned(tmp_path, chosen)
    rec = read_manifest(folder).recommended
    assert (rec.sampler, rec.steps, rec.cache, rec.decoder, rec.profile) == ("dpmpp_2m", 6, "deepcache:2:L1", "tiny",
                                                                             "cpu-fp32")
    # generate, the CLI: no flag on the tuned folder vs every lever spelled out on the source folder
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    r = run_cli_here("generate", folder, "a red circle", "-o", a)
    assert r.returncode == 0, r.stderr
    r = run_cli_here("generate", SD, "a red circle", "-o", b, "--sampler", "dpmpp_2m", "--steps", "6", "--cache",
                     "deepcache:2:L1", "--decoder", "tiny", "--profile", "cpu-fp32")
    assert r.returncode == 0, r.stderr
    assert a.read_bytes() == b.read_bytes()
    plain = tmp_path / "plain.png"
    assert run_cli_here("generate", folder, "a red circle", "-o", plain, "--cache", "none", "--decoder", "full").returncode == 0
    assert plain.read_bytes() != a.read_bytes()  # the tuned levers were really in effect
    # serve: a request names no lever; the service renders through Pipeline.resolve, as generate does
    from types import SimpleNamespace

    pipe = Pipeline.from_folder(folder)
    settings = pipe.resolve(GenerateOptions())  # what serve's build_request fills in for a request without them
    req = SimpleNamespace(prompt="a red circle", negative_prompt="", n=1, seed=3, width=64, height=64,
                          steps=settings.steps, sampler=settings.sampler, guidance=settings.guidance)
    served = render_group(pipe, [req])[0]
    shape = Pipeline.from_folder(SD).latent_shape_for(1)
    by_hand = Pipeline.from_folder(SD, profile="cpu-fp32")(
        "a red circle", steps=6, sampler="dpmpp_2m", guidance=4.0, cache="deepcache:2:L1", decoder="tiny",
        latents=np.random.default_rng(3).standard_normal(shape, dtype=np.float32)).images
    np.testing.assert_array_equal(served, by_hand)


@pytest.mark.slow
def test_tune_with_a_tiny_budget_then_the_same_again_from_the_store(tmp_path, monkeypatch):
    from onnxdiffusion.tune import TuneOptions, tune

    monkeypatch.setenv("ONNXDIFFUSION_CACHE", str(tmp_path / "cache"))
    opts = TuneOptions(min_psnr=30.0, keep_accuracy=True, time_budget=3.0, tune_count=2, holdout_count=2, rounds=1,
                       confirm_count=2,
                       recipes=(), top=2)
    first = tune(SD, tmp_path / "out", opts, log=lambda m: None)
    for name in ("report.md", "tune.json", "journal.jsonl", "model/manifest.json"):
        assert (tmp_path / "out" / name).is_file(), name
    assert first["generations_this_run"] >= 1 and first["holdout"]["psnr"] > 0
    assert first["latency_s"]["default"] > 0 and first["speedup"]["vs_default"] > 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Chosen:" in report and "Runner-up per lever" in report and "Why this choice" in report
    again = tune(SD, tmp_path / "out2", opts, log=lambda m: None)
    assert again["generations_this_run"] == 0 and again["chosen"] == first["chosen"]
    chosen = Candidate.from_dict(first["chosen"])
    rec = read_manifest(tmp_path / "out2" / "model").recommended
    assert (rec.sampler, rec.steps, rec.decoder) == (chosen.sampler, chosen.steps, chosen.decoder)
