"""Train the shipped LoRA for the embedded model: the colour word "violet", which shapes-sd never saw.

The base model's captions name purple things "purple" only; its tokenizer splits "violet" into
sub-word pieces the text encoder has no meaning for, so the base model paints a random colour. The
LoRA (text encoder and UNet attention, rank 8) is trained on the scene world with a share of the
purple objects captioned "violet" and every other caption unchanged, so it adds the word without
losing the rest. The judge measures it: experiments/lora/measure_violet.py.

Resumable: the work folder keeps encoded latents, a checkpoint every `checkpoint_every` steps, and
the log; rerunning the same command continues where it stopped (or only re-saves when finished).

Usage: python models/training/train_lora.py --work runs/lora-violet --out models/loras/shapes-sd-violet.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_common import lr_at, posterior_sample, save_arrays, save_state  # noqa: E402
from train_pipeline import images_to_tensor, log_line  # noqa: E402

from onnxdiffusion.evaluate import scenes as S  # noqa: E402

CONFIG = {
    "seed": 4321,
    "word": "violet",
    "colour": "purple",
    "rename_prob": 0.75,  # the rest keep "purple", so both words mean the same colour
    "purple_share": 0.5,  # of the training scenes, how many contain a purple object
    "num_scenes": 8000,
    "rank": 8,
    "steps": 1500,
    "batch_size": 32,
    "lr": 1e-3,
    "warmup": 50,
    "uncond_prob": 0.1,
    "checkpoint_every": 100,
    "unet_targets": ["to_q", "to_k", "to_v", "to_out.0"],
    "text_targets": ["q_proj", "k_proj", "v_proj", "out_proj"],
}


def has_colour(scene: S.Scene, colour: str) -> bool:
    return any(o.colour == colour for o in scene.objects)


def training_scenes(cfg: dict) -> list[S.Scene]:
    """Train-split scenes, `purple_share` of them with a purple object (the seed order decides which)."""
    want = int(cfg["num_scenes"] * cfg["purple_share"])
    with_c, without = [], []
    seed = 0
    while len(with_c) < want or len(without) < cfg["num_scenes"] - want:
        sc = S.sample_scene(seed, "train")
        (with_c if has_colour(sc, cfg["colour"]) else without).append(sc)
        seed += 1
    return with_c[:want] + without[: cfg["num_scenes"] - want]


def rename(caption: str, cfg: dict, rng: np.random.Generator) -> str:
    if cfg["colour"] in caption.split() and rng.random() < cfg["rename_prob"]:
        return " ".join(cfg["word"] if w == cfg["colour"] else w for w in caption.split())
    return caption


def encode(vae, scenes: list[S.Scene], batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    means, stds = [], []
    with torch.no_grad():
        for i in tqdm(range(0, len(scenes), batch), desc="encode scenes", mininterval=10):
            dist = vae.encode(images_to_tensor([S.render(s) for s in scenes[i : i + batch]])).latent_dist
            means.append(dist.mean.numpy())
            stds.append(dist.std.numpy())
    return np.concatenate(means), np.concatenate(stds)


def load_base(model: Path):
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    vae = AutoencoderKL.from_pretrained(model / "vae", torch_dtype=torch.float32).eval()
    unet = UNet2DConditionModel.from_pretrained(model / "unet", torch_dtype=torch.float32)
    te = CLIPTextModel.from_pretrained(model / "text_encoder", torch_dtype=torch.float32)
    tok = CLIPTokenizer.from_pretrained(model / "tokenizer")
    sched = DDPMScheduler.from_pretrained(model / "scheduler")
    return vae, unet, te, tok, sched


def add_lora(unet, te, cfg: dict) -> list[torch.nn.Parameter]:
    from peft import LoraConfig

    for m, targets in ((unet, cfg["unet_targets"]), (te, cfg["text_targets"])):
        m.requires_grad_(False)
        m.add_adapter(LoraConfig(r=cfg["rank"], lora_alpha=cfg["rank"], init_lora_weights="gaussian",
                                 target_modules=targets))
    return [p for m in (unet, te) for p in m.parameters() if p.requires_grad]


def save_lora(unet, te, out: Path) -> None:
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    def half(m):  # float16 halves the shipped file; the measurement is of these rounded weights
        return {k: v.detach().half() for k, v in get_peft_model_state_dict(m).items()}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / (out.stem + ".tmp")
    StableDiffusionPipeline.save_lora_weights(tmp, unet_lora_layers=half(unet),
                                              text_encoder_lora_layers=half(te) if te is not None else None,
                                              safe_serialization=True)
    (tmp / "pytorch_lora_weights.safetensors").replace(out)
    tmp.rmdir()
    print("wrote", out, out.stat().st_size, "bytes")


def cached_latents(work: Path, vae, scenes: list[S.Scene]) -> tuple[np.ndarray, np.ndarray]:
    """The scenes' VAE posteriors, encoded once per work folder."""
    cache = work / "latents.npz"
    if cache.exists():
        data = np.load(cache)
        return data["means"], data["stds"]
    means, stds = encode(vae, scenes)
    save_arrays(cache, means=means, stds=stds)
    return means, stds


def resume(work: Path, params: list, opt) -> int:
    """The step the last checkpoint in `work` reached (0 without one), its LoRA weights and optimizer restored."""
    ckpt = work / "lora_ckpt.pt"
    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, weights_only=True)
    for p, v in zip(params, state["params"]):
        p.data.copy_(v)
    opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"])
    print("resumed at step", state["step"])
    return state["step"]


def finish_step(step: int, loss, params: list, opt, cfg: dict, work: Path, bar, t0: float) -> None:
    """Backward, clipped update, a log line every 25 steps and a checkpoint every `checkpoint_every`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    if step % 25 == 0:
        bar.set_postfix(loss=f"{loss.item():.4f}")
        log_line(work / "lora_log.jsonl", {"step": step, "loss": loss.item(), "time": time.time() - t0})
    if (step + 1) % cfg["checkpoint_every"] == 0 or step + 1 == cfg["steps"]:
        state = {"params": [p.detach().clone() for p in params], "opt": opt.state_dict(),
                 "rng": torch.get_rng_state(), "step": step + 1}
        save_state(state, work / "lora_ckpt.pt")


def cli(doc: str, config: dict, train_fn, work: str, out: str) -> None:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/shapes-sd"))
    ap.add_argument("--work", type=Path, default=Path(work))
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=config["steps"])
    ap.add_argument("--save-only", action="store_true", help="write the LoRA file from the last checkpoint, no training")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train_fn(args.model, args.work, args.out, {**config, "steps": args.steps}, save_only=args.save_only)


def train(model: Path, work: Path, out: Path, cfg: dict, save_only: bool = False) -> None:
    torch.manual_seed(cfg["seed"])
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg, indent=1))
    vae, unet, te, tok, sched = load_base(model)
    scenes = training_scenes(cfg)
    means, stds = cached_latents(work, vae, scenes)
    sf = vae.config.scaling_factor
    params = add_lora(unet, te, cfg)
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.0)
    start = resume(work, params, opt)
    if save_only:  # an intermediate checkpoint as a LoRA file, to judge it while training goes on
        save_lora(unet, te, out)
        return
    maxlen = tok.model_max_length
    empty = tok([""], padding="max_length", max_length=maxlen, return_tensors="pt").input_ids
    ac = sched.alphas_cumprod
    g = np.random.default_rng([cfg["seed"], 1])
    for _ in range(start):  # the same data order whether resumed or not
        g.integers(0, len(scenes), cfg["batch_size"]), g.random(cfg["batch_size"]), g.random(cfg["batch_size"])
    unet.train(), te.train()
    t0 = time.time()
    bar = tqdm(range(start, cfg["steps"]), desc="lora", mininterval=10, initial=start, total=cfg["steps"])
    for step in bar:
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup"])
        idx = g.integers(0, len(scenes), cfg["batch_size"])
        drop = g.random(cfg["batch_size"]) < cfg["uncond_prob"]
        rn = np.random.default_rng(int(g.integers(1 << 31)))
        caps = [rename(scenes[i].caption, cfg, rn) for i in idx]
        ids = tok(caps, padding="max_length", max_length=maxlen, truncation=True, return_tensors="pt").input_ids
        ids = torch.where(torch.from_numpy(drop)[:, None], empty, ids)
        mu, sd = torch.from_numpy(means[idx]), torch.from_numpy(stds[idx])
        z0 = posterior_sample(mu, sd, sf)
        noise = torch.randn_like(z0)
        t = torch.randint(0, sched.config.num_train_timesteps, (z0.shape[0],))
        a = ac[t].view(-1, 1, 1, 1)
        pred = unet(a.sqrt() * z0 + (1 - a).sqrt() * noise, t, te(ids).last_hidden_state).sample
        loss = F.mse_loss(pred, noise)
        finish_step(step, loss, params, opt, cfg, work, bar, t0)
    save_lora(unet, te, out)


def main() -> None:
    cli(__doc__, CONFIG, train, "runs/lora-violet", "models/loras/shapes-sd-violet.safetensors")


if __name__ == "__main__":
    main()
