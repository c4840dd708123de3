"""peer_worker's sd.cpp split sources: once both GGUFs exist the named copies are neither read nor rewritten."""

from __future__ import annotations

import argparse

from onnxdiffusion.bench import peer_worker


def test_converted_split_model_needs_no_named_copies(tmp_path):
    cache = tmp_path / "peers" / "sdcpp-q4_K"
    cache.mkdir(parents=True)
    for part in ("diffusion", "llm"):
        (cache / f"{part}-q4_K.gguf").write_bytes(b"GGUF")
    folder = tmp_path / "diffusers"  # no weights at all: a rewrite would fail here
    files = peer_worker._split_sources(argparse.Namespace(folder=str(folder), cache=str(cache), mode="q4_K"))
    assert files["src"] == {"vae": folder / "vae" / "diffusion_pytorch_model.safetensors"}
    assert files["gguf"] == {p: cache / f"{p}-q4_K.gguf" for p in ("diffusion", "llm")}
    assert not (tmp_path / "peers" / "sdcpp-src").exists()


def test_ggml_type_names_are_the_bindings_spelling():
    # stable_diffusion_cpp's GGML_TYPE_MAP keys are lower case ('q4_k'); 'q4_K' raised KeyError at conversion
    assert peer_worker.SDCPP_TYPES["q4_K"] == "q4_k"
    assert all(v == v.lower() for v in peer_worker.SDCPP_TYPES.values())
