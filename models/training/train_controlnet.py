"""Train the shipped ControlNet for the embedded model: object silhouettes -> where (and what shape) things are.

The condition is scenes.render_condition(scene): each object's silhouette in white on black at its
place and size. The ControlNet is a copy of shapes-sd's UNet encoder (diffusers' from_unet) with a
condition embedding that downsamples 64x64 pixels by the VAE's factor 4 to the 16x16 latent grid;
the UNet, VAE and text encoder stay frozen and the loss is the base model's epsilon loss. Most
captions lose their position words (scenes.caption_without_position) so the net, not the words,
must carry position; 10% are empty so classifier-free guidance keeps working with the net.
Measured by experiments/controlnet/measure_position.py.

Resumable: the work folder keeps encoded latents, a checkpoint every `checkpoint_every` steps and
the log; rerunning the same command continues where it stopped (or only re-saves when finished).
Each step draws its batch and noise from (seed, step) alone, so a resumed run is the same run.

Usage: python models/training/train_controlnet.py --work runs/controlnet-position \
           --out models/controlnets/shapes-sd-position
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lora import cached_latents, cli, load_base  # noqa: E402
from train_common import lr_at, posterior_sample, save_folder, save_state  # noqa: E402
from train_pipeline import log_line  # noqa: E402

from onnxdiffusion.evaluate import scenes as S  # noqa: E402

CONFIG = {
    "seed": 2468,
    "num_scenes": 6000,
    "steps": 2000,
    "batch_size": 32,
    "lr": 3e-4,
    "warmup": 100,
    "uncond_prob": 0.1,
    "no_position_prob": 0.75,  # of the captioned samples, how many lose their position words
    "checkpoint_every": 100,
    "log_every": 20,
    # Three entries: two stride-2 convolutions, 64 -> 16, the VAE's factor 4 (diffusers' default has four: factor 8).
    "cond_channels": [16, 32, 64],
}


def conditions(scenes: list[S.Scene]) -> np.ndarray:
    """(N, 1, 64, 64) uint8: the silhouettes are grey, one channel is enough to keep in memory."""
    return np.stack([S.render_condition(s)[:, :, 0] for s in scenes])[:, None]


def token_ids(tok, captions: list[str]) -> torch.Tensor:
    return tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
               return_tensors="pt").input_ids


def make_controlnet(unet, cfg: dict):
    from diffusers import ControlNetModel

    cn = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=tuple(cfg["cond_channels"]))
    latent = unet.config.sample_size
    probe = cn.controlnet_cond_embedding(torch.zeros(1, 3, S.IMAGE_SIZE, S.IMAGE_SIZE))
    if probe.shape[-1] != latent:  # a wrong factor would only fail deep inside the first forward
        side = probe.shape[-1]
        raise SystemExit(f"condition embedding gives {side}x{side}, latents are {latent}x{latent}")
    return cn


def save_controlnet(cn, out: Path) -> None:
    """float16 diffusers folder, written next to `out` and renamed into place."""
    import copy

    import hashlib

    # the hand-written card survives a re-save, and the weights' hash: only the ONNX copy of the net is tracked,
    # controlnet_weights.py rebuilds this file from it and checks it against weights.sha256
    save_folder(copy.deepcopy(cn).half(), out, keep=("README.md",))
    weights = out / "diffusion_pytorch_model.safetensors"
    size = weights.stat().st_size
    (out / "weights.sha256").write_text(f"{hashlib.sha256(weights.read_bytes()).hexdigest()}  {weights.name}\n")
    print(f"wrote {out} (weights {size} bytes)")


def resume(work: Path, cn, opt) -> int:
    ckpt = work / "controlnet_ckpt.pt"
    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, weights_only=True)
    cn.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    print("resumed at step", state["step"])
    return state["step"]


def checkpoint(work: Path, cn, opt, step: int) -> None:
    save_state({"model": cn.state_dict(), "opt": opt.state_dict(), "step": step}, work / "controlnet_ckpt.pt")


def batch_ids(step: int, n: int, ids: dict, cfg: dict) -> tuple[np.ndarray, torch.Tensor]:
    """Scene indices and caption token ids for one step, drawn from (seed, step) alone."""
    g = np.random.default_rng([cfg["seed"], step])
    idx = g.integers(0, n, cfg["batch_size"])
    u = g.random(cfg["batch_size"])
    empty = u < cfg["uncond_prob"]
    nopos = ~empty & (g.random(cfg["batch_size"]) < cfg["no_position_prob"])
    out = torch.where(torch.from_numpy(nopos)[:, None], ids["nopos"][idx], ids["full"][idx])
    return idx, torch.where(torch.from_numpy(empty)[:, None], ids["empty"], out)


def progress(work: Path, step: int, loss: float, start: int, t0: float, cfg: dict) -> None:
    done = step + 1 - start
    rate = done / max(time.time() - t0, 1e-9)
    rec = {"step": step + 1, "loss": round(loss, 5), "steps_per_s": round(rate, 4),
           "eta_min": round((cfg["steps"] - step - 1) / rate / 60, 1), "time": round(time.time() - t0, 1)}
    log_line(work / "controlnet_log.jsonl", rec)
    print(json.dumps(rec), flush=True)


def train(model: Path, work: Path, out: Path, cfg: dict, save_only: bool = False) -> None:
    torch.manual_seed(cfg["seed"])
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg, indent=1))
    vae, unet, te, tok, sched = load_base(model)
    for m in (vae, unet, te):
        m.requires_grad_(False).eval()
    cn = make_controlnet(unet, cfg)
    opt = torch.optim.AdamW(cn.parameters(), lr=cfg["lr"], weight_decay=0.0)
    start = resume(work, cn, opt)
    if save_only or start >= cfg["steps"]:
        save_controlnet(cn, out)
        return
    scenes = S.scenes("train", cfg["num_scenes"])
    means, stds = cached_latents(work, vae, scenes)
    conds = conditions(scenes)
    ids = {"full": token_ids(tok, [s.caption for s in scenes]),
           "nopos": token_ids(tok, [S.caption_without_position(s) for s in scenes]),
           "empty": token_ids(tok, [""])}
    sf, ac = vae.config.scaling_factor, sched.alphas_cumprod
    cn.train()
    t0 = time.time()
    for step in range(start, cfg["steps"]):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup"])
        idx, tids = batch_ids(step, len(scenes), ids, cfg)
        gen = torch.Generator().manual_seed(cfg["seed"] * 100003 + step)
        mu, sd = torch.from_numpy(means[idx]), torch.from_numpy(stds[idx])
        z0 = posterior_sample(mu, sd, sf, generator=gen)
        noise = torch.randn(z0.shape, generator=gen)
        t = torch.randint(0, sched.config.num_train_timesteps, (z0.shape[0],), generator=gen)
        a = ac[t].view(-1, 1, 1, 1)
        zt = a.sqrt() * z0 + (1 - a).sqrt() * noise
        cond = torch.from_numpy(conds[idx]).float().div(255.0).expand(-1, 3, -1, -1)  # pipeline feeds [0, 1]
        with torch.no_grad():
            hidden = te(tids).last_hidden_state
        down, mid = cn(zt, t, encoder_hidden_states=hidden, controlnet_cond=cond, return_dict=False)
        pred = unet(zt, t, hidden, down_block_additional_residuals=down, mid_block_additional_residual=mid).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(cn.parameters(), 1.0)
        opt.step()
        if (step + 1) % cfg["log_every"] == 0 or step == start:
            progress(work, step, loss.item(), start, t0, cfg)
        if (step + 1) % cfg["checkpoint_every"] == 0 or step + 1 == cfg["steps"]:
            checkpoint(work, cn, opt, step + 1)
    save_controlnet(cn, out)


def main() -> None:
    cli(__doc__, CONFIG, train, "runs/controlnet-position", "models/controlnets/shapes-sd-position")


if __name__ == "__main__":
    main()
