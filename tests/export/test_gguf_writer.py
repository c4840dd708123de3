"""export/gguf_writer.py: the one GGUF writer of the tests' tiny files and the memory experiment's backbones
writes the bytes each wrote before it was shared (sha256 of the files the two copies wrote at 776dc1a, gguf 0.19)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the export extra is not installed")

from onnxdiffusion.export.gguf_writer import backbone_as_gguf, write_gguf  # noqa: E402

# tests/helpers/gguf_files.write_gguf's files (a dict of tensors, in its order)
HELPER = {"Q8_0": "c2d5ee41305b45e7d9b5fa9fe5fe1e2cc10753685cb285647a4064ee179645b8",
          "Q4_0": "1ada2019f1c2fd9cb08ae388e5e720f65cc9da03c741c5c5500981b4bd42c55f",
          "F32": "4b02dc706bd7ef32f4afbaf195f6b32af371ee4c0492e31556ad49b773c53d03"}
# experiments/families/gguf_memory.py convert's files (the same tensors from two safetensors shards, streamed)
EXPERIMENT = {"Q8_0": "06e526b6eb76e0fee4fbaf91f3743eadecf3ca34960d8540850be9c99bd1af3a",
              "Q4_0": "5b60412942d37e237911972c581d184b16251139083fbc29dbcbb04c6b2f4d77"}


def _tensors() -> dict[str, np.ndarray]:
    """Quantized (a 2-D weight of 96 columns), F32 (a bias, a 1-D weight, a weight of 48 columns) and an fp16 one."""
    rng = np.random.default_rng(7)
    return {"blocks.0.attn.to_q.weight": rng.standard_normal((64, 96)).astype(np.float32),
            "blocks.0.attn.to_q.bias": rng.standard_normal(64).astype(np.float32),
            "blocks.0.norm.weight": rng.standard_normal(96).astype(np.float32),
            "proj_out.weight": rng.standard_normal((8, 48)).astype(np.float32),
            "img_in.weight": (rng.standard_normal((32, 64)) * 3).astype(np.float16)}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("qtype", sorted(HELPER))
def test_the_tests_files_keep_their_bytes(tmp_path, qtype):
    assert _sha(write_gguf(tmp_path / "t.gguf", _tensors(), qtype, "qwen_image")) == HELPER[qtype]


@pytest.mark.parametrize("qtype", sorted(EXPERIMENT))
def test_the_experiments_backbone_files_keep_their_bytes(tmp_path, qtype):
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    (src / "transformer").mkdir(parents=True)
    (src / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    t = _tensors()
    names = list(t)
    for k, part in enumerate((names[:2], names[2:])):
        save_file({n: t[n] for n in part}, str(src / "transformer" / f"diffusion_pytorch_model-0000{k + 1}-of-00002.safetensors"))
    assert _sha(backbone_as_gguf(src, qtype, tmp_path / "e.gguf")) == EXPERIMENT[qtype]


def test_what_is_quantized(tmp_path):
    """2-D `.weight`s with a multiple of 32 columns; not a bias, a 1-D or narrow weight, nor a 2-D parameter (pad
    tokens)."""
    import gguf

    from onnxdiffusion.export.gguf_file import read_gguf

    tensors = {**_tensors(), "x_pad_token": np.ones((1, 64), np.float32)}
    info = read_gguf(write_gguf(tmp_path / "q.gguf", tensors, "Q8_0", "lumina2"))
    kinds = {name: t.ggml_type for name, t in info.tensors.items()}
    assert kinds["blocks.0.attn.to_q.weight"] == kinds["img_in.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert {kinds[n] for n in ("blocks.0.attn.to_q.bias", "blocks.0.norm.weight", "proj_out.weight", "x_pad_token")} \
        == {gguf.GGMLQuantizationType.F32}
