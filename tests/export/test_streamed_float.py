"""Export bounded by memory (issue 43): a float backbone's Linear weights streamed from its safetensors shards
(export/streamed_float.py) give the plain export's outputs on tiny Z-Image, Qwen-Image and FLUX.2 [klein]
pipelines (bf16 shards too), validated on a cut-down copy; "auto" leaves small backbones to the plain export; a
crafted shard header is refused in one line."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.export import ExportOptions, export_pipeline, family_export
from onnxdiffusion.export.pipeline import source_info
from onnxdiffusion.export.safetensors_shards import Shards
from onnxdiffusion.export.streamed_float import should_stream

pytestmark = pytest.mark.slow


def _src(request, kind: str) -> Path:
    """The tiny `kind` pipeline (conftest's session fixture: built once per run, read-only here)."""
    return request.getfixturevalue(f"tiny_{kind}_diffusers")


def _backbone_out(src: Path, out: Path) -> np.ndarray:
    family, info = source_info(src)
    spec = family.component_specs(info, {family.backbone})[family.backbone]
    feeds = family_export.export_feeds(family, spec, family.export_dims(spec, info)[0], torch.Generator().manual_seed(3), 0)
    sess = ort.InferenceSession(str(out / family.backbone / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, {t.name: feeds[t.name].numpy() for t in spec.inputs})[0]


@pytest.mark.parametrize("kind", ["zimage", "qwenimage", "flux2_klein"])
def test_streamed_matches_plain(request, tmp_path, kind):
    src = _src(request, kind)
    family, _ = source_info(src)
    base = ExportOptions(components=(family.backbone,))
    plain = export_pipeline(src, tmp_path / "plain", replace(base, stream_weights="off"), progress=False)
    streamed = export_pipeline(src, tmp_path / "streamed", replace(base, stream_weights="on"), progress=False)
    entry = streamed.to_dict()["components"][family.backbone]
    assert entry["streamed_weights"] is True
    assert entry["validation"]["scope"].startswith("cut-down copy")
    assert entry["validation"]["max_abs_error"] <= entry["validation"]["atol"]
    assert "streamed_weights" not in plain.to_dict()["components"][family.backbone]
    model = onnx.load(str(tmp_path / "streamed" / family.backbone / "model.onnx"), load_external_data=False)
    assert all(n.domain != "ai.onnxdiffusion.stream" for n in model.graph.node)
    assert all(o.domain != "ai.onnxdiffusion.stream" for o in model.opset_import)
    onnx.checker.check_model(str(tmp_path / "streamed" / family.backbone / "model.onnx"))
    ref, got = _backbone_out(src, tmp_path / "plain"), _backbone_out(src, tmp_path / "streamed")
    assert np.abs(ref - got).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_bf16_shards_read_exactly(tiny_zimage_diffusers, tmp_path):
    from diffusers import ZImageTransformer2DModel

    src = tiny_zimage_diffusers
    model = ZImageTransformer2DModel.from_pretrained(src / "transformer")
    bf16 = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True, max_shard_size="20KB")
    shards = Shards(bf16)
    assert len({e.path for e in shards.entries.values()}) > 1
    for name, p in model.state_dict().items():
        assert torch.equal(torch.from_numpy(shards.read(name)), p.float())


def test_auto_keeps_small_backbones_plain(tiny_zimage_diffusers, tmp_path):
    src = tiny_zimage_diffusers
    assert not should_stream(src / "transformer", "auto")
    assert should_stream(src / "transformer", "on")
    with pytest.raises(UserError, match="stream"):
        export_pipeline(src, tmp_path / "out", ExportOptions(stream_weights="yes"), progress=False)


def _crafted(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("header,data", [
    (b"{not json", b""),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),  # past the end
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16),  # shape vs length
    ({"w": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16),
    ({"w": {"dtype": "F32"}}, b""),
    ([1, 2], b""),
])
def test_crafted_headers_refused(tmp_path, header, data):
    _crafted(tmp_path / "m.safetensors", header, data)
    with pytest.raises(UserError):
        Shards(tmp_path)


def test_huge_header_length_refused(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    with pytest.raises(UserError, match="header length"):
        Shards(tmp_path)


def test_streamed_folder_generates_the_plain_image(tiny_zimage_onnx, tiny_zimage_streamed_onnx):
    """The plain folder is conftest's (export_family: every component but the VAE encoder, stream_weights "auto",
    which is "off" for a tiny backbone: test_auto_keeps_small_backbones_plain); the streamed one is exported alike
    (conftest's tiny_zimage_streamed_onnx: export_family with stream_weights "on", once per run)."""
    from onnxdiffusion.runtime import Pipeline

    folders = {"off": tiny_zimage_onnx, "on": tiny_zimage_streamed_onnx}
    images = []
    for setting, out in folders.items():
        streamed = json.loads((out / "manifest.json").read_text())["components"]["transformer"].get("streamed_weights")
        assert streamed is (True if setting == "on" else None), setting
        for memory in ("default", "bounded"):
            pipe = Pipeline.from_folder(out, threads=1, memory=memory)
            images.append(pipe("a red circle", steps=2, seed=1, height=32, width=32).images.astype(int))
    assert max(np.abs(images[0] - im).max() for im in images[1:]) <= 1
