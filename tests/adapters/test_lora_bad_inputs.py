"""Bad LoRA input (acceptance 5): one line naming the file and key, non-zero exit, nothing written."""

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, invoke
from lora_helpers import make_lora
from onnxdiffusion.adapters import safetensors_io
from onnxdiffusion.adapters.folder import add_points


@pytest.fixture(scope="module")
def points(tiny_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("bad_points") / "model"
    add_points(tiny_onnx, out)
    return out


@pytest.fixture(scope="module")
def good(tiny_diffusers, tmp_path_factory):
    return make_lora(tiny_diffusers, tmp_path_factory.mktemp("good"), seed=5)


def _edited(good, tmp_path, name, edit):
    tensors, meta = safetensors_io.read(good)
    tensors = dict(tensors)
    edit(tensors)
    path = tmp_path / name
    safetensors_io.write(path, tensors, meta)
    return path


Q = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"


def _bad_files(good, tmp_path):
    def wider(t):  # a LoRA for a wider model: the same names, other shapes
        t[f"{Q}.lora_A.weight"] = np.zeros((4, 64), np.float32)

    def unknown(t):
        t["unet.down_blocks.7.attentions.0.to_q.lora_A.weight"] = np.zeros((4, 32), np.float32)
        t["unet.down_blocks.7.attentions.0.to_q.lora_B.weight"] = np.zeros((32, 4), np.float32)

    import torch

    pickle = tmp_path / "model.safetensors"  # a pickle under a safetensors name
    torch.save({"x": torch.zeros(2)}, pickle)
    text = tmp_path / "notes.safetensors"
    text.write_text("this is not a tensor file at all, but long enough to have a header length")
    return {
        "shape": (_edited(good, tmp_path, "wider.safetensors", wider), 1.0, [f"{Q[5:]}", "another model"]),
        "unknown key": (_edited(good, tmp_path, "unknown.safetensors", unknown), 1.0, ["unknown key", "down_blocks.7"]),
        "scale": (good, 4.5, ["scale", "[-4, 4]"]),
        "not safetensors": (text, 1.0, ["not a safetensors file"]),
        "pickle": (pickle, 1.0, ["pickle"]),
    }


CASES = ["shape", "unknown key", "scale", "not safetensors", "pickle"]


@pytest.mark.parametrize("case", CASES)
def test_generate_refuses(points, good, tmp_path, case):
    path, scale, fragments = _bad_files(good, tmp_path)[case]
    out = tmp_path / "img.png"
    proc = invoke("generate", points, "a red circle", "--steps", "2", "--lora", f"{path}:{scale}", "-o", out)
    assert_one_line_error(proc, path.name, *fragments)
    assert not out.exists()


@pytest.mark.parametrize("case", ["shape", "unknown key", "pickle"])
def test_fused_export_refuses(tiny_diffusers, good, tmp_path, case):
    path, scale, fragments = _bad_files(good, tmp_path)[case]
    out = tmp_path / "exported"
    proc = invoke("export", tiny_diffusers, out, "--lora", f"{path}:{scale}", timeout=300)
    assert_one_line_error(proc, path.name)
    assert not out.exists() and not list(tmp_path.glob(".exported*"))


def test_folder_without_points_derives_them_once_and_points_twice_is_one_line(tiny_onnx, points, good, tmp_path):
    """A plain export given a LoRA gets its insertion-points copy derived on first use (said once, issue 45),
    not a refusal; `lora points` on a folder that has them stays a one-line error."""
    out, again = tmp_path / "img.png", tmp_path / "img2.png"
    proc = invoke("generate", tiny_onnx, "a red circle", "--steps", "2", "--lora", str(good), "-o", out)
    assert proc.returncode == 0 and out.exists(), proc.stderr
    assert "no LoRA insertion points; deriving a copy" in proc.stderr, proc.stderr
    proc = invoke("generate", tiny_onnx, "a red circle", "--steps", "2", "--lora", str(good), "-o", again)
    assert proc.returncode == 0 and "deriving" not in proc.stderr, proc.stderr  # the derived copy is found again
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(out)), np.asarray(Image.open(again)))
    proc = invoke("lora", "points", points, tmp_path / "again")
    assert_one_line_error(proc, "already has LoRA insertion points")
    assert not (tmp_path / "again").exists()


def test_generate_with_lora_cli(points, good, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    assert invoke("generate", points, "a red circle", "--steps", "3", "-o", a).returncode == 0
    proc = invoke("generate", points, "a red circle", "--steps", "3", "--lora", f"{good}:0.8", "--lora", f"{good}:-0.3",
                  "-o", b)
    assert proc.returncode == 0, proc.stderr
    from PIL import Image

    assert not np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))


def _meta_edit(good, tmp_path, name, config=None, alpha=None):
    tensors, meta = safetensors_io.read(good)
    tensors, meta = dict(tensors), dict(meta)
    if config is not None:
        meta["lora_adapter_metadata"] = config
    if alpha is not None:
        tensors[f"{Q}.alpha"] = alpha
    path = tmp_path / name
    safetensors_io.write(path, tensors, meta)
    return path


# what bench/fuzz_folders.py --kind adapters found raising past the loader: each is one line naming the file
FOUND = {
    "alpha-empty": ({"alpha": np.zeros((0,), np.float32)}, "an alpha is one finite number"),
    "alpha-nan": ({"alpha": np.array(np.nan, np.float32)}, "an alpha is one finite number"),
    "pattern-not-regex": ({"config": '{"unet.r": 4, "unet.alpha_pattern": {"(": 2}}'}, "is not a pattern"),
    "rank-zero": ({"config": '{"unet.r": 0}'}, "unet.r must be a positive number"),
    "alpha-string": ({"config": '{"unet.r": 4, "unet.lora_alpha": "x"}'}, "unet.lora_alpha must be a number"),
    "alpha-list": ({"config": '{"unet.r": 4, "unet.lora_alpha": [1]}'}, "unet.lora_alpha must be a number"),
    "rslora-int": ({"config": '{"unet.r": 4, "unet.use_rslora": 1}'}, "use_rslora must be true or false"),
    "pattern-not-object": ({"config": '{"unet.r": 4, "unet.rank_pattern": true}'}, "rank_pattern must be an object"),
    "metadata-not-object": ({"config": "[1, 2]"}, "not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(FOUND))
def test_crafted_metadata_and_alphas_are_one_line(good, tmp_path, case):
    from onnxdiffusion.adapters.lora_file import read_lora
    from onnxdiffusion.errors import UserError

    edits, fragment = FOUND[case]
    path = _meta_edit(good, tmp_path, f"{case}.safetensors", **edits)
    with pytest.raises(UserError) as e:
        read_lora(path)
    assert fragment in str(e.value) and path.name in str(e.value) and "\n" not in str(e.value)
