"""Does diffusers 0.39 read a Flux pipeline written in the ComfyUI all-in-one layout (BFL transformer keys, vae.*,
text_encoders.clip_l / t5xxl)? Three checks, each comparing every tensor diffusers loads with the source's:

  1. the tiny random Flux of tests/ as is (inner width 32);
  2. the same file through diffusers' own converter with one change: the width read from the file, not 3072;
  3. a real-width transformer (3072 = 24 heads x 128, one double and one single block, ~520M parameters) with the
     tiny VAE and text encoders, as is;
  4. (--export) that real-width pipeline's round trip: `export` of the file (--config the folder) against `export`
     of the folder, PSNR of the 32x32 images (4 steps).

    PYTHONPATH=src python experiments/single_file/flux_width.py WORK [--export]   (~8 GB; --export ~14 GB)
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(ROOT / "models" / "training")]


def compare(src: Path, ckpt: Path) -> str:
    import torch
    from diffusers import FluxPipeline

    a = FluxPipeline.from_pretrained(src, local_files_only=True)
    try:
        b = FluxPipeline.from_single_file(str(ckpt), config=str(src), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - the finding is the error itself
        return f"not read: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    diffs = []
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        bad = [k for k in sa if k not in sb or sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k])]
        diffs.append(f"{name} {len(sa) - len(bad)}/{len(sa)} identical")
    return "read: " + ", ".join(diffs)


def width_from_file():
    """diffusers' Flux converter with `inner_dim = 3072` replaced by the width of img_in in the file."""
    import diffusers.loaders.single_file_model as model
    import diffusers.loaders.single_file_utils as utils

    code = textwrap.dedent(inspect.getsource(utils.convert_flux_transformer_checkpoint_to_diffusers))
    assert "inner_dim = 3072" in code
    code = code.replace("inner_dim = 3072", "inner_dim = checkpoint['img_in.weight'].shape[0]")
    scope: dict = {}
    exec(code, utils.__dict__, scope)  # noqa: S102 - diffusers' own source, one constant changed
    original = model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"]["checkpoint_mapping_fn"]
    model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"]["checkpoint_mapping_fn"] = scope[
        "convert_flux_transformer_checkpoint_to_diffusers"]
    return lambda: model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"].update(checkpoint_mapping_fn=original)


def real_width(tiny: Path, out: Path) -> Path:
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    pipe = FluxPipeline.from_pretrained(tiny, local_files_only=True)
    pipe.transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    from single_file_layout import write_flux_single_file
    from tiny_families import build_tiny_flux

    work = Path(sys.argv[1])
    tiny = build_tiny_flux(work / "tiny")
    ckpt = write_flux_single_file(tiny, work / "tiny-flux.safetensors")
    print("1. tiny Flux, as is:", compare(tiny, ckpt), flush=True)
    restore = width_from_file()
    print("2. tiny Flux, width from the file:", compare(tiny, ckpt), flush=True)
    restore()
    big = real_width(tiny, work / "wide")
    ckpt = write_flux_single_file(big, work / "wide-flux.safetensors")
    print("3. real-width transformer, as is:", compare(big, ckpt), flush=True)
    if "--export" in sys.argv:
        print(f"4. real-width round trip: {round_trip(big, ckpt, work):.1f} dB", flush=True)


def round_trip(folder: Path, ckpt: Path, work: Path) -> float:
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.export.single_file import export_checkpoint
    from onnxdiffusion.runtime import Pipeline

    options = ExportOptions(components=("text_encoder", "text_encoder_2", "transformer", "vae_decoder"), default_size=32)
    export_pipeline(folder, work / "from_folder", options, progress=False)
    export_checkpoint(ckpt, work / "from_ckpt", options, config=folder, family="flux", progress=False)
    kw = dict(steps=4, guidance=3.5, seed=2, height=32, width=32)
    ours = Pipeline.from_folder(work / "from_ckpt")("a red circle on the left", **kw)
    ref = Pipeline.from_folder(work / "from_folder")("a red circle on the left", **kw)
    return psnr(ours.images, ref.images)


if __name__ == "__main__":
    main()
