"""`tune` tries the step caches on its quantized folders too: on an int8-timestep UNet DeepCache used to "not
apply" (the branches' nodes had lost their module names), so no cached point of that folder was ever scored."""

import json

import pytest

from onnxdiffusion.tune.space import CACHES

pytestmark = pytest.mark.slow


def test_a_tiny_tune_run_scores_deepcache_on_its_int8_timestep_folder(tiny_onnx, tmp_path, monkeypatch):
    from onnxdiffusion.bench.quantized import sibling_folder
    from onnxdiffusion.quantize import CalibrationConfig, Int8TimestepRecipe, QuantizeConfig, quantize
    from onnxdiffusion.tune import TuneOptions, tune
    from onnxdiffusion.tune.run import QUANTIZE_ARGS

    cache = tmp_path / "cache"
    monkeypatch.setenv("ONNXDIFFUSION_CACHE", str(cache))
    # the store's int8-timestep folder, built small here (tune would build it with its own calibration)
    (cache / "quantized").mkdir(parents=True)
    folder = sibling_folder(cache / "quantized", tiny_onnx, "int8-timestep", (*QUANTIZE_ARGS, "--threads", "1"))
    quantize(tiny_onnx, folder, QuantizeConfig(recipe=Int8TimestepRecipe(groups=2), latency_runs=1,
                                               calibration=CalibrationConfig(count=4, steps=4, batch=4, sampler="ddim"),
                                               measure_memory=False))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on the left\na blue star above a yellow square\n")
    opts = TuneOptions(min_psnr=8.0, time_budget=4.0, prompts=prompts, tune_count=2, holdout_count=2, confirm_count=2,
                       rounds=1, recipes=("int8-timestep",), top=2)
    tune(tiny_onnx, tmp_path / "out", opts, log=lambda m: None)
    records = [json.loads(line) for line in (tmp_path / "out" / "journal.jsonl").read_text().splitlines() if line]
    quality = {r["id"]: r for r in records if r["kind"] == "quality"}
    deep = {k: v for k, v in quality.items() if k.startswith("int8-timestep|") and "|deepcache:" in k}
    assert deep, sorted(quality)
    assert all("error" not in v and v["full"]["psnr"] > 0 for v in deep.values()), deep
    assert {k.split("|")[3] for k in deep} <= {c for c in CACHES if c.startswith("deepcache")}
