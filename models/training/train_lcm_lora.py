"""Distil an LCM-LoRA for shapes-sd: 4-step images (LCM sampler, no guidance pass) from the 20-step DDIM model.

Latent consistency distillation as the LCM-LoRA paper does it (Luo et al. 2023; diffusers'
train_lcm_distill_lora_sd.py is the reference reading): the frozen base UNet is the teacher; one
DDIM step of its classifier-free-guided prediction (guidance `cfg`, the model's recommended 4)
goes from a skipping-step timestep t_{n+k} to t_n on the 50-step distillation schedule; the
student (base + LoRA) is asked to map both points to the same boundary-conditioned x0 (the target
is the student itself at t_n, without gradient), with a pseudo-Huber loss. Guidance is folded in,
so the LoRA runs at guidance 1: one backbone call per step instead of two.

Resumable like train_lora.py (latents, checkpoints and the log in the work folder).

Usage: python models/training/train_lcm_lora.py --work runs/lcm-lora --out models/loras/shapes-sd-lcm.safetensors
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lora import cached_latents, cli, finish_step, load_base, resume, save_lora  # noqa: E402
from train_common import lr_at, posterior_sample  # noqa: E402

from onnxdiffusion.evaluate import scenes as S  # noqa: E402

CONFIG = {
    "seed": 2468,
    "num_scenes": 8000,
    "rank": 8,
    "steps": 800,
    "batch_size": 16,
    "lr": 1e-3,
    "warmup": 50,
    "cfg": 4.0,  # the guidance scale folded in (diffusers' w = cfg - 1)
    "ddim_steps": 50,  # LCMScheduler's original_inference_steps
    "timestep_scaling": 10.0,  # LCMScheduler's boundary-condition scaling
    "huber_c": 0.001,
    "checkpoint_every": 100,
    "targets": ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "conv1", "conv2"],
}


def boundary(t: torch.Tensor, scaling: float, sigma_data: float = 0.5):
    s = scaling * t.float()
    c_skip = sigma_data**2 / (s**2 + sigma_data**2)
    c_out = s / (s**2 + sigma_data**2) ** 0.5
    return c_skip.view(-1, 1, 1, 1), c_out.view(-1, 1, 1, 1)


def x0_from_eps(eps, t, x, ac):
    a = ac[t].view(-1, 1, 1, 1)
    return (x - (1 - a).sqrt() * eps) / a.sqrt()


def train(model: Path, work: Path, out: Path, cfg: dict, save_only: bool = False) -> None:
    from peft import LoraConfig

    torch.manual_seed(cfg["seed"])
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg, indent=1))
    vae, unet, te, tok, sched = load_base(model)
    scenes = S.scenes("train", cfg["num_scenes"])
    means, stds = cached_latents(work, vae, scenes)
    sf = vae.config.scaling_factor
    unet.requires_grad_(False)
    te.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=cfg["rank"], lora_alpha=cfg["rank"], init_lora_weights="gaussian",
                                target_modules=cfg["targets"]))
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.0)
    start = resume(work, params, opt)
    if save_only:
        save_lora(unet, None, out)
        return
    T = sched.config.num_train_timesteps
    k = T // cfg["ddim_steps"]
    ddim_t = torch.arange(1, cfg["ddim_steps"] + 1) * k - 1  # LCMScheduler's distillation timesteps
    ac = sched.alphas_cumprod
    maxlen = tok.model_max_length
    with torch.no_grad():
        empty = te(tok([""], padding="max_length", max_length=maxlen, return_tensors="pt").input_ids).last_hidden_state
    g = np.random.default_rng([cfg["seed"], 1])
    for _ in range(start):
        g.integers(0, len(scenes), cfg["batch_size"])
    w = cfg["cfg"] - 1.0
    t0 = time.time()
    unet.train()
    bar = tqdm(range(start, cfg["steps"]), desc="lcm-lora", mininterval=10, initial=start, total=cfg["steps"])
    for step in bar:
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup"])
        idx = g.integers(0, len(scenes), cfg["batch_size"])
        ids = tok([scenes[i].caption for i in idx], padding="max_length", max_length=maxlen, truncation=True,
                  return_tensors="pt").input_ids
        with torch.no_grad():
            cond = te(ids).last_hidden_state
        mu, sd = torch.from_numpy(means[idx]), torch.from_numpy(stds[idx])
        z0 = posterior_sample(mu, sd, sf)
        n = torch.randint(0, cfg["ddim_steps"], (z0.shape[0],))
        t_start = ddim_t[n]
        t_prev = (t_start - k).clamp(min=0)
        noise = torch.randn_like(z0)
        a = ac[t_start].view(-1, 1, 1, 1)
        x = a.sqrt() * z0 + (1 - a).sqrt() * noise
        skip_s, out_s = boundary(t_start, cfg["timestep_scaling"])
        eps = unet(x, t_start, cond).sample
        pred = skip_s * x + out_s * x0_from_eps(eps, t_start, x, ac)
        with torch.no_grad():
            unet.disable_adapters()
            both = unet(torch.cat([x, x]), torch.cat([t_start, t_start]), torch.cat([cond, empty.expand_as(cond)])).sample
            unet.enable_adapters()
            e_c, e_u = both.chunk(2)
            e_g = e_c + w * (e_c - e_u)
            x0_g = x0_from_eps(e_g, t_start, x, ac)
            ap = ac[t_prev].view(-1, 1, 1, 1)  # the first distillation step lands on t = 0 (DDIMSolver's prev alpha)
            x_prev = ap.sqrt() * x0_g + (1 - ap).sqrt() * e_g  # one DDIM step of the guided teacher
            skip_p, out_p = boundary(t_prev, cfg["timestep_scaling"])
            target = skip_p * x_prev + out_p * x0_from_eps(unet(x_prev, t_prev, cond).sample, t_prev, x_prev, ac)
        c = cfg["huber_c"]
        loss = (((pred - target) ** 2 + c**2).sqrt() - c).mean()
        finish_step(step, loss, params, opt, cfg, work, bar, t0)
    save_lora(unet, None, out)


def main() -> None:
    cli(__doc__, CONFIG, train, "runs/lcm-lora", "models/loras/shapes-sd-lcm.safetensors")


if __name__ == "__main__":
    main()
