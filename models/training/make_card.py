"""Write the embedded model's card: data, architecture, parameter counts, training time, losses, samples.

Usage: python models/training/make_card.py --work runs/shapes-sd --model models/shapes-sd
          --onnx models/shapes-sd-onnx --eval models/shapes-sd/eval.json
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from onnxdiffusion.evaluate import scenes as S  # noqa: E402
from onnxdiffusion.folder.imageio import image_grid, save_images  # noqa: E402


def param_count(folder: Path) -> int:
    return sum(int(np.prod(v.shape)) for f in folder.glob("*.safetensors") for v in load_file(f).values())


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def smooth(v: np.ndarray, k: int = 20) -> np.ndarray:
    if len(v) < k:
        return v
    return np.convolve(v, np.ones(k) / k, mode="valid")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/shapes-sd")
    ap.add_argument("--model", default="models/shapes-sd")
    ap.add_argument("--onnx", default="models/shapes-sd-onnx")
    ap.add_argument("--eval", default=None, help="evaluate JSON to quote")
    ap.add_argument("--config", default="models/training/configs/shapes-sd.json")
    args = ap.parse_args()
    work, model = Path(args.work), Path(args.model)
    cfg = json.loads(Path(args.config).read_text())

    logs_dir = model / "training"
    logs_dir.mkdir(exist_ok=True)
    vae_log, unet_log = read_log(work / "vae_log.jsonl"), read_log(work / "unet_log.jsonl")
    parse_log = read_log(work / "parse_log.jsonl")
    for name in ("vae_log.jsonl", "unet_log.jsonl", "parse_log.jsonl"):
        if (work / name).exists():
            shutil.copy2(work / name, logs_dir / name)
    shutil.copy2(args.config, logs_dir / "config.json")

    fig, axes = plt.subplots(1, 3 if parse_log else 2, figsize=(15 if parse_log else 10, 3.6))
    if vae_log:
        s = np.array([r["step"] for r in vae_log])
        axes[0].plot(s, [r["rec"] for r in vae_log], alpha=0.3, color="C0")
        axes[0].plot(s[len(s) - len(smooth(np.array([r["rec"] for r in vae_log]))):],
                     smooth(np.array([r["rec"] for r in vae_log])), color="C0")
        axes[0].set(title="VAE reconstruction loss", xlabel="step", ylabel="MSE + 0.5 L1 (pixels in [-1, 1])", yscale="log")
    if unet_log:
        s = np.array([r["step"] for r in unet_log])
        v = np.array([r["loss"] for r in unet_log])
        axes[1].plot(s, v, alpha=0.3, color="C1")
        axes[1].plot(s[len(s) - len(smooth(v)):], smooth(v), color="C1")
        axes[1].set(title="UNet + text encoder denoising loss", xlabel="step", ylabel="epsilon MSE")
    if parse_log:
        s = np.array([r["step"] for r in parse_log])
        axes[2].plot(s, [r["parse_loss"] for r in parse_log], color="C2", label="parse loss")
        ax2 = axes[2].twinx()
        ax2.plot(s, [r["parse_acc"] for r in parse_log], color="C3", label="all slots right")
        ax2.set_ylabel("batch accuracy (every slot)")
        axes[2].set(title="text encoder pre-training: caption -> slots", xlabel="step", ylabel="cross-entropy", yscale="log")
    fig.tight_layout()
    fig.savefig(model / "loss.png", dpi=110)

    # sample grid: held-out prompts (never seen in training), fp32 ONNX pipeline, DDIM 20 steps
    from onnxdiffusion.evaluate.run import EvaluateOptions, generate_set, heldout_scenes
    from onnxdiffusion.runtime import Pipeline

    ev = json.loads(Path(args.eval).read_text()) if args.eval else None
    guidance = ev["options"]["guidance"] if ev else 4.0
    opts = EvaluateOptions(count=32, guidance=guidance, batch=32)
    scenes = heldout_scenes(opts)
    images = generate_set(Pipeline.from_folder(args.onnx), scenes, opts, progress=False)
    real = np.stack([S.render(sc) for sc in scenes])
    rows = []
    for i in range(0, 32, 8):  # real row, generated row
        rows += [real[i : i + 8], images[i : i + 8]]
    grid = image_grid(np.concatenate(rows), 8)
    big = np.kron(grid, np.ones((2, 2, 1), np.uint8))
    save_images(big[None], model / "samples.png")
    captions = [sc.caption for sc in scenes]

    counts = {c: param_count(model / c) for c in ("unet", "text_encoder", "vae")}
    vae_t = json.loads((work / "vae_time.json").read_text()) if (work / "vae_time.json").exists() else {}
    unet_time = unet_log[-1]["time"] if unet_log else None
    size = sum(p.stat().st_size for p in model.rglob("*") if p.is_file() and p.suffix == ".safetensors")
    lines = [
        "# shapes-sd: the embedded text-to-image model",
        "",
        "A small but genuine Stable-Diffusion-style latent diffusion pipeline (`StableDiffusionPipeline`",
        "layout: `CLIPTextModel` + `CLIPTokenizer`, `UNet2DConditionModel` with cross attention, `AutoencoderKL`,",
        "DDIM scheduler config), trained from scratch on CPU by `models/training/train_pipeline.py`.",
        "",
        "## Data",
        "`onnxdiffusion.evaluate.scenes`: deterministic, seeded 64x64 RGB scenes of one object (50%) or two objects",
        f"(left/right or top/bottom), shapes {', '.join(S.SHAPES)}; colours {', '.join(S.COLOUR_NAMES)};",
        f"positions {', '.join(S.POSITION_NAMES)}; sizes {', '.join(S.SIZE_NAMES)}; plain or two-tone dark backgrounds.",
        "Captions from varied templates (\"a small red circle at the top\", \"a blue star left of a yellow square\").",
        "Splits are by composition (colour-shape-position of every object): held-out 15% (evaluation, never",
        "trained on), calibration 10% (quantization), train 75%.",
        "",
        "## Architecture and parameters",
        "| component | parameters | config |",
        "|---|---|---|",
        f"| UNet | {counts['unet']:,} | channels {cfg['unet']['block_out_channels']}, blocks {cfg['unet']['down_block_types']}, "
        f"{cfg['unet']['layers_per_block']} layer(s) per block, cross-attention dim {cfg['text_encoder']['hidden_size']} |",
        f"| text encoder | {counts['text_encoder']:,} | CLIP, {cfg['text_encoder']['num_hidden_layers']} layers, width "
        f"{cfg['text_encoder']['hidden_size']}, {cfg['model_max_length']} tokens, one token per caption word |",
        f"| VAE | {counts['vae']:,} | channels {cfg['vae']['block_out_channels']}, 64x64x3 -> 16x16x4, scaling factor "
        f"{vae_t.get('scaling_factor', float('nan')):.4f} |",
        "",
        f"Weights on disk (safetensors): {size / 1e6:.1f} MB in float32, stored in float16 ({size / 2e6:.1f} MB) by "
        "to_fp16.py after the export; the ONNX copy keeps float32.",
        "",
        "## Training (2 CPU cores)",
        f"- VAE: {cfg['vae']['steps']} steps x batch {cfg['vae']['batch_size']}, {cfg['vae'].get('threads', cfg['threads'])} thread(s), {vae_t.get('seconds', 0) / 60:.0f} min;"
        f" final reconstruction loss {vae_log[-1]['rec']:.4f}." if vae_log else "- VAE: (no log)",
        (f"- Text encoder pre-training: {cfg['text_parse']['steps']} steps x batch {cfg['text_parse']['batch_size']} on a"
         " parse loss (a linear head on the end-of-text state names every slot's shape, colour and size;"
         " sizes ignored where the caption omits them), final batch accuracy"
         f" {parse_log[-1]['parse_acc']:.3f}. Why: CLIP's causal mask hides the relation word from the first"
         " object's tokens, and the denoising loss alone left layouts random for \"above\" vs \"left of\"."
         " The parse loss stays on (weight"
         f" {cfg['text_parse']['weight']}) during the joint stage; the head is not shipped.") if parse_log and "text_parse" in cfg else "",
        f"- UNet + text encoder jointly (denoising loss, 10% empty captions for guidance, EMA 0.999,"
        f" {cfg['unet'].get('threads', cfg['threads'])} thread(s)):"
        f" {unet_log[-1]['step'] + 1 if unet_log else 0} steps x batch {cfg['unet']['batch_size']} on"
        f" {cfg['unet']['num_scenes']:,} scenes, {unet_time / 60 if unet_time else 0:.0f} min;"
        f" final loss {np.mean([r['loss'] for r in unet_log[-20:]]):.4f} (mean of the last 20 logged)." if unet_log else "",
        "- Seeded; `make model` retrains from scratch. Loss curves: `loss.png`, logs in `training/`.",
        "",
        "![losses](loss.png)",
        "",
        "## Samples",
        f"Held-out prompts (compositions never seen in training), fp32 ONNX pipeline, DDIM 20 steps, guidance {guidance}."
        " Rows alternate: real generator image, generated image for the same caption.",
        "",
        "![samples](samples.png)",
        "",
        "Captions, row by row: " + "; ".join(f"{i}: {c}" for i, c in enumerate(captions)),
        "",
    ]
    if ev:
        lines += [
            "## Evaluation (`onnxdiffusion evaluate`)",
            f"{ev['count']} held-out prompt-seed pairs, {ev['options']['sampler']} {ev['options']['steps']} steps,"
            f" guidance {ev['options']['guidance']}:",
            "",
            "| attribute accuracy | strict accuracy | shape | colour | position | size | Fréchet distance |",
            "|---|---|---|---|---|---|---|",
            f"| {ev['attribute_accuracy']:.3f} | {ev['strict_accuracy']:.3f} | {ev['shape_accuracy']:.3f} |"
            f" {ev['colour_accuracy']:.3f} | {ev['position_accuracy']:.3f} | {ev['size_accuracy']:.3f} |"
            f" {ev['frechet_distance']:.2f} |",
            "",
        ]
    (model / "README.md").write_text("\n".join(lines))
    print("wrote", model / "README.md")


if __name__ == "__main__":
    main()
