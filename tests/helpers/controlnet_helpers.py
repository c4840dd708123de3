"""Tiny ControlNets for the tests: `ControlNetModel.from_unet` of a tiny pipeline's UNet, its zero convolutions
(and the conditioning embedding's last conv) given random non-zero weights, so the nets move the image."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def build_tiny_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, embedding=(8, 16, 16), std: float = 0.3) -> Path:
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(pipeline_dir / "unet", local_files_only=True)
    torch.manual_seed(seed)
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=tuple(embedding))
    with torch.no_grad():
        zero_convs = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
        for conv in zero_convs:
            conv.weight.normal_(0.0, std)
            conv.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out


def control_image(size: int, seed: int = 0) -> np.ndarray:
    """An (H, W, 3) uint8 picture: a few bright rectangles on black, like an edge or position map."""
    rng = np.random.default_rng(seed)
    img = np.zeros((size, size, 3), np.uint8)
    for _ in range(3):
        y, x = rng.integers(0, size - size // 4, 2)
        img[y:y + size // 4, x:x + size // 3] = rng.integers(128, 256, 3)
    return img


def build_tiny_sd3_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, layers: int = 1, std: float = 0.3,
                              zero_pooled: bool = True) -> Path:
    """`SD3ControlNetModel.from_transformer` of a tiny SD3 pipeline's transformer, its zero-initialised
    controlnet_blocks and control-latent patch embedding given random non-zero weights."""
    import torch
    from diffusers import SD3ControlNetModel, SD3Transformer2DModel

    tr = SD3Transformer2DModel.from_pretrained(pipeline_dir / "transformer", local_files_only=True)
    torch.manual_seed(seed)
    net = SD3ControlNetModel.from_transformer(tr, num_layers=layers, num_extra_conditioning_channels=0)
    if not zero_pooled:
        net.register_to_config(force_zeros_for_pooled_projection=False)
    with torch.no_grad():
        for lin in [*net.controlnet_blocks, net.pos_embed_input.proj]:
            lin.weight.normal_(0.0, std)
            lin.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_flux_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, layers: int = 1, single_layers: int = 1,
                               std: float = 0.3) -> Path:
    """`FluxControlNetModel.from_transformer` of a tiny Flux pipeline's transformer, its zero-initialised
    controlnet_blocks, controlnet_single_blocks and control-latent embedder given random non-zero weights."""
    import torch
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    tr = FluxTransformer2DModel.from_pretrained(pipeline_dir / "transformer", local_files_only=True)
    torch.manual_seed(seed)
    net = FluxControlNetModel.from_transformer(tr, num_layers=layers, num_single_layers=single_layers,
                                               attention_head_dim=tr.config.attention_head_dim,
                                               num_attention_heads=tr.config.num_attention_heads)
    with torch.no_grad():
        for lin in [*net.controlnet_blocks, *net.controlnet_single_blocks, net.controlnet_x_embedder]:
            lin.weight.normal_(0.0, std)
            lin.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_qwen_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, layers: int = 1, std: float = 0.3) -> Path:
    """`QwenImageControlNetModel.from_transformer` of a tiny Qwen-Image pipeline's transformer, its
    zero-initialised controlnet_blocks and control-latent embedder given random non-zero weights."""
    import torch
    from diffusers import QwenImageControlNetModel, QwenImageTransformer2DModel

    tr = QwenImageTransformer2DModel.from_pretrained(pipeline_dir / "transformer", local_files_only=True)
    torch.manual_seed(seed)
    net = QwenImageControlNetModel.from_transformer(tr, num_layers=layers, attention_head_dim=tr.config.attention_head_dim,
                                                    num_attention_heads=tr.config.num_attention_heads)
    with torch.no_grad():
        for lin in [*net.controlnet_blocks, net.controlnet_x_embedder]:
            lin.weight.normal_(0.0, std)
            lin.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_zimage_controlnet(pipeline_dir: Path, out: Path, seed: int = 0, places=(0, 1), control_in_dim: int = 4,
                                 refiner: str | None = None, refiner_places=None, std: float = 0.3) -> Path:
    """A `ZImageControlNetModel` for a tiny Z-Image pipeline's transformer (its width, heads and refiner count),
    the zero-initialised before_proj / after_proj projections given random non-zero weights."""
    import torch
    from diffusers import ZImageControlNetModel, ZImageTransformer2DModel

    tr = ZImageTransformer2DModel.load_config(pipeline_dir / "transformer")
    torch.manual_seed(seed)
    net = ZImageControlNetModel(
        control_layers_places=list(places), control_refiner_layers_places=None if refiner_places is None else list(
            refiner_places), control_in_dim=control_in_dim, add_control_noise_refiner=refiner, dim=tr["dim"],
        n_refiner_layers=tr["n_refiner_layers"], n_heads=tr["n_heads"], n_kv_heads=tr["n_kv_heads"],
        norm_eps=tr["norm_eps"], qk_norm=tr["qk_norm"])
    with torch.no_grad():
        for name, lin in net.named_modules():
            if name.endswith(("before_proj", "after_proj")):
                lin.weight.normal_(0.0, std)
                lin.bias.normal_(0.0, std * 0.1)
    net.save_pretrained(out, safe_serialization=True)
    return out


# -- the transformer families' ControlNet tests (test_controlnet_{sd3,flux,qwen}.py) share these ----------------

FAMILY_NETS = {  # family: (builder, {net name: its options}); two nets each, of different shapes or settings
    # sd3 "z": InstantX-style (zero pooled projections, control latents unshifted); "s": shifted, real pooled
    "sd3": (build_tiny_sd3_controlnet, {"z": dict(seed=0), "s": dict(seed=1, zero_pooled=False)}),
    # flux "d": one double and one single block; "s": single blocks only, two of them for the transformer's one
    "flux": (build_tiny_flux_controlnet, {"d": dict(seed=0), "s": dict(seed=1, layers=0, single_layers=2)}),
    # qwenimage "one": a single block (its sample joins after both of the transformer's blocks), "two": one per block
    "qwenimage": (build_tiny_qwen_controlnet, {"one": dict(seed=0, layers=1), "two": dict(seed=1, layers=2)}),
    # zimage "all": hints after both main layers (a 1.0 net); "ref": one hint after layer 0, 9 control channels
    # (a 2.0 net: 2 x 4 latent channels + the mask, for the inpainting pipeline; zero-padded for the plain one) and a
    # control noise refiner whose hint enters the net's noise refiner
    "zimage": (build_tiny_zimage_controlnet, {
        "all": dict(seed=0, places=(0, 1)),
        "ref": dict(seed=1, places=(0,), control_in_dim=9, refiner="control_noise_refiner", refiner_places=(0,))}),
}


def family_controlnet_folder(tmp_path_factory, family: str, src: Path, base: Path | None = None,
                             components: tuple[str, ...] | None = None, size: int = 32) -> tuple[Path, dict]:
    """The tiny `family` pipeline at `src` as an ONNX folder with its VAE encoder (the control picture is
    VAE-encoded) and FAMILY_NETS' two nets added: `base` (an exported folder) copied, or `src` exported
    (`components`, default size `size`). Built once per test run and shared by the xdist workers
    (conftest.shared_folder), like the session fixtures. Returns the folder and {net name: diffusers net folder}."""
    from conftest import shared_folder

    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.export.controlnet import add_controlnet

    builder, specs = FAMILY_NETS[family]

    def build(root: Path) -> Path:
        nets = {name: builder(src, root / name, **options) for name, options in specs.items()}
        out = root / "model"
        if base is None:
            export_pipeline(src, out, ExportOptions(components=components, default_size=size), progress=False)
        for i, (name, path) in enumerate(nets.items()):
            if base is not None and i == 0:
                add_controlnet(base, path, name, out=out, backbone=src)
            else:  # (the backbone's diffusers folder: only a net that borrows its layers reads it)
                add_controlnet(out, path, name, backbone=src)
        return out

    out = shared_folder(tmp_path_factory, f"{family}_cn", build)
    return out, {name: out.parent / name for name in specs}


def looped_folder(tmp_path_factory, family: str, folder: Path, controlnets: tuple[str, ...], steps: int) -> Path:
    """`folder` with `controlnets` built into a Loop graph and a `steps`-step unrolled graph, once per test run."""
    from conftest import shared_folder

    from onnxdiffusion.loopgraph.compile import compile_loop

    def build(root: Path) -> Path:
        out = root / "model"
        compile_loop(folder, out, controlnets=controlnets)
        compile_loop(out, out, form="unrolled", steps=steps, controlnets=controlnets)
        return out

    return shared_folder(tmp_path_factory, f"{family}_cn_loop", build)


def diffusers_controlnet_images(pipeline_cls: str, net_cls: str, src: Path, net_dir: Path, image: np.ndarray,
                                latents: np.ndarray, steps: int, output: str = "np", **call) -> np.ndarray:
    """diffusers' `pipeline_cls` with the `net_cls` net at `net_dir`, from our latents and control picture: uint8
    images (output="latent": the final latents). diffusers encodes the control picture with
    `latent_dist.sample()` (a random draw); here it takes the posterior mean, as our host loop does (the
    folder's vae_encoder)."""
    import diffusers
    import torch
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from PIL import Image

    net = getattr(diffusers, net_cls).from_pretrained(net_dir, local_files_only=True)
    pipe = getattr(diffusers, pipeline_cls).from_pretrained(src, controlnet=net, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    original = DiagonalGaussianDistribution.sample
    DiagonalGaussianDistribution.sample = lambda self, generator=None: self.mean
    try:
        out = pipe(control_image=Image.fromarray(image), latents=torch.from_numpy(latents), num_inference_steps=steps,
                   output_type=output, **call).images
    finally:
        DiagonalGaussianDistribution.sample = original
    return out.numpy() if output == "latent" else (out * 255).round().astype(np.uint8)
