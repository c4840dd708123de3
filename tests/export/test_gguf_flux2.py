"""FLUX.2 GGUF files under the release's names (city96's and sd.cpp's: double blocks with a fused qkv per stream,
the final modulation's (shift, scale) halves) export through families/gguf_names.FLUX2: the same backbone, output
for output, as the diffusers-named file of the same blocks, and >= 40 dB of diffusers' own GGUF loading."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from onnxdiffusion.bench.arch import sdcpp_files
from onnxdiffusion.export import ExportOptions, family_export
from onnxdiffusion.export.gguf import export_gguf
from onnxdiffusion.export.pipeline import source_info
from onnxdiffusion.families import get_family
from onnxdiffusion.families.gguf_names import FLUX2, GgufNames
from onnxdiffusion.runtime import Pipeline

from gguf_files import diffusers_from_gguf, state_dict_arrays, write_gguf

pytestmark = pytest.mark.slow


def _snr(ref: np.ndarray, got: np.ndarray) -> float:
    err = np.mean((ref - got).astype(np.float64) ** 2)
    return float("inf") if err == 0 else float(10 * np.log10(np.mean(ref.astype(np.float64) ** 2) / err))


def original_tensors(base, folder) -> dict[str, np.ndarray]:
    """The base's transformer under the release's names (sdcpp_files: the inverse of diffusers' converter)."""
    from safetensors.numpy import load_file

    plan = sdcpp_files.backbone_plan("flux2", base / "transformer")
    sdcpp_files.write(plan, folder / "original.safetensors")
    return load_file(str(folder / "original.safetensors"))  # no ComfyUI prefix: diffusers' FLUX.2 converter keeps it


def _feeds(base):
    family, info = source_info(base)
    spec = family.component_specs(info, {family.backbone})[family.backbone]
    feeds = family_export.export_feeds(family, spec, family.export_dims(spec, info)[0], torch.Generator().manual_seed(0), 0)
    return family, spec, {t.name: feeds[t.name] for t in spec.inputs}


def _run(folder, feeds) -> np.ndarray:
    sess = ort.InferenceSession(str(folder / "transformer" / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: v.numpy() for n, v in feeds.items()})[0]


def test_release_names_map_onto_diffusers_names():
    assert FLUX2.map("model.diffusion_model.double_blocks.3.img_attn.qkv.weight") == [
        ("transformer_blocks.3.attn.to_q.weight", (0,), 3), ("transformer_blocks.3.attn.to_k.weight", (1,), 3),
        ("transformer_blocks.3.attn.to_v.weight", (2,), 3)]
    assert FLUX2.map("double_blocks.0.txt_attn.qkv.weight")[2] == ("transformer_blocks.0.attn.add_v_proj.weight", (2,), 3)
    assert FLUX2.map("final_layer.adaLN_modulation.1.weight") == [("norm_out.linear.weight", (1, 0), 2)]
    assert FLUX2.map("single_blocks.7.linear1.weight") == [("single_transformer_blocks.7.attn.to_qkv_mlp_proj.weight",
                                                            (0,), 1)]  # fused in diffusers too: not split
    assert FLUX2.map("single_blocks.7.norm.key_norm.scale")[0][0] == "single_transformer_blocks.7.attn.norm_k.weight"
    assert FLUX2.map("double_blocks.1.txt_attn.norm.query_norm.scale")[0][0] == "transformer_blocks.1.attn.norm_added_q.weight"
    assert FLUX2.map("double_stream_modulation_img.lin.weight")[0][0] == "double_stream_modulation_img.linear.weight"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_release_named_gguf_exports_like_diffusers_named_and_matches_diffusers(tiny_flux2_klein_diffusers,
                                                                              tiny_flux2_klein_onnx, tmp_path,
                                                                              qtype, monkeypatch):
    base = tiny_flux2_klein_diffusers
    exported = tiny_flux2_klein_onnx  # --base an fp32 export: only the backbone is exported here
    path = write_gguf(tmp_path / f"release-{qtype}.gguf", original_tensors(base, tmp_path), qtype, "flux2")
    out = tmp_path / "release"
    export_gguf(path, out, ExportOptions(), base=exported, progress=False)
    entry = json.loads((out / "manifest.json").read_text())["components"]["transformer"]
    assert entry["precision"] == f"gguf-{qtype.lower()}" and entry["gguf"]["exact"] > 0
    assert entry["gguf"]["requantized"] == 0  # splits and the reorder are on whole rows: blocks kept as they are

    # the same blocks under diffusers' names (no split, no reorder), read with an identity map
    named = write_gguf(tmp_path / f"diffusers-{qtype}.gguf", state_dict_arrays(base, "transformer"), qtype, "flux2")
    monkeypatch.setattr(get_family("flux2_klein"), "gguf_names", GgufNames(architectures=("flux2",)))
    export_gguf(named, tmp_path / "named", ExportOptions(), base=exported, progress=False)
    monkeypatch.undo()

    family, spec, feeds = _feeds(base)
    got, same = _run(out, feeds), _run(tmp_path / "named", feeds)
    np.testing.assert_array_equal(got, same)
    ref_module = family_export.wrap(family, spec, diffusers_from_gguf("Flux2Transformer2DModel", path, base))
    with torch.no_grad():
        ref = ref_module.eval()(*feeds.values()).numpy()
    db = _snr(ref, got)
    print(f"\nFLUX.2 klein {qtype}: backbone {db:.2f} dB vs diffusers-from-GGUF, {entry['gguf']}")
    assert db >= 40
    assert Pipeline.from_folder(out)("a red circle", steps=2, height=32, width=32).images.shape == (1, 32, 32, 3)
