"""bench --arch zimage / flux2_klein: release configs, the shard-by-shard random writer, --arch-depth, and the
files the sd.cpp peer reads (arch/sdcpp_files.py: the inverse of diffusers' single-file converters)."""

import json
from pathlib import Path

import pytest

from onnxdiffusion.bench.arch import depth_args
from onnxdiffusion.bench.arch import release, sdcpp_files
from onnxdiffusion.bench.arch.fullwidth import count_params
from onnxdiffusion.errors import UserError


@pytest.mark.slow  # ~60 s on the loaded 2-core machine (meta init of 10B parameters' modules)
def test_release_backbones_have_the_released_parameter_counts():
    # meta device: no memory; Z-Image-Turbo 6.15B, FLUX.2 [klein] 4B 3.88B (experiments/families/fullsize_export.md)
    assert round(count_params("zimage", (30, 2)) / 1e9, 2) == 6.15
    assert round(count_params("flux2_klein", (5, 20)) / 1e9, 2) == 3.88


def test_encoder_config_release_and_narrow():
    assert release.encoder_config("zimage", None, 400)["num_hidden_layers"] == 36
    assert release.encoder_config("zimage", None, 400)["vocab_size"] == 151936
    narrow = release.encoder_config("zimage", 2, 400)
    assert (narrow["hidden_size"], narrow["num_hidden_layers"], narrow["vocab_size"]) == (2560, 2, 400)
    with pytest.raises(UserError, match="at least 28"):
        release.encoder_config("flux2_klein", 2, 400)


@pytest.mark.parametrize("text, args", [
    (None, []), ("1,1", ["--depth", "1,1"]), ("1,1/28", ["--depth", "1,1", "--encoder-layers", "28"]),
])
def test_depth_args(text, args):
    assert depth_args("flux2_klein", text) == args


@pytest.mark.parametrize("text", ["x", "1,0", "1/a", "1/0"])
def test_depth_args_refuses_bad_input(text):
    with pytest.raises(UserError, match="--arch-depth"):
        depth_args("zimage", text)


def test_encoder_depth_only_for_release_arches():
    with pytest.raises(UserError, match="zimage and flux2_klein only"):
        depth_args("flux", "1,1/2")


@pytest.mark.slow
def test_write_random_loads_in_diffusers(tmp_path):
    import torch
    from accelerate import init_empty_weights
    from diffusers import ZImageTransformer2DModel

    cfg = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=2, n_refiner_layers=1,
               n_heads=2, n_kv_heads=2, cap_feat_dim=24, axes_dims=[8, 8, 8], axes_lens=[64, 16, 16])
    with init_empty_weights():
        meta = ZImageTransformer2DModel(**cfg)
    meta.save_config(tmp_path)
    n = release.write_random(meta, tmp_path, "diffusion_pytorch_model.safetensors",
                             "diffusion_pytorch_model.safetensors.index.json")
    model = ZImageTransformer2DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert n == sum(p.numel() for p in model.parameters())
    norm = model.layers[0].attention_norm1.weight
    assert torch.all(norm == 1) and model.layers[0].attention.to_q.weight.float().std() > 0.005


def _save(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _roundtrip(kind: str, model, folder: Path, convert):
    """sdcpp_files' original-name file, read back through diffusers' own converter, is the diffusers state."""
    from safetensors.torch import load_file

    plan = sdcpp_files.backbone_plan(kind, _save(model, folder / "src"))
    sdcpp_files.write(plan, folder / "out.safetensors")
    original = load_file(folder / "out.safetensors")
    back = convert(dict(original))
    state = model.state_dict()
    assert set(back) == set(state)
    for k, v in state.items():
        assert back[k].shape == v.shape and bool((back[k] == v).all()), k
    return original


def test_zimage_names_invert_diffusers_converter(tmp_path):
    import torch
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=24, axes_dims=[8, 8, 8], axes_lens=[64, 16, 16])
    original = _roundtrip("zimage", model, tmp_path, convert_z_image_transformer_checkpoint_to_diffusers)
    # what sd.cpp's version check looks for (with its model.diffusion_model. prefix)
    assert "cap_embedder.0.weight" in original and "layers.0.attention.qkv.weight" in original


def test_flux2_names_invert_diffusers_converter(tmp_path):
    import torch
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=24, timestep_guidance_channels=16, mlp_ratio=3.0, axes_dims_rope=[2, 2, 2, 2],
        guidance_embeds=False)
    original = _roundtrip("flux2", model, tmp_path, convert_flux2_transformer_checkpoint_to_diffusers)
    assert "double_stream_modulation_img.lin.weight" in original and "single_blocks.1.linear1.weight" in original
    assert not any(k.startswith("single_blocks.47.") for k in original)  # klein, not FLUX.2 [dev]


def test_llm_file_pads_the_embedding_to_qwen_vocabulary(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    comp = tmp_path / "text_encoder"
    comp.mkdir()
    emb = torch.randn(10, 8).to(torch.bfloat16)
    save_file({"embed_tokens.weight": emb, "norm.weight": torch.ones(8)}, str(comp / "model.safetensors"))
    sdcpp_files.write(sdcpp_files.llm_plan(comp), tmp_path / "llm.safetensors")
    out = load_file(tmp_path / "llm.safetensors")
    assert set(out) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert out["model.embed_tokens.weight"].shape == (sdcpp_files.QWEN_VOCAB, 8)
    assert torch.equal(out["model.embed_tokens.weight"][:10], emb)
    assert not out["model.embed_tokens.weight"][10:].any()


def test_layout_reads_the_pipeline_class(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    assert sdcpp_files.layout(tmp_path) == "zimage"
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    assert sdcpp_files.layout(tmp_path) is None
    assert sdcpp_files.layout(tmp_path / "missing") is None
