"""`export MODEL.gguf OUT --base DIR` against diffusers' own GGUF loading (from_single_file +
GGUFQuantizationConfig) on tiny pipelines: the backbone's output as ONNX Runtime runs it at generate time (int8
activations, accuracy_level 4) and the whole pipeline's image, each >= 40 dB; the low-bit weights' bytes against
fp32; a file of another model, size or architecture refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.export import ExportOptions, family_export
from onnxdiffusion.export.gguf import export_gguf
from onnxdiffusion.export.pipeline import source_info
from onnxdiffusion.runtime import Pipeline

from gguf_files import diffusers_from_gguf, state_dict_arrays, write_gguf, zimage_original_names

pytestmark = pytest.mark.slow

H = W = 32
PROMPT = "a small red circle on the left"
# family -> (tiny base builder, backbone class, the files' architecture label, names: diffusers -> the file's)
FAMILIES = {"qwenimage": ("qwenimage", "QwenImageTransformer2DModel", "qwen_image", None),
            "zimage": ("zimage", "ZImageTransformer2DModel", "lumina2", zimage_original_names)}
# the weights' bytes in the backbone file / their fp32 bytes (issue 43: <= 0.3x Q8_0, <= 0.17x Q4_0)
WEIGHT_RATIO = {"Q8_0": 0.30, "Q4_0": 0.17, "Q5_0": 0.30}


def _snr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(ref.astype(np.float64) ** 2) / np.mean((ref - got).astype(np.float64) ** 2)))


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    from tiny_families import build_tiny_qwenimage, build_tiny_zimage

    root = tmp_path_factory.mktemp("gguf_bases")
    return {"qwenimage": build_tiny_qwenimage(root, heads=2), "zimage": build_tiny_zimage(root, 64, (8, 12, 12))}


def _gguf(bases, family: str, qtype: str, folder: Path) -> Path:
    _, _, arch, rename = FAMILIES[family]
    tensors = state_dict_arrays(bases[family], "transformer")
    if rename is not None:
        tensors = rename(tensors)
    return write_gguf(folder / f"{family}-{qtype}.gguf", tensors, qtype, arch)


def _backbone_snr(family_name: str, base: Path, gguf_path: Path, folder: Path) -> float:
    """diffusers-from-GGUF vs the exported backbone in a generate-time ONNX Runtime session, on export's feeds."""
    family, info = source_info(base)
    spec = family.component_specs(info, {family.backbone})[family.backbone]
    ref_module = family_export.wrap(family, spec, diffusers_from_gguf(FAMILIES[family_name][1], gguf_path, base))
    feeds = family_export.export_feeds(family, spec, family.export_dims(spec, info)[0], torch.Generator().manual_seed(0), 0)
    names = [t.name for t in spec.inputs]
    with torch.no_grad():
        ref = ref_module.eval()(*(feeds[n] for n in names)).numpy()
    sess = ort.InferenceSession(str(folder / family.backbone / "model.onnx"), providers=["CPUExecutionProvider"])
    return _snr(ref, sess.run(None, {n: feeds[n].numpy() for n in names})[0])


def _weight_ratio(model_path: Path) -> float:
    model = onnx.load(str(model_path))
    inits = {i.name: i for i in model.graph.initializer}
    low, fp32 = 0, 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            low += sum(len(inits[n].raw_data) for n in node.input[1:3])
            fp32 += 4 * attrs["K"] * attrs["N"]
    assert fp32 > 0
    return low / fp32


def _qwen_image(base: Path, gguf_path: Path, folder: Path) -> float:
    from diffusers import QwenImagePipeline

    ref = QwenImagePipeline.from_pretrained(base, transformer=diffusers_from_gguf("QwenImageTransformer2DModel",
                                                                                 gguf_path, base))
    g = torch.Generator().manual_seed(1)
    latents = ref._pack_latents(torch.randn(1, 4, H // 4, W // 4, generator=g), 1, 4, H // 4, W // 4)
    want = ref(PROMPT, negative_prompt="blurry", true_cfg_scale=4.0, height=H, width=W, num_inference_steps=4,
               latents=latents, output_type="np").images
    got = Pipeline.from_folder(folder)(PROMPT, negative_prompt="blurry", steps=4, sampler="flow_euler", guidance=4.0,
                                        height=H, width=W, latents=latents.numpy())
    return psnr(got.images, (want * 255).round().astype(np.uint8))


def _z_image(base: Path, gguf_path: Path, folder: Path) -> float:
    from diffusers import ZImagePipeline

    ref = ZImagePipeline.from_pretrained(base, transformer=diffusers_from_gguf("ZImageTransformer2DModel", gguf_path,
                                                                             base))
    latents = torch.randn(1, 4, H // 4, W // 4, generator=torch.Generator().manual_seed(1))
    want = ref(PROMPT, negative_prompt="blurry", guidance_scale=3.0, height=H, width=W, num_inference_steps=4,
               latents=latents, output_type="np").images
    got = Pipeline.from_folder(folder)(PROMPT, negative_prompt="blurry", steps=4, guidance=3.0, height=H, width=W,
                                        latents=latents.numpy())
    return psnr(got.images, (want * 255).round().astype(np.uint8))


IMAGE_PARITY = {"qwenimage": _qwen_image, "zimage": _z_image}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_export_matches_diffusers_gguf(bases, tmp_path, family, qtype):
    gguf_path = _gguf(bases, family, qtype, tmp_path)
    out = tmp_path / "onnx"
    manifest = export_gguf(gguf_path, out, ExportOptions(), base=bases[family], progress=False)
    entry = json.loads((out / "manifest.json").read_text())["components"]["transformer"]
    report = entry["gguf"]
    assert entry["precision"] == f"gguf-{qtype.lower()}" and manifest.source["gguf"] is True
    assert report["exact" if qtype in ("Q8_0", "Q4_0") else "requantized"] > 0
    ratio = _weight_ratio(out / "transformer" / "model.onnx")
    backbone_db = _backbone_snr(family, bases[family], gguf_path, out)
    image_db = IMAGE_PARITY[family](bases[family], gguf_path, out)
    print(f"\n{family} {qtype}: backbone {backbone_db:.2f} dB, image PSNR {image_db:.2f} dB, weights {ratio:.3f}x fp32, "
          f"file {entry['bytes']} B, {report}")
    assert backbone_db >= 40 and image_db >= 40
    assert ratio <= WEIGHT_RATIO[qtype]


def test_refusals_are_one_line(bases, tmp_path):
    base = bases["qwenimage"]
    tensors = state_dict_arrays(base, "transformer")
    good = write_gguf(tmp_path / "good.gguf", tensors, "Q8_0", "qwen_image")
    cases = [
        (dict(base=None), good, "give --base"),
        (dict(base=base), write_gguf(tmp_path / "arch.gguf", tensors, "Q8_0", "lumina2"), "'lumina2' model"),
        (dict(base=base), write_gguf(tmp_path / "less.gguf", {k: v for k, v in tensors.items() if "proj_out" not in k},
                                     "Q8_0", "qwen_image"), "lacks 2 tensor"),
        (dict(base=base), write_gguf(tmp_path / "more.gguf", {**tensors, "extra.weight": np.zeros((4, 32))}, "Q8_0",
                                     "qwen_image"), "holds 1 tensor"),
        (dict(base=base), write_gguf(tmp_path / "shape.gguf", {**tensors, "proj_out.bias": np.zeros(3)}, "Q8_0",
                                     "qwen_image"), "has shape \\[3\\]"),
        (dict(base=base, options=ExportOptions(lora_points="linear")), good, "--lora"),
    ]
    for kwargs, path, match in cases:
        with pytest.raises(UserError, match=match) as e:
            export_gguf(path, tmp_path / "out", progress=False, **kwargs)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_base_can_be_an_exported_folder(bases, tmp_path):
    """--base an fp32 export: the other components are copied byte for byte, the backbone is the same export as
    from the diffusers folder (same graph inputs, same outputs), the folder generates."""
    from onnxdiffusion.export import export_pipeline

    base = bases["qwenimage"]
    gguf_path = _gguf(bases, "qwenimage", "Q4_0", tmp_path)
    exported = export_pipeline(base, tmp_path / "fp32", ExportOptions(), progress=False)
    from_diffusers = tmp_path / "a"
    export_gguf(gguf_path, from_diffusers, ExportOptions(), base=base, progress=False)
    from_folder = tmp_path / "b"
    manifest = export_gguf(gguf_path, from_folder, ExportOptions(), base=tmp_path / "fp32", progress=False)
    assert manifest.components["transformer"].precision == "gguf-q4_0"
    for name in exported.components:
        if name != "transformer":
            assert manifest.to_dict()["files"][f"{name}/model.onnx"] == exported.to_dict()["files"][f"{name}/model.onnx"]
    family, info = source_info(base)
    spec = family.component_specs(info, {family.backbone})[family.backbone]
    feeds = family_export.export_feeds(family, spec, family.export_dims(spec, info)[0], torch.Generator().manual_seed(0), 0)
    run = {n: feeds[n].numpy() for n in (t.name for t in spec.inputs)}
    outs = [ort.InferenceSession(str(f / "transformer" / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, run)[0]
            for f in (from_diffusers, from_folder)]
    np.testing.assert_array_equal(outs[0], outs[1])
    assert Pipeline.from_folder(from_folder)(PROMPT, steps=2, height=H, width=W).images.shape == (1, H, W, 3)
    with pytest.raises(UserError, match="plain fp32 export"):
        export_gguf(gguf_path, tmp_path / "c", ExportOptions(), base=from_folder, progress=False)


def test_size_one_dimensions_dropped_by_ggml_are_the_same_tensor(bases, tmp_path):
    # stable-diffusion.cpp's converter writes Z-Image's [1, dim] pad tokens as [dim] (GGML drops size-1 dimensions)
    tensors = zimage_original_names(state_dict_arrays(bases["zimage"], "transformer"))
    squeezed = {k: (v.reshape(-1) if k.endswith("pad_token") else v) for k, v in tensors.items()}
    assert any(v.ndim == 1 and k.endswith("pad_token") for k, v in squeezed.items())
    path = write_gguf(tmp_path / "squeezed.gguf", squeezed, "Q8_0", "lumina2")
    export_gguf(path, tmp_path / "out", options=ExportOptions(validate=False), base=bases["zimage"], progress=False)
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_large_backbone_validates_on_a_cut_down_copy(bases, tmp_path, monkeypatch):
    """stream_weights "on" (what "auto" picks above 12 GiB of fp32 weights, a 20B Qwen-Image): the GGUF backbone is
    validated on its first blocks, not paged in whole by ONNX Runtime; the full graph still matches diffusers'
    GGUF loading. "auto" on a tiny backbone keeps the whole-model check. The blocks are written once: no
    consolidation copies the external data after them (at 20B that was 11.5 GB more, twice the bytes on disk)."""
    import shutil

    from diffusers import QwenImageTransformer2DModel

    import onnxdiffusion.export.validate as validate_mod

    copies = []
    monkeypatch.setattr(validate_mod, "consolidate", lambda *a, **k: copies.append(a))

    base = tmp_path / "base3"
    shutil.copytree(bases["qwenimage"], base)
    config = QwenImageTransformer2DModel.load_config(str(base / "transformer"))
    torch.manual_seed(0)
    deeper = QwenImageTransformer2DModel.from_config({**config, "num_layers": 3})
    shutil.rmtree(base / "transformer")
    deeper.save_pretrained(base / "transformer")
    tensors = {k: v.numpy() for k, v in deeper.state_dict().items()}
    gguf_path = write_gguf(tmp_path / "q4_0.gguf", tensors, "Q4_0", "qwen_image")
    entries = {}
    for setting in ("on", "auto"):
        out = tmp_path / setting
        export_gguf(gguf_path, out, ExportOptions(components=("transformer",), stream_weights=setting), base=base,
                    progress=False)
        entries[setting] = json.loads((out / "manifest.json").read_text())["components"]["transformer"]
        assert _backbone_snr("qwenimage", base, gguf_path, out) >= 40
    assert entries["on"]["validation"]["scope"].startswith("cut-down copy")
    assert entries["on"]["validation"]["blocks_cut"] == {"transformer_blocks": 3}
    assert "scope" not in entries["auto"]["validation"]
    assert copies == []
    assert sorted(p.name for p in (tmp_path / "on" / "transformer").iterdir()) == ["config.json", "model.onnx",
                                                                                   "model.onnx_data"]
