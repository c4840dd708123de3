"""`export`: a local diffusers Stable-Diffusion-family folder -> an ONNX model folder."""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..artifacts import FORMAT_VERSION, MANIFEST, atomic_dir, check_output_folder, hash_tree, write_json
from ..errors import UserError

SUPPORTED_PIPELINES = ("StableDiffusionPipeline",)
OPSET_RANGE = (14, 20)  # attention export needs 14; torch's TorchScript exporter stops at 20
_EXPECTED = {
    "unet": "UNet2DConditionModel",
    "vae": "AutoencoderKL",
    "text_encoder": "CLIPTextModel",
    "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
}


@dataclass(frozen=True)
class ExportOptions:
    opset: int = 17
    validate: bool = True
    overwrite: bool = False
    # diffusers attention -> one ONNX Runtime MultiHeadAttention node (see export/attention.py)
    fuse_attention: bool = True
    components: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder", "vae_encoder")


def _check_source(src: Path) -> dict:
    if not src.exists():
        raise UserError(f"source folder not found: {src}")
    index = src / "model_index.json"
    if not src.is_dir() or not index.is_file():
        raise UserError(f"{src} is not a diffusers pipeline folder (no model_index.json)")
    try:
        mi = json.loads(index.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSON and Unicode errors
        raise UserError(f"{index} is not valid JSON: {str(e).splitlines()[0][:200]}") from None
    except OSError as e:
        raise UserError(f"cannot read {index}: {e.strerror}") from None
    if not isinstance(mi, dict):
        raise UserError(f"{index} must hold a JSON object")
    cls = mi.get("_class_name")
    if cls not in SUPPORTED_PIPELINES:
        raise UserError(f"unsupported pipeline class {cls!r}; supported: {', '.join(SUPPORTED_PIPELINES)}")
    for comp, expected in _EXPECTED.items():
        entry = mi.get(comp)
        name = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        ok = name in expected if isinstance(expected, tuple) else name == expected
        if not ok:
            raise UserError(f"{src}: component '{comp}' is {name!r}, expected {expected}")
        if not (src / comp).is_dir():
            raise UserError(f"{src}: component folder '{comp}' is missing")
    return mi


def _recommended(src: Path) -> dict:
    """Settings the model was evaluated with (eval.json beside the diffusers folder, written by training)."""
    from ..manifest import check_recommended

    try:
        opts = json.loads((src / "eval.json").read_text())["options"]
        rec = {k: opts[k] for k in ("guidance", "steps", "sampler") if k in opts}
        return check_recommended(rec, str(src / "eval.json"))
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return {}


def _versions() -> dict:
    import diffusers
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "onnxdiffusion": __version__,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def export_pipeline(src: Path | str, out: Path | str, options: ExportOptions | None = None, progress: bool = True) -> dict:
    """Export every component of a local diffusers pipeline to ONNX, validate it, write a manifest.

    Returns the manifest. Raises UserError on bad input or a component over its tolerance;
    nothing is left at `out` unless the whole export succeeds.
    """
    options = options or ExportOptions()
    src, out = Path(src), Path(out)
    if isinstance(options.opset, bool) or not isinstance(options.opset, int) \
            or not OPSET_RANGE[0] <= options.opset <= OPSET_RANGE[1]:
        raise UserError(f"--opset must be in [{OPSET_RANGE[0]}, {OPSET_RANGE[1]}], got {options.opset!r}")
    model_index = _check_source(src)
    check_output_folder(out, options.overwrite, inputs=(src,))  # before torch is imported (seconds)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizerFast
    except ImportError as e:
        raise UserError(f"export needs the export extra (pip install 'onnxdiffusion[export]'): {e}") from None

    from tqdm import tqdm

    from .attention import DOMAIN_OP, fuse_attention
    from .components import specs_for
    from .validate import export_component

    t_start = time.time()
    try:
        unet = UNet2DConditionModel.from_pretrained(src / "unet", local_files_only=True).eval()
        vae = AutoencoderKL.from_pretrained(src / "vae", local_files_only=True).eval()
        text_encoder = CLIPTextModel.from_pretrained(src / "text_encoder", local_files_only=True).eval()
        tokenizer = CLIPTokenizerFast.from_pretrained(src / "tokenizer", local_files_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load {src} with diffusers: {first}") from None
    sched_path = src / "scheduler" / "scheduler_config.json"
    if not sched_path.is_file():
        raise UserError(f"{src}: scheduler/scheduler_config.json is missing")
    from ..manifest import check_scheduler_config
    from ..schedules import NoiseSchedule

    try:
        scheduler_config = check_scheduler_config(json.loads(sched_path.read_bytes().decode("utf-8")), str(sched_path))
        NoiseSchedule.from_scheduler_config(scheduler_config)
    except (ValueError, TypeError, RecursionError) as e:
        raise UserError(f"{sched_path}: {str(e).splitlines()[0][:300]}") from None

    vae_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    unet_factor = 2 ** (len(unet.config.block_out_channels) - 1)
    latent_channels = int(unet.config.in_channels)
    hidden = int(text_encoder.config.hidden_size)
    if unet.config.cross_attention_dim != hidden:
        raise UserError(
            f"text encoder width {hidden} does not match the UNet's cross_attention_dim {unet.config.cross_attention_dim}"
        )
    fused = {"unet": fuse_attention(unet), "vae": fuse_attention(vae)} if options.fuse_attention else {}
    specs = specs_for(latent_channels, hidden)
    modules = {"text_encoder": text_encoder, "unet": unet, "vae_decoder": vae, "vae_encoder": vae}
    seq = int(tokenizer.model_max_length)
    lat = min(int(unet.config.sample_size), 32)
    lat -= lat % unet_factor
    lat = max(lat, unet_factor)

    def shapes(name: str) -> list[dict]:
        """Export-time dummy first, then a second, different shape to prove the axes are dynamic."""
        if name == "text_encoder":
            return [{"batch": 2, "seq": seq}, {"batch": 1, "seq": max(2, seq // 2)}]
        return [{"batch": 2, "h": lat, "w": lat}, {"batch": 1, "h": lat, "w": lat + unet_factor}]

    def feeds(name: str, shape: dict, gen: torch.Generator) -> dict:
        b = shape["batch"]
        if name == "text_encoder":
            ids = torch.randint(0, text_encoder.config.vocab_size - 1, (b, shape["seq"]), generator=gen)
            ids[:, -1] = text_encoder.config.vocab_size - 1  # an end token for the pooler
            return {"input_ids": ids.to(torch.int32)}
        h, w = shape["h"], shape["w"]
        if name == "unet":
            return {
                "sample": torch.randn(b, latent_channels, h, w, generator=gen),
                "timestep": torch.linspace(999, 1, b),
                "encoder_hidden_states": torch.randn(b, seq, hidden, generator=gen),
            }
        if name == "vae_decoder":
            return {"latent_sample": torch.randn(b, latent_channels, h, w, generator=gen)}
        return {"sample": torch.rand(b, 3, h * vae_factor, w * vae_factor, generator=gen) * 2 - 1}

    manifest: dict = {
        "format_version": FORMAT_VERSION,
        "source": {"path": str(src.resolve()), "class": model_index["_class_name"]},
        "opset": options.opset,
        "exporter": "torch.onnx.export (TorchScript)",
        "tool_versions": _versions(),
        "attention": ({"fused": True, "op": DOMAIN_OP.replace("::", "."), "modules": fused} if fused
                      else {"fused": False}),
        "pipeline": {
            "prediction_type": scheduler_config.get("prediction_type", "epsilon"),
            "vae_scaling_factor": float(vae.config.scaling_factor),
            "vae_scale_factor": vae_factor,
            "size_multiple": vae_factor * unet_factor,
            "latent_channels": latent_channels,
            "default_height": int(unet.config.sample_size) * vae_factor,
            "default_width": int(unet.config.sample_size) * vae_factor,
            "model_max_length": seq,
            "num_train_timesteps": int(scheduler_config.get("num_train_timesteps", 1000)),
        },
        "components": {},
        "family": "sd",
        "recommended": _recommended(src),
    }
    with atomic_dir(out, overwrite=options.overwrite, inputs=(src,)) as tmp:
        bar = tqdm(options.components, desc="export", disable=not progress)
        for name in bar:
            bar.set_postfix_str(name)
            spec = specs[name]
            gen = torch.Generator().manual_seed(0)
            feed_list = [feeds(name, s, gen) for s in shapes(name)]
            info = export_component(spec, spec.wrap(modules[name]).eval(), feed_list, tmp / name, options)
            info["shapes_validated"] = shapes(name)
            manifest["components"][name] = info
        tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / "scheduler").mkdir()
        shutil.copy2(sched_path, tmp / "scheduler" / "scheduler_config.json")
        for name, cfg_src in (("unet", "unet"), ("text_encoder", "text_encoder"), ("vae_decoder", "vae"), ("vae_encoder", "vae")):
            if (tmp / name).is_dir() and (src / cfg_src / "config.json").is_file():
                shutil.copy2(src / cfg_src / "config.json", tmp / name / "config.json")
        write_json(tmp / "model_index.json", model_index)
        manifest["export_seconds"] = round(time.time() - t_start, 2)
        manifest["files"] = hash_tree(tmp)
        write_json(tmp / MANIFEST, manifest)
    return manifest
