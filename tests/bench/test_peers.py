"""Each installed peer makes one image through `onnxdiffusion bench`, as a new user would run it.

The bench is started from the command line in a scratch folder with a *relative* model path (the case
that once reached optimum's worker unresolved). Peers live in their own venvs (`make peers`); a venv
that is absent skips its case with the reason, unless ONNXDIFFUSION_REQUIRE_PEERS=1 (set by .ci/run,
which installs them): then an absent or broken peer is a failure, so CI goes red instead of the
report growing a row of "failed".
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from cli_helpers import run_cli

pytestmark = [pytest.mark.peers, pytest.mark.slow]  # make test-fast leaves the peers out (make test runs them)

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("ONNXDIFFUSION_REQUIRE_PEERS") == "1"
PEERS = {  # variant -> venv
    "optimum-ort": ".venv-optimum",
    "openvino-fp32": ".venv-openvino",
    "openvino-int8-hybrid": ".venv-openvino",
}


def _installed(variant: str) -> bool:
    return (ROOT / PEERS[variant] / "bin" / "python").exists()


@pytest.fixture(scope="module")
def peer_bench(tiny_onnx, tmp_path_factory):
    """One bench run over every installed peer plus ort-fp32, from a scratch cwd with relative paths."""
    chosen = [v for v in PEERS if _installed(v)]
    missing = [v for v in PEERS if v not in chosen]
    if missing and REQUIRED:
        pytest.fail(f"ONNXDIFFUSION_REQUIRE_PEERS=1 but not installed: {', '.join(missing)} (run `make peers`)")
    if not chosen:
        pytest.skip("no peer venv installed (run `make peers`)")
    cwd = tmp_path_factory.mktemp("peer_cwd")
    shutil.copytree(tiny_onnx, cwd / "models" / "tiny-onnx")
    proc = run_cli("bench", "models/tiny-onnx", "--variants", ",".join(["ort-fp32", *chosen]), "--steps", "2",
                   "--repeats", "1", "--prompts", "0", "--size", "64", "--threads", "1", "--rss", "off",
                   "--quiet", "--out", "out", cwd=cwd, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((cwd / "out" / "results.json").read_text())
    return {r["name"]: r for r in results["variants"]}, cwd


@pytest.mark.parametrize("variant", list(PEERS))
def test_peer_makes_an_image_from_a_relative_model_path(peer_bench, variant):
    rows, cwd = peer_bench
    if variant not in rows:
        pytest.skip(f"{variant}: {PEERS[variant]} is not installed (run `make peers`)")
    row = rows[variant]
    log = cwd / "out" / "_peers" / f"{variant}.log"
    tail = log.read_text(errors="replace")[-1500:] if log.is_file() else ""
    assert row["status"] == "ok", f"{variant}: {row['reason']}\n{tail}"
    t = row["timing"]
    assert t["repeats"] == 1 and t["e2e_median_s"] > 0
    assert len(row["load"].get("versions", {})) >= 2  # the worker really loaded its own libraries


def test_openvino_fp32_is_fp32_math_and_int8_hybrid_reuses_its_ir(peer_bench):
    """openvino-fp32 asks for f32 math (OpenVINO's CPU default is bf16 where the CPU has it); int8-hybrid
    quantizes the IR the fp32 variant converted instead of exporting the PyTorch model a second time (at full
    size that export is the memory peak)."""
    rows, _ = peer_bench
    if "openvino-fp32" not in rows or "openvino-int8-hybrid" not in rows:
        pytest.skip(".venv-openvino is not installed (run `make peers`)")
    fp32, hybrid = rows["openvino-fp32"]["load"], rows["openvino-int8-hybrid"]["load"]
    assert "float32" in fp32.get("inference_precision", ""), fp32
    assert hybrid.get("quantized_from") == "fp32 IR", hybrid
