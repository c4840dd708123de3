"""The tiny autoencoder (diffusers AutoencoderTiny, TAESD's architecture): export parity with diffusers,
`--decoder tiny` on the shipped folder, its scaling per family, and bad input (one line, nothing written)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli_here

from onnxdiffusion.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "shapes-sd-onnx"
SHIPPED_MMDIT = ROOT / "models" / "shapes-mmdit-onnx"
# measured on the shipped tiny decoder (experiments/tiny-vae/results.json): PSNR of its images against the VAE
# decoder's on 32 held-out prompts, mean 35.9 / 34.2 dB (SD / MMDiT), the worst single image 27.9 dB
PSNR_FLOOR = 24.0


def build_tiny_vae(folder: Path, scaling: float = 1.0, shift: float = 0.0, blocks: int = 3, channels: int = 4) -> Path:
    """A random AutoencoderTiny: `blocks` stages (2 ** (blocks - 1) spatial factor), 8 channels."""
    import torch
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    AutoencoderTiny(encoder_block_out_channels=(8,) * blocks, decoder_block_out_channels=(8,) * blocks,
                    num_encoder_blocks=(1,) * blocks, num_decoder_blocks=(1,) * blocks, latent_channels=channels,
                    scaling_factor=scaling, shift_factor=shift).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_taesd(tmp_path_factory) -> Path:
    # decodes the backbone's latents through its own scaling (not 1.0, not the VAE's): the run time must use it
    return build_tiny_vae(tmp_path_factory.mktemp("taesd") / "vae_tiny", scaling=1.7, shift=0.1)


@pytest.fixture(scope="module")
def with_tiny(tiny_onnx, tiny_taesd, tmp_path_factory) -> Path:
    from onnxdiffusion.export.tiny_vae import add_tiny_vae

    out = tmp_path_factory.mktemp("with_tiny") / "model"
    add_tiny_vae(tiny_onnx, tiny_taesd, out)
    return out


def test_export_matches_diffusers(with_tiny, tiny_taesd, tiny_onnx):
    import onnxruntime as ort
    import torch
    from diffusers import AutoencoderTiny

    manifest = json.loads((with_tiny / "manifest.json").read_text())
    dec, enc = manifest["components"]["vae_decoder_tiny"], manifest["components"]["vae_encoder_tiny"]
    assert (dec["scaling_factor"], dec["shift_factor"]) == (1.7, 0.1)
    assert dec["validation"]["max_abs_error"] < 1e-4 and enc["validation"]["max_abs_error"] < 1e-4
    before = json.loads((tiny_onnx / "manifest.json").read_text())
    for rel, digest in before["files"].items():  # the other components' files untouched
        assert manifest["files"][rel] == digest
    model = AutoencoderTiny.from_pretrained(tiny_taesd).eval()
    z = np.random.default_rng(0).standard_normal((2, 4, 8, 12), dtype=np.float32)
    x = np.random.default_rng(1).uniform(-1, 1, (1, 3, 32, 24)).astype(np.float32)
    with torch.no_grad():
        ref_img = model.decode(torch.from_numpy(z)).sample.numpy()
        ref_lat = model.encode(torch.from_numpy(x)).latents.numpy()
    so = ort.InferenceSession(str(with_tiny / dec["path"]), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(so.run(None, {"latent_sample": z})[0], ref_img, atol=1e-4)
    so = ort.InferenceSession(str(with_tiny / enc["path"]), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(so.run(None, {"sample": x})[0], ref_lat, atol=1e-4)


def test_decoder_tiny_is_diffusers_decode_of_scaled_latents(with_tiny, tiny_taesd):
    """diffusers' pipelines decode an AutoencoderTiny with its own config: latents / scaling + shift."""
    import torch
    from diffusers import AutoencoderTiny

    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(with_tiny)
    tiny = pipe("a red circle", steps=2, decoder="tiny")
    full = pipe("a red circle", steps=2)
    np.testing.assert_array_equal(tiny.latents, full.latents)
    assert tiny.settings["decoder"] == "tiny"
    model = AutoencoderTiny.from_pretrained(tiny_taesd).eval()
    with torch.no_grad():
        ref = model.decode(torch.from_numpy(tiny.latents) / 1.7 + 0.1).sample.numpy()
    ref = (np.clip(ref / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1) * 255).round().astype(np.uint8)
    assert np.abs(ref.astype(int) - tiny.images.astype(int)).max() <= 1


@pytest.mark.slow  # 7-13 s each: the whole suite (make test) runs it, test-fast does not
def test_export_option_and_skip(tiny_diffusers, tiny_taesd, tmp_path):
    from onnxdiffusion.export import ExportOptions, export_pipeline

    out = tmp_path / "m"
    manifest = export_pipeline(tiny_diffusers, out, ExportOptions(components=("text_encoder", "unet", "vae_decoder"),
                                                                  tiny_vae=str(tiny_taesd), skip=("vae_encoder_tiny",)),
                               progress=False)
    assert "vae_decoder_tiny" in manifest["components"] and "vae_encoder_tiny" not in manifest["components"]
    assert (out / "vae_decoder_tiny" / "config.json").is_file()


def test_scaling_per_family():
    """The tiny decoder's feed is the family's decoder feed (unpacking included) with the tiny model's
    scaling and shift: TAESD (SD: 1.0, decodes scaled latents), TAESD3 (its VAE's pair, raw latents)."""
    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.families import get_family
    from onnxdiffusion.families.tiny_vae import scaled_info
    from onnxdiffusion.folder.manifest import Component
    from onnxdiffusion.folder.paths import default_model_folder

    def tiny(scaling, shift):
        return Component.from_dict("vae_decoder_tiny", {"path": "t.onnx", "scaling_factor": scaling, "shift_factor": shift})

    z = np.random.default_rng(0).standard_normal((1, 4, 8, 8), dtype=np.float32)
    base = read_manifest(default_model_folder()).pipeline
    sd = base.with_vae_scaling(0.18215, 0.0)
    feed = get_family("sd").decoder_feed(scaled_info(sd, tiny(1.0, 0.0)), z, 32, 32)
    np.testing.assert_array_equal(feed, z)
    sd3 = base.with_vae_scaling(1.5305, 0.0609)
    feed = get_family("sd3").decoder_feed(scaled_info(sd3, tiny(1.5305, 0.0609)), z, 32, 32)
    np.testing.assert_allclose(feed, z / np.float32(1.5305) + np.float32(0.0609), atol=1e-6)
    assert not get_family("qwenimage").tiny_vae


@pytest.mark.parametrize("change, fragment", [
    ({"_class_name": "AutoencoderKL"}, "must be AutoencoderTiny"),
    ({"latent_channels": 16}, "latent_channels 16"),
    ({"decoder_block_out_channels": [8, 8, 8, 8]}, "scales images by 8x"),
    ({"scaling_factor": -1.0}, "scaling_factor must be positive"),
    ({"shift_factor": "x"}, "shift_factor must be a finite number"),
])
def test_bad_tiny_source_is_one_line(tiny_taesd, tmp_path, change, fragment):
    from onnxdiffusion.export.tiny_vae import check_tiny_source
    from onnxdiffusion.families import get_family

    bad = tmp_path / "bad"
    shutil.copytree(tiny_taesd, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.folder.paths import default_model_folder

    info = read_manifest(default_model_folder()).pipeline  # latent_channels 4, vae_scale_factor 4
    assert (info.latent_channels, info.vae_scale_factor) == (4, 4)
    with pytest.raises(UserError, match=fragment):
        check_tiny_source(bad, get_family("sd"), info)
    with pytest.raises(UserError, match="not a diffusers AutoencoderTiny folder"):
        check_tiny_source(tmp_path / "missing", get_family("sd"), info)
    with pytest.raises(UserError, match="no tiny"):
        check_tiny_source(tiny_taesd, get_family("qwenimage"), info)


def test_decoder_tiny_on_a_folder_without_one_is_one_line(tiny_onnx, tmp_path):
    out = tmp_path / "out.png"
    proc = run_cli_here("generate", tiny_onnx, "a red circle", "--decoder", "tiny", "--steps", "1", "-o", out)
    assert_one_line_error(proc, "has no tiny decoder", "--tiny-vae")
    proc = run_cli_here("generate", tiny_onnx, "a red circle", "--decoder", "small", "--steps", "1", "-o", out)
    assert_one_line_error(proc, "decoder must be one of full, tiny")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("folder", [SHIPPED, SHIPPED_MMDIT], ids=["sd", "mmdit"])
def test_shipped_tiny_decoder(folder, tmp_path):
    """The shipped models' distilled tiny decoder: the image's shape, not blank, close to the VAE's."""
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(folder, threads=1)
    prompt = "a large red circle on the left and a small blue square on the right"
    tiny = pipe(prompt, seed=3, decoder="tiny")
    full = pipe.decode(tiny.latents)
    assert tiny.images.shape == full.shape == (1, 64, 64, 3)
    assert tiny.images.std() > 10  # not blank
    assert psnr(tiny.images, full) > PSNR_FLOOR


def test_generate_cli_decoder_tiny_on_shipped(tmp_path):
    from PIL import Image

    out = tmp_path / "tiny.png"
    proc = run_cli_here("generate", SHIPPED, "a yellow star at the top", "--decoder", "tiny", "--steps", "4", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert np.asarray(Image.open(out)).shape == (64, 64, 3)


def test_serve_previews_use_the_tiny_decoder(with_tiny, tiny_onnx):
    """serve's progress previews decode with the folder's tiny decoder when it has one, the VAE otherwise."""
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.serve.jobs import JobQueue

    for folder, want in ((with_tiny, "tiny"), (tiny_onnx, "full")):
        pipe = Pipeline.from_folder(folder)
        used = []
        decode = pipe.decode
        pipe.decode = lambda x, *a, decoder="full", **k: used.append(decoder) or decode(x, *a, decoder=decoder, **k)
        png = JobQueue._preview(pipe, np.zeros(pipe.latent_shape_for(1), np.float32))
        assert png.startswith(b"\x89PNG") and used == [want]
