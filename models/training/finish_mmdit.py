"""After `train_mmdit.py`: pick guidance on the calibration split, evaluate 256 held-out pairs, write the card.

The evaluation is `onnxdiffusion evaluate`'s (same scenes, same per-item seeds and initial latents, same
judge and scoring), run on the diffusers folder in PyTorch with flow-match Euler at the model's default
steps; `--onnx FOLDER --onnx-eval JSON` add the exported folder (its manifest) and its `onnxdiffusion evaluate`
numbers to the card. `--card-only` rewrites the card from the existing eval.json (after the export, see
`make model-mmdit`).

Usage: python models/training/finish_mmdit.py CONFIG --work runs/shapes-mmdit --model models/shapes-mmdit
          [--guidance 2 3 4 5 7] [--onnx models/shapes-mmdit-onnx --onnx-eval models/shapes-mmdit/eval_onnx.json]
          [--card-only]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_card import read_log, smooth  # noqa: E402
from train_mmdit import generate_torch  # noqa: E402

from onnxdiffusion.evaluate import scenes as S  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge, score_scenes, summarize  # noqa: E402
from onnxdiffusion.evaluate.run import evaluate_images  # noqa: E402
from onnxdiffusion.folder.imageio import image_grid, save_images  # noqa: E402


def load_pipeline(folder: Path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None, torch_dtype=torch.float32,
                                                    local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def evaluate(pipe, split: str, count: int, guidance: float, steps: int, t5_tokens: int, judge: Judge) -> dict:
    scs = S.scenes(split, count)
    t0 = time.perf_counter()
    images = generate_torch(pipe, [s.caption for s in scs], list(range(count)), steps, guidance, t5_tokens)
    seconds = time.perf_counter() - t0
    r = evaluate_images(images, scs, judge)
    r.update(options={"count": count, "steps": steps, "sampler": "flow_euler", "guidance": guidance, "split": split,
                      "seed_offset": 0, "runtime": "diffusers StableDiffusion3Pipeline (PyTorch, fp32 compute)",
                      "max_sequence_length": t5_tokens},
             generate_seconds=round(seconds, 2))
    return r | {"_images": images}


def pick_guidance(pipe, candidates: list[float], steps: int, t5_tokens: int, judge: Judge) -> tuple[float, list]:
    """Accuracy first on 96 calibration pairs; the Frechet distance breaks ties (as finish.sh does)."""
    rows = []
    for g in candidates:
        r = evaluate(pipe, "calib", 96, g, steps, t5_tokens, judge)
        rows.append({"guidance": g, **{k: r[k] for k in ("attribute_accuracy", "strict_accuracy", "frechet_distance")}})
        print("guidance", g, rows[-1], flush=True)
    best = max(rows, key=lambda r: r["strict_accuracy"] + r["attribute_accuracy"] - 1e-5 * r["frechet_distance"])
    return best["guidance"], rows


def write_plots(work: Path, model: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals, parse = (read_log(work / n) for n in ("train_log.jsonl", "eval_log.jsonl", "parse_log.jsonl"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    s, v = np.array([r["step"] for r in train]), np.array([r["loss"] for r in train])
    axes[0].plot(s, v, alpha=0.3, color="C1")
    axes[0].plot(s[len(s) - len(smooth(v)):], smooth(v), color="C1")
    axes[0].set(title="MMDiT flow-matching loss", xlabel="step", ylabel="velocity MSE")
    for key in sorted({k for r in evals for k in r if k.startswith("g")}):
        es = [r["step"] for r in evals if key in r]
        axes[1].plot(es, [r[key]["attribute_accuracy"] for r in evals if key in r], "o-", label=f"attribute ({key})")
        axes[1].plot(es, [r[key]["strict_accuracy"] for r in evals if key in r], "s--", label=f"strict ({key})")
    axes[1].set(title="held-out judge accuracy during training (EMA)", xlabel="step", ylim=(0, 1.02))
    axes[1].legend(fontsize=7)
    ps = [r["step"] for r in parse]
    axes[2].plot(ps, [r["parse_acc"] for r in parse], color="C3")
    axes[2].set(title="text_encoder_2 parse pre-training", xlabel="step", ylabel="batch accuracy (every slot)")
    fig.tight_layout()
    fig.savefig(model / "loss.png", dpi=100)


def samples(pipe, model: Path, guidance: float, steps: int, t5_tokens: int) -> list[str]:
    scs = S.scenes("heldout", 16)
    gen = generate_torch(pipe, [s.caption for s in scs], list(range(16)), steps, guidance, t5_tokens)
    real = np.stack([S.render(s) for s in scs])
    rows = [np.concatenate([real[i:i + 8], gen[i:i + 8]]) for i in range(0, 16, 8)]
    save_images(image_grid(np.concatenate(rows), 8)[None], model / "samples.png")
    return [s.caption for s in scs]


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def onnx_section(onnx: dict, g: float, o: dict) -> str:
    """The card's section on the exported folder: `onnx` = {"folder", "manifest", "eval"}."""
    m, ev = onnx["manifest"], onnx["eval"]
    folder = Path(onnx["folder"]).as_posix()
    comps = m["components"]
    errs = ", ".join(f"{n} {c['validation']['max_abs_error']:.1e}" for n, c in comps.items() if c.get("validation"))
    mb = sum(c["bytes"] for c in comps.values()) / 1e6
    r = m.get("recommended") or {}
    eo = ev["options"]
    return f"""
## ONNX export
`{folder}` is this folder exported by `onnxdiffusion export models/shapes-mmdit {folder} --skip vae_encoder`:
float32, every joint attention block one ONNX Runtime `MultiHeadAttention` node, {mb:.1f} MB ({', '.join(comps)};
no `vae_encoder`: text-to-image never runs it, and nothing in the run time encodes images). Largest absolute
error vs PyTorch at export: {errs}. Its manifest recommends what this card evaluated ({r.get('sampler')}
{r.get('steps')} steps, guidance {r.get('guidance')}), so `onnxdiffusion generate --model {folder} "a red circle"`
and `onnxdiffusion evaluate {folder}` use them. Images vs the diffusers pipeline from the same latents: >= 40 dB
per image (checked by tests/models/test_mmdit_model.py).

{ev['count']} held-out prompt-seed pairs through ONNX Runtime (`onnxdiffusion evaluate {folder} --count {ev['count']}`,
{eo['sampler']} {eo['steps']} steps, guidance {eo['guidance']}; same pairs, seeds and initial latents as above; `eval_onnx.json`):

| attribute accuracy | strict accuracy | shape | colour | position | size | Fréchet distance |
|---|---|---|---|---|---|---|
| {ev['attribute_accuracy']:.3f} | {ev['strict_accuracy']:.3f} | {ev['shape_accuracy']:.3f} | {ev['colour_accuracy']:.3f} | {ev['position_accuracy']:.3f} | {ev['size_accuracy']:.3f} | {ev['frechet_distance']:.2f} |
"""


def write_card(cfg: dict, work: Path, model: Path, pipe, ev: dict, rows: list, captions: list[str],
               onnx: dict | None) -> None:
    tc, tr = cfg["transformer"], pipe.transformer.config
    train = read_log(work / "train_log.jsonl")
    prog = json.loads((work / "progress.json").read_text())
    last = np.mean([r["loss"] for r in train[-20:]])
    te1, te2 = pipe.text_encoder.config, pipe.text_encoder_2.config
    g, o = ev["options"]["guidance"], ev["options"]
    table = "\n".join(f"| {r['guidance']} | {r['attribute_accuracy']:.3f} | {r['strict_accuracy']:.3f} | "
                      f"{r['frechet_distance']:.1f} |" for r in rows)
    onnx_line = onnx_section(onnx, g, o) if onnx else ""
    text = f"""# shapes-mmdit: an SD3-family text-to-image model (MMDiT, flow matching)

A `StableDiffusion3Pipeline` folder (T5 omitted, as SD3 allows) trained from scratch on CPU by
`models/training/train_mmdit.py` on the same data, splits, judge and evaluation as `shapes-sd`
(data: see `models/shapes-sd/README.md`). `make model-mmdit` retrains it.

## Architecture and parameters
| component | parameters | config |
|---|---|---|
| transformer (`SD3Transformer2DModel`) | {params(pipe.transformer):,} | {tr.num_layers} joint blocks, width {tr.num_attention_heads * tr.attention_head_dim} ({tr.num_attention_heads} heads x {tr.attention_head_dim}), patch {tr.patch_size} on {tr.sample_size}x{tr.sample_size}x{tr.in_channels} latents = {(tr.sample_size // tr.patch_size) ** 2} image tokens, joint_attention_dim {tr.joint_attention_dim}, pooled_projection_dim {tr.pooled_projection_dim}, no qk-norm |
| text_encoder (`CLIPTextModelWithProjection`) | {params(pipe.text_encoder):,} | shapes-sd's parse-trained CLIP (frozen), width {te1.hidden_size}, {te1.num_hidden_layers} layers, identity projection |
| text_encoder_2 (`CLIPTextModelWithProjection`) | {params(pipe.text_encoder_2):,} | width {te2.hidden_size}, {te2.num_hidden_layers} layers, projection {te2.projection_dim}, parse-trained here (frozen) |
| VAE (`AutoencoderKL`) | {params(pipe.vae):,} | shapes-sd's VAE (frozen), scaling factor {pipe.vae.config.scaling_factor:.4f}, shift factor {pipe.vae.config.shift_factor:.4f} (measured) |

Prompt: penultimate states of both CLIP encoders side by side ({te1.hidden_size} + {te2.hidden_size} = {tr.joint_attention_dim}),
then {cfg['t5_tokens']} zero tokens where T5 would be (`max_sequence_length`, diffusers' default); pooled = both projections.
Weights on disk: float16 safetensors, {folder_mb(model):.1f} MB, evaluated as stored (training used the
float16-rounded VAE and text encoders; the transformer is rounded after training and its rounding is inside the numbers below).

## Training (2 CPU cores, {cfg['threads']} torch threads)
- text_encoder_2: {cfg['text_parse']['steps']} steps x batch {cfg['text_parse']['batch_size']} on the shapes-sd parse loss (a linear head on the projected pooled state names every slot).
- transformer: rectified flow as SD3 trains it (x_t = (1 - s) x0 + s noise, velocity target noise - x0, s logit-normal
  ({tc['logit_mean']}, {tc['logit_std']})), {tc['uncond_prob']:.0%} empty captions for guidance, AdamW lr {tc['lr']} (constant after {tc['warmup']} warm-up steps, then a cosine to 0 from step {tc['decay_start']} of {tc['steps']}; the run stops at step {tc.get('stop_at', tc['steps'])}), EMA {tc['ema_decay']}:
  {prog['step']} steps x batch {tc['batch_size']} on {tc['num_scenes']:,} scenes, {prog['seconds'] / 60:.0f} min; final loss {last:.4f} (mean of the last 20 logged).
  The {cfg['t5_tokens']} identical zero tokens are trained as one token whose attention logit carries log({cfg['t5_tokens']}) (exact: identical keys and values).
- Seeded; logs in `training/`, curves in `loss.png` (middle: held-out judge accuracy of the EMA weights during training).

![training](loss.png)

## Samples
Held-out prompts, flow-match Euler {o['steps']} steps, guidance {g}. Rows: 8 real generator images, then the 8 generated for the same captions (twice).

![samples](samples.png)

Captions: {'; '.join(f'{i}: {c}' for i, c in enumerate(captions))}

## Evaluation
Guidance picked on 96 calibration-split pairs (accuracy first, Fréchet distance breaks ties):

| guidance | attribute | strict | FD |
|---|---|---|---|
{table}

{o['count']} held-out prompt-seed pairs, flow-match Euler {o['steps']} steps, guidance {g}, diffusers pipeline (PyTorch):

| attribute accuracy | strict accuracy | shape | colour | position | size | Fréchet distance |
|---|---|---|---|---|---|---|
| {ev['attribute_accuracy']:.3f} | {ev['strict_accuracy']:.3f} | {ev['shape_accuracy']:.3f} | {ev['colour_accuracy']:.3f} | {ev['position_accuracy']:.3f} | {ev['size_accuracy']:.3f} | {ev['frechet_distance']:.2f} |
{onnx_line}"""
    (model / "README.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--guidance", type=float, nargs="+", default=[2.0, 3.0, 4.0, 5.0, 7.0])
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--onnx", default=None, help="the exported folder (its manifest is quoted)")
    ap.add_argument("--onnx-eval", default=None, help="an `onnxdiffusion evaluate` JSON of the exported folder to quote")
    ap.add_argument("--card-only", action="store_true", help="rewrite the card from the existing eval.json")
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    torch.set_num_threads(cfg["threads"])
    work, model = Path(args.work), Path(args.model)
    steps, t5 = cfg["sampling"]["steps"], cfg["t5_tokens"]
    pipe, judge = load_pipeline(model), Judge.from_file(threads=1)
    onnx = None
    if args.onnx and args.onnx_eval:
        onnx = {"folder": args.onnx, "manifest": json.loads((Path(args.onnx) / "manifest.json").read_text()),
                "eval": json.loads(Path(args.onnx_eval).read_text())}
    if args.card_only:
        if not (work / "train_log.jsonl").is_file():  # no training run here: the logs the card ships with
            work = model / "training"
        ev = json.loads((model / "eval.json").read_text())
        g = ev["options"]["guidance"]
        captions = [s.caption for s in S.scenes("heldout", 16)]  # samples.png's, left as it is
        write_card(cfg, work, model, pipe, ev, ev["guidance_search"], captions, onnx)
        print("wrote", model / "README.md")
        return
    g, rows = pick_guidance(pipe, args.guidance, steps, t5, judge)
    ev = evaluate(pipe, "heldout", args.count, g, steps, t5, judge)
    images = ev.pop("_images")
    real = np.stack([S.render(s) for s in S.scenes("heldout", args.count)])
    ev["real_images_check"] = summarize(score_scenes(S.scenes("heldout", args.count), judge.predict(real)))
    ev["model"] = model.as_posix()
    ev["guidance_search"] = rows
    (model / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    print(json.dumps({k: ev[k] for k in ("attribute_accuracy", "strict_accuracy", "frechet_distance")}), flush=True)
    del images
    logs = model / "training"
    logs.mkdir(exist_ok=True)
    for name in ("train_log.jsonl", "eval_log.jsonl", "parse_log.jsonl", "progress.json"):
        if (work / name).exists():
            shutil.copy2(work / name, logs / name)
    shutil.copy2(args.config, logs / "config.json")
    write_plots(work, model)
    captions = samples(pipe, model, g, steps, t5)
    write_card(cfg, work, model, pipe, ev, rows, captions, onnx)
    print("wrote", model / "README.md")


if __name__ == "__main__":
    main()
