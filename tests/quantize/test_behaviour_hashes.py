"""The quantize restructuring changed no bytes: a few cheap recipes on the embedded MMDiT write the
ONNX files whose sha256 bench/behaviour_baseline.json recorded on main before it
(bench/behaviour_hashes.py runs every recipe on both models)."""

import importlib.util

import json
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "behaviour_hashes.py"
BASELINE = ROOT / "bench" / "behaviour_baseline.json"
CASES = ("fp16", "int8-dynamic", "int8-static")


def _script():
    spec = importlib.util.spec_from_file_location("behaviour_hashes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", CASES)
def test_quantized_files_match_the_recorded_baseline(name):
    mod = _script()
    baseline = json.loads(BASELINE.read_text())
    if baseline.get("tool_versions") != mod.tool_versions():
        pytest.skip(f"baseline recorded with {baseline.get('tool_versions')}, this is {mod.tool_versions()}")
    want = baseline["cases"][f"mmdit/{name}"]
    case = next(c for c in mod.CASES if c[0] == name)
    with tempfile.TemporaryDirectory() as scratch:
        got = mod.run_case("mmdit", case, Path(scratch))
    # the shipped MMDiT folder gained a vae_encoder (img2img) and a vae_decoder_tiny (issue 25) after the baseline:
    # they are copied unchanged, so the quantized folder holds exactly the baseline's files plus those, hashed as
    # the shipped files
    added = set(got["files"]) - set(want["files"])
    assert added <= {"vae_encoder/model.onnx", "vae_decoder_tiny/model.onnx"}
    for rel in added:
        assert got["files"][rel] == mod.graph_sha(mod.ROOT / "models" / "shapes-mmdit-onnx" / rel)
    assert {k: v for k, v in got["files"].items() if k not in added} == want["files"]
    if not added:  # the manifest lists the new component too: comparable only without it
        assert got["manifest_sha256"] == want["manifest_sha256"]
    assert got["quality"] == want["quality"]
