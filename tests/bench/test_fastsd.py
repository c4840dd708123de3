"""Issue 43's FastSD CPU recipe as bench rows: `--arch sd15-lcm[-tiny]` (LCM-distilled UNet, LCM 4 steps, 512x512;
-tiny 128x128, TAESD as the tiny decoder) for ours, diffusers and OpenVINO's LCM pipeline with TAESD. The full-size run:

    onnxdiffusion bench --arch sd15-lcm --isolate --threads 1 --variants ort-fp32,openvino-fp32 --out out/fastsd
"""

import os
from pathlib import Path

import pytest

from onnxdiffusion.bench import BenchOptions
from onnxdiffusion.bench.arch import ARCHES
from onnxdiffusion.bench.setup import _resolve
from onnxdiffusion.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_the_fastsd_arch_runs_lcm_4_at_512_with_the_tiny_decoder():
    """The recipe at its 512x512; the narrow smoke model at 128x128 (its build, export and rows in seconds)."""
    from onnxdiffusion.bench.arch.sd15 import configs

    for arch, size in (("sd15-lcm", 512), ("sd15-lcm-tiny", 128)):
        opts = _resolve(BenchOptions(arch=arch))
        assert (opts.steps, opts.size, opts.decoder) == (4, size, "tiny")
        cfg = configs(tiny=arch.endswith("-tiny"), lcm=True)  # the folder's default size is the arch's
        assert (cfg["backbone"]["sample_size"] * 8, cfg["vae"]["sample_size"]) == (size, size)
        assert ARCHES[arch].sampler == "lcm" and "openvino-fp32" in ARCHES[arch].variants
    assert _resolve(BenchOptions(arch="sd15-lcm", decoder="full")).decoder is None  # the VAE, by asking
    assert _resolve(BenchOptions(arch="sd15")).decoder is None and _resolve(BenchOptions(arch="sd15")).size == 256
    with pytest.raises(UserError, match="--decoder must be full or tiny"):
        _resolve(BenchOptions(decoder="taesd"))


def test_a_peer_without_a_tiny_decoder_says_so():
    from onnxdiffusion.bench.variants import VariantSpec, tiny_skip as _tiny_skip

    assert "VAE only" in _tiny_skip(VariantSpec("optimum-ort", "peer", "x", Path("."), peer="optimum"))
    assert "vae_tiny" in _tiny_skip(VariantSpec("torch-fp32", "torch", "x", Path("/nonexistent")))


def _openvino_python() -> Path:
    env = os.environ.get("ONNXDIFFUSION_OPENVINO_PYTHON")
    return Path(env) if env else ROOT / ".venv-openvino" / "bin" / "python"


@pytest.mark.slow
def test_fastsd_rows_at_the_tiny_depth(tmp_path):
    """ours (LCM 4 + TAESD) and, where .venv-openvino is installed, OpenVINO's OVLatentConsistencyModelPipeline +
    TAESD IR: one isolated round each, 128x128 (the narrow arch's size), the same 4 backbone calls, each under 3 GB
    peak RSS."""
    from onnxdiffusion.bench import run_bench

    peer = _openvino_python().exists()
    mp = pytest.MonkeyPatch()
    if peer:
        mp.setenv("ONNXDIFFUSION_OPENVINO_PYTHON", str(_openvino_python()))
    try:
        results = run_bench(BenchOptions(arch="sd15-lcm-tiny", work=tmp_path / "work", isolate=True, repeats=1,
                                         threads=1, variants=("ort-fp32" + (",openvino-fp32" if peer else ""),),
                                         out=tmp_path / "out", progress=False))
    finally:
        mp.undo()
    rows = {r["name"]: r for r in results["variants"]}
    assert (tmp_path / "work" / "onnx" / "vae_decoder_tiny").is_dir()
    for row in rows.values():
        assert row["status"] == "ok", row["reason"]
        assert row["sampler"] == "lcm" and row["steps"] == 4 and row["backbone_calls"] == 4
        assert "tiny decoder" in row["label"]
        assert row["peak_rss_bytes"] <= 3 * 2**30
    if peer:
        load = rows["openvino-fp32"]["load"]
        assert load["pipeline"] == "OVLatentConsistencyModelPipeline" and "TAESD" in load["decoder"]
        assert rows["openvino-fp32"]["memory"]["convert"]["peak_rss_bytes"] > 0
