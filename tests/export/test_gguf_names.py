"""A family's GGUF names (families/gguf_names.py) against diffusers' single-file converters: a tiny Z-Image
backbone written under the original release's names (fused qkv, `out`, q_norm/k_norm, the final norm diffusers
drops, the ComfyUI prefix) and read back by export's builder computes what diffusers' own GGUF loading computes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from onnxdiffusion.export.gguf_backbone import build_backbone
from onnxdiffusion.export.gguf_file import read_gguf
from onnxdiffusion.families.gguf_names import Z_IMAGE

from gguf_files import diffusers_from_gguf, write_gguf, zimage_original_names

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_z_image_names_match_diffusers_single_file(tmp_path, qtype):
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(in_channels=16, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                     cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32]).eval()
    model.save_pretrained(tmp_path / "transformer")
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    path = write_gguf(tmp_path / "z.gguf", zimage_original_names(sd), qtype, "lumina2")
    ours, report = build_backbone(read_gguf(path), SimpleNamespace(name="zimage", gguf_names=Z_IMAGE),
                                  "ZImageTransformer2DModel", tmp_path / "transformer")
    assert (report["exact"] > 0) == (qtype != "F32") and report["architecture"] == "lumina2"
    ref = diffusers_from_gguf("ZImageTransformer2DModel", path, tmp_path)
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(16, 1, 8, 8, generator=g)]
    cap = [torch.randn(7, 32, generator=g)]
    t = torch.tensor([0.3])
    with torch.no_grad():
        want = ref(x, t, cap, return_dict=False)[0][0]
        got = ours(x, t, cap, return_dict=False)[0][0]
    snr = 10 * torch.log10(want.pow(2).mean() / (want - got).pow(2).mean())
    # not bit-equal: diffusers' dequantize_gguf_tensor multiplies scale and quant in fp16 (dtype=None), ours in fp32
    # (the exact product); an F32 file of the same names reads back identical (inf dB)
    assert snr >= 60, float(snr)
