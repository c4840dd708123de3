"""`export MODEL.gguf OUT --base DIR --gguf-layout int8-channel`: the GGUF's quantized Linear weights re-quantized to
int8 with one scale per output channel (DynamicQuantizeMatMul) instead of its blocks as MatMulNBits. On a tiny
Qwen-Image: the graph holds the new op and no MatMulNBits, the manifest says which layout and that every weight was
re-quantized, the backbone stays within a measured bound of diffusers' own GGUF loading and of the exact blocks
export, the default export is unchanged, and a bad value or a non-GGUF source is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.export import ExportOptions, export_pipeline, family_export
from onnxdiffusion.export.gguf import export_gguf
from onnxdiffusion.export.gguf_blocks import channel8_to_float, requantize_channel8
from onnxdiffusion.export.pipeline import source_info
from onnxdiffusion.runtime import Pipeline

from gguf_files import diffusers_from_gguf, state_dict_arrays, write_gguf

pytestmark = pytest.mark.slow

# measured on this tiny model (Q8_0 file): int8-channel 43.7 dB vs diffusers-from-GGUF, the blocks export 46.0 dB
MIN_DB = 38.0


def _snr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(ref.astype(np.float64) ** 2) / np.mean((ref - got).astype(np.float64) ** 2)))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from tiny_families import build_tiny_qwenimage

    return build_tiny_qwenimage(tmp_path_factory.mktemp("gguf_layout"), heads=2)


def _run(base: Path, folder: Path) -> tuple[dict, np.ndarray]:
    family, info = source_info(base)
    spec = family.component_specs(info, {family.backbone})[family.backbone]
    feeds = family_export.export_feeds(family, spec, family.export_dims(spec, info)[0], torch.Generator().manual_seed(0), 0)
    feeds = {t.name: feeds[t.name] for t in spec.inputs}
    sess = ort.InferenceSession(str(folder / "transformer" / "model.onnx"), providers=["CPUExecutionProvider"])
    return feeds, sess.run(None, {n: v.numpy() for n, v in feeds.items()})[0]


def test_requantize_channel8_rounds_each_row_to_its_own_scale():
    w = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32) * np.arange(1, 7, dtype=np.float32)[:, None]
    c = requantize_channel8(w)
    assert c.b.dtype == np.int8 and c.b.shape == (64, 6) and c.scales.shape == (6,) and not c.exact
    np.testing.assert_allclose(c.scales, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    assert np.abs(channel8_to_float(c) - w).max(axis=1).max() <= c.scales.max() / 2 + 1e-7
    assert 40 < c.snr_db < 60


def test_int8_channel_layout_is_recorded_and_close_to_the_gguf(base, tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", state_dict_arrays(base, "transformer"), "Q8_0", "qwen_image")
    blocks, channel = tmp_path / "blocks", tmp_path / "channel"
    export_gguf(path, blocks, ExportOptions(), base=base, progress=False)
    export_gguf(path, channel, ExportOptions(gguf_layout="int8-channel"), base=base, progress=False)

    entry = json.loads((channel / "manifest.json").read_text())["components"]["transformer"]
    assert entry["precision"] == "gguf-q8_0:int8-channel"
    assert entry["gguf"]["layout"] == "int8-channel" and entry["gguf"]["exact"] == 0 and entry["gguf"]["requantized"] > 0
    assert entry["gguf"]["requantized_min_snr_db"] > 30
    default = json.loads((blocks / "manifest.json").read_text())["components"]["transformer"]
    assert "layout" not in default["gguf"] and default["precision"] == "gguf-q8_0"  # the default as it was

    ops = {f: [n.op_type for n in onnx.load(str(f / "transformer" / "model.onnx"), load_external_data=False).graph.node]
           for f in (blocks, channel)}
    assert "MatMulNBits" not in ops[channel]  # layer for layer: each MatMulNBits of the blocks export re-laid
    assert ops[channel].count("DynamicQuantizeMatMul") == ops[blocks].count("MatMulNBits") > 0

    feeds, got = _run(base, channel)
    _, exact = _run(base, blocks)
    family, info = source_info(base)
    spec = family.component_specs(info, {family.backbone})[family.backbone]
    ref_module = family_export.wrap(family, spec, diffusers_from_gguf("QwenImageTransformer2DModel", path, base))
    with torch.no_grad():
        ref = ref_module.eval()(*feeds.values()).numpy()
    db, db_blocks = _snr(ref, got), _snr(ref, exact)
    print(f"\nint8-channel {db:.2f} dB, blocks {db_blocks:.2f} dB vs diffusers-from-GGUF; {entry['gguf']}")
    assert db >= MIN_DB and db_blocks > db  # re-quantized: measurably further from the GGUF than its exact blocks
    assert Pipeline.from_folder(channel)("a red circle", steps=2, height=32, width=32).images.shape == (1, 32, 32, 3)


def test_bad_layout_and_non_gguf_source_refused_in_one_line(base, tmp_path):
    path = write_gguf(tmp_path / "q4.gguf", state_dict_arrays(base, "transformer"), "Q4_0", "qwen_image")
    cases = [(lambda: export_gguf(path, tmp_path / "out", ExportOptions(gguf_layout="int4"), base=base,
                                  progress=False), "--gguf-layout must be one of blocks, int8-channel"),
             (lambda: export_pipeline(base, tmp_path / "out", ExportOptions(gguf_layout="int8-channel"), progress=False),
              "a GGUF source only")]
    for call, match in cases:
        with pytest.raises(UserError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
