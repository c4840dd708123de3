"""Issue 43 acceptance 5: every row of a bench runs the same sampler and number of backbone calls (peers given the
bench's sampler, or refused in one line), and peak RSS is per phase with a peer's one-off conversion apart.

The OpenVINO case runs where .venv-openvino is installed (ONNXDIFFUSION_OPENVINO_PYTHON, else the repository's
venv); elsewhere it skips with the reason."""

import os
from pathlib import Path

import pytest

from onnxdiffusion.bench.arch import ARCHES
from onnxdiffusion.bench.variants import SDCPP_SAMPLERS, peer_sampler, peer_sampler_skip
from onnxdiffusion.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_peers_are_told_the_bench_sampler_or_refuse_it():
    assert peer_sampler("openvino", "pndm") == "PNDMScheduler"
    assert peer_sampler("optimum", "ddim") == "DDIMScheduler"
    assert peer_sampler("openvino", "lcm") == "LCMScheduler"
    assert peer_sampler("sdcpp", "ddim") == SDCPP_SAMPLERS["ddim"] == "ddim_trailing"
    assert peer_sampler("sdcpp", "pndm") is None and peer_sampler("openvino", "flow_euler") is None
    reason = peer_sampler_skip("sdcpp", "pndm")
    assert "\n" not in reason and "pndm" in reason and "--sampler" in reason
    assert peer_sampler_skip("openvino", "ddim") is None


def test_arch_sd15_pins_one_sampler_for_every_row():
    """The folder's own PNDM makes 11 UNet calls at 10 steps where the peers' DDIM makes 10: --arch sd15 runs DDIM."""
    assert ARCHES["sd15"].sampler == "ddim"
    assert not any(v.endswith("-dpmpp") for v in ARCHES["sd15"].variants)


def test_a_named_peer_that_cannot_run_the_sampler_is_refused_before_anything_runs(tmp_path):
    from onnxdiffusion.bench import BenchOptions, run_bench

    with pytest.raises(UserError, match="sdcpp-q8_0: the sdcpp peer cannot run the pndm sampler") as err:
        run_bench(BenchOptions(variants=("ort-fp32,sdcpp-q8_0",), sampler="pndm", steps=2, repeats=1, prompts=0,
                               out=tmp_path / "out", progress=False))
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="unknown --sampler"):
        run_bench(BenchOptions(sampler="nope", out=tmp_path / "out", progress=False))


def test_plan_gives_peers_the_bench_sampler(tmp_path):
    from onnxdiffusion.bench.variants import PlanOptions, plan_variants, source_folder
    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.folder.paths import default_model_folder

    model = default_model_folder()
    manifest = read_manifest(model)
    plan = {s.name: s for s in plan_variants(model, manifest, source_folder(model, manifest),
                                             PlanOptions(steps=4, sampler="pndm"))}
    assert plan["openvino-fp32"].sampler == plan["ort-fp32"].sampler == plan["torch-fp32"].sampler == "pndm"
    assert "PNDM" in plan["openvino-fp32"].label
    assert "cannot run the pndm sampler" in (plan["sdcpp-q8_0"].skip or "") or "not installed" in plan["sdcpp-q8_0"].skip


def _results(rows):
    return {"variants": rows, "model": "m", "settings": {}}


def _row(name, calls, memory, kind="ort"):
    return {"name": name, "status": "ok", "kind": kind, "precision": "fp32", "sampler": "ddim", "steps": 10,
            "loop": "host", "timing": {"e2e_median_s": 1.0}, "backbone_calls": calls, "memory": memory,
            "peak_rss_bytes": memory.get("peak_rss_bytes"), "reason": None}


def test_report_shows_sampler_calls_phases_and_conversion_apart():
    from onnxdiffusion.bench.assemble import _like_with_like
    from onnxdiffusion.bench.report import summary_rows, text_table

    mib = 1024 * 1024
    ours = _row("ort-fp32", 10, {"peak_rss_bytes": 300 * mib, "phase_peak_rss_bytes": {"load": 200 * mib,
                                                                                         "first": 300 * mib}})
    peer = _row("openvino-fp32", 10, {"peak_rss_bytes": 400 * mib, "convert": {"peak_rss_bytes": 900 * mib},
                                      "phase_peak_rss_bytes": {"load": 350 * mib, "first": 400 * mib,
                                                               "steady": 390 * mib}}, kind="peer")
    rows = {r["name"]: r for r in summary_rows(_results([ours, peer]))}
    assert rows["openvino-fp32"]["sampler"] == "ddim 10" and rows["openvino-fp32"]["calls"] == "10"
    assert rows["openvino-fp32"]["rss_mib"] == "400" and rows["openvino-fp32"]["convert_mib"] == "900"
    assert rows["openvino-fp32"]["phase_mib"] == "350 / 400 / 390" and rows["ort-fp32"]["phase_mib"] == "200 / 300 / -"
    assert "convert MiB" in text_table(_results([ours, peer]))
    notes: list[str] = []
    _like_with_like([ours, peer], notes)
    assert notes == []
    _like_with_like([ours, {**peer, "backbone_calls": 11}], notes)
    assert len(notes) == 1 and notes[0].startswith("NOT like with like")


def _openvino_python() -> Path:
    env = os.environ.get("ONNXDIFFUSION_OPENVINO_PYTHON")
    return Path(env) if env else ROOT / ".venv-openvino" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.parametrize("isolate", [False, True])
def test_openvino_runs_the_bench_sampler_and_its_conversion_is_apart(tmp_path, isolate):
    """On the embedded model: Euler 3 steps in every row (3 backbone calls each, counted), the peer's conversion
    in its own process, its peak apart from the peer's per-phase peaks."""
    from onnxdiffusion.bench import BenchOptions, run_bench

    if not _openvino_python().exists():
        pytest.skip(f"no OpenVINO venv at {_openvino_python()} (run `make peers`)")
    mp = pytest.MonkeyPatch()
    mp.setenv("ONNXDIFFUSION_OPENVINO_PYTHON", str(_openvino_python()))
    try:
        results = run_bench(BenchOptions(variants=("ort-fp32,openvino-fp32",), sampler="euler", steps=3, repeats=1,
                                         prompts=0, threads=1, isolate=isolate, work=tmp_path / "work",
                                         out=tmp_path / "out", progress=False))
    finally:
        mp.undo()
    rows = {r["name"]: r for r in results["variants"]}
    for row in rows.values():
        assert row["status"] == "ok", row["reason"]
        assert row["sampler"] == "euler" and row["backbone_calls"] == 3
    mem = rows["openvino-fp32"]["memory"]
    phases = mem["phase_peak_rss_bytes"]
    assert set(phases) == ({"load", "image"} if isolate else {"load", "first", "steady"})
    assert mem["peak_rss_bytes"] == max(phases.values())
    assert mem["convert"]["peak_rss_bytes"] > 0 and mem["convert"]["convert_s"] > 0
    assert not any(n.startswith("NOT like with like") for n in results["notes"])
