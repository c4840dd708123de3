"""Tiny GGUF backbone files written with the `gguf` package (export/gguf_writer.write_gguf, the way ComfyUI-GGUF
writes them: the 2-D weights whose rows split into 32-blocks quantized, everything else F32), and the
diffusers-from-GGUF oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onnxdiffusion.export.gguf_writer import write_gguf  # noqa: F401 (the tests' tiny files: the one writer)


def state_dict_arrays(folder: Path, subfolder: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted((folder / subfolder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def diffusers_from_gguf(cls_name: str, path: Path, base: Path, subfolder: str = "transformer"):
    """diffusers' own GGUF loading (from_single_file + GGUFQuantizationConfig, fp32 compute): the parity oracle."""
    import diffusers
    import torch
    from diffusers import GGUFQuantizationConfig

    cls = getattr(diffusers, cls_name)
    return cls.from_single_file(str(path), config=str(base), subfolder=subfolder, local_files_only=True,
                                quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
                                torch_dtype=torch.float32).eval()


def zimage_original_names(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """diffusers' Z-Image names -> the release's (the converter's inverse), qkv fused again."""
    out: dict[str, np.ndarray] = {}
    for name, a in sd.items():
        if ".attention.to_k." in name or ".attention.to_v." in name:
            continue
        if ".attention.to_q.weight" in name:
            parts = [sd[name.replace("to_q", x)] for x in ("to_q", "to_k", "to_v")]
            name, a = name.replace(".attention.to_q.", ".attention.qkv."), np.concatenate(parts, axis=0)
        for new, old in ((".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
                         (".attention.norm_q.", ".attention.q_norm."), ("all_final_layer.2-1.", "final_layer."),
                         ("all_x_embedder.2-1.", "x_embedder.")):
            name = name.replace(new, old)
        out["model.diffusion_model." + name] = a
    width = sd["all_x_embedder.2-1.weight"].shape[0]
    out["model.diffusion_model.norm_final.weight"] = np.ones(width, np.float32)  # diffusers drops it
    return out
