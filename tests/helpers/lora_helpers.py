"""Random peft LoRAs for the tiny pipelines, written as diffusers' `save_lora_weights` writes them, and the
diffusers oracle: load_lora_weights + set_adapters on the source pipeline, from our initial latents."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# module names LoRA trainers target (diffusers' training scripts, kohya's attention-block set)
BACKBONE_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                    "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def _randomize(module, seed: int, std: float) -> None:
    """lora_B (peft zero-initializes it) and lora_A drawn at `std`, so the LoRA visibly changes the image."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def make_lora(src: Path, out: Path, seed: int, rank: int = 4, alpha: float | None = None, text: bool = False,
              std: float = 0.15) -> Path:
    """A random LoRA over the backbone (and, with `text`, every text encoder) of the diffusers folder `src`."""
    import torch
    from diffusers import DiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    pipe = DiffusionPipeline.from_pretrained(src, local_files_only=True)
    backbone_name = "unet" if hasattr(pipe, "unet") and pipe.unet is not None else "transformer"
    backbone = getattr(pipe, backbone_name)
    names = {n.split(".")[-1] for n, _ in backbone.named_modules()} | {".".join(n.split(".")[-2:]) for n, _ in backbone.named_modules()}
    cfg = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=[t for t in BACKBONE_TARGETS if t in names],
                     init_lora_weights=False)
    backbone.add_adapter(cfg)
    _randomize(backbone, seed, std)
    layers = {f"{backbone_name}_lora_layers": get_peft_model_state_dict(backbone)}
    meta = {f"{backbone_name}_lora_adapter_metadata": cfg.to_dict()}
    if text:
        for te in ("text_encoder", "text_encoder_2"):
            enc = getattr(pipe, te, None)
            if enc is None or te == "text_encoder_2" and "text_encoder_2_lora_layers" not in _save_args(pipe):
                continue
            tcfg = LoraConfig(r=2, lora_alpha=4, target_modules=TEXT_TARGETS, init_lora_weights=False)
            enc.add_adapter(tcfg)
            _randomize(enc, seed + 1, std)
            layers[f"{te}_lora_layers"] = get_peft_model_state_dict(enc)
            meta[f"{te}_lora_adapter_metadata"] = tcfg.to_dict()
    out.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(out, **layers, **meta, safe_serialization=True)
    return out / "pytorch_lora_weights.safetensors"


def _save_args(pipe) -> set[str]:
    import inspect

    return set(inspect.signature(type(pipe).save_lora_weights).parameters)


def diffusers_lora_images(folder: Path, loras: list[tuple[Path, float]], prompt, latents: np.ndarray, steps: int,
                          guidance: float, size: tuple[int, int], fuse: bool = False, **call) -> np.ndarray:
    """The diffusers pipeline with `loras` loaded and weighted by set_adapters, from our latents, as uint8."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    names = [f"l{i}" for i in range(len(loras))]
    for name, (path, _) in zip(names, loras):
        pipe.load_lora_weights(str(Path(path).parent), weight_name=Path(path).name, adapter_name=name)
    pipe.set_adapters(names, [w for _, w in loras])
    h, w = size
    out = pipe(prompt, latents=torch.from_numpy(latents), num_inference_steps=steps, guidance_scale=guidance,
               output_type="np", height=h, width=w, **call).images
    return (out * 255).round().astype(np.uint8)


def random_lora(folder: Path, out: Path, seed: int, rank: int = 4, std: float = 0.15,
                components: tuple[str, ...] | None = None) -> Path:
    """A random peft-layout LoRA over every insertion point of `folder` (a `lora points` folder), numpy alone:
    cheap enough for tests that need adapter files but not diffusers' oracle."""
    from onnxdiffusion.adapters import safetensors_io
    from onnxdiffusion.adapters.points import targets_from_manifest
    from onnxdiffusion.folder.artifacts import read_manifest

    rng = np.random.default_rng(seed)
    tensors = {}
    for comp, info in read_manifest(folder)["components"].items():
        if not info.get("lora") or components is not None and comp not in components:
            continue
        for module, t in sorted(targets_from_manifest(info).items()):
            kernel = tuple(t.kernel) if t.op == "conv" else ()
            tensors[f"{comp}.{module}.lora_A.weight"] = (rng.standard_normal((rank, t.in_features, *kernel)) * std).astype(np.float32)
            tensors[f"{comp}.{module}.lora_B.weight"] = (rng.standard_normal((t.out_features, rank, *((1, 1) if kernel else ()))) * std).astype(np.float32)
    safetensors_io.write(out, tensors)
    return out


def run_whole_graph(session, pipe, host, prompt: str, negative: str, steps: int, guidance: float,
                    extra: dict | None = None):
    """A `--whole` sampling graph (token ids in, uint8 image out) run by onnxruntime alone from `host`'s initial
    latents, with the pipeline's own sampler table and size conditioning. The graph encodes the negative prompt's
    ids: give `host` the same negative (SDXL's absent negative is all-zero embeddings, not the empty prompt's)."""
    from onnxdiffusion.runtime.pipeline import GenerateOptions

    names = {i.name for i in session.get_inputs()} | {i.name for i in session.get_overridable_initializers()}
    batch, (h, w) = host.init_latents.shape[0], host.images.shape[1:3]
    table = pipe.table(GenerateOptions(steps=steps, height=h, width=w))
    feeds = {"latents": host.init_latents, "table": table.rows, "init_scale": np.array(table.init_scale, np.float32),
             "guidance": np.array(max(guidance, 1.0), np.float32), "steps": np.array(steps, np.int64),
             "noise": np.zeros((1, *host.init_latents.shape), np.float32)}
    for slot in pipe.slots:
        suffix = slot.name[len("text_encoder"):]
        feeds[f"input_ids{suffix}"] = pipe.tokenizers[slot.name]([prompt] * batch)
        feeds[f"uncond_input_ids{suffix}"] = pipe.tokenizers[slot.name]([negative] * batch)
    size = pipe.family.size_conditioning(pipe.info, batch, h, w)
    embedded = pipe.family.guidance_input_for(pipe.info)
    if embedded is not None:  # guidance-distilled: the scale is a backbone input, no CFG batch
        size[embedded] = np.full((batch,), guidance, np.float32)
    for key, value in size.items():
        feeds[f"cond_{key}"] = feeds[f"uncond_{key}"] = value
    if "grid_rows" in names:
        f = 2 * int(pipe.info["vae_scale_factor"])
        feeds["grid_rows"], feeds["grid_cols"] = np.array(h // f, np.int64), np.array(w // f, np.int64)
    feeds.update(extra or {})
    return session.run(["image"], {k: v for k, v in feeds.items() if k in names})[0]
