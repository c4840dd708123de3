"""Distil a tiny autoencoder (diffusers AutoencoderTiny, TAESD's architecture) from the embedded VAE.

Decoder: raw VAE latents of rendered scenes -> the full VAE decoder's images of those latents.
Encoder: rendered scenes -> the full VAE encoder's posterior means (raw, unscaled latents).

The tiny autoencoder works on raw latents (like TAESD3 / TAEF1), so one set of weights serves both
embedded models (they share the VAE); each model's folder carries a config whose scaling_factor /
shift_factor are that model's, which is how diffusers pipelines call it: decode(latents / scaling
+ shift). Weights are stored in float16 and exported from the fp16-rounded values.

Resumable: scene data is generated in chunks (saved under WORK/data) while training runs, the model
state is checkpointed every --checkpoint-every steps; rerun the same command to continue.

Usage: python models/training/train_tiny_vae.py --work runs/tiny-vae [--steps 900] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from onnxdiffusion import scenes as S

ROOT = Path(__file__).resolve().parents[2]
VAE = ROOT / "models" / "shapes-sd" / "vae"
ARCH = {
    "encoder_block_out_channels": (32, 32, 32),
    "decoder_block_out_channels": (32, 32, 32),
    "num_encoder_blocks": (1, 1, 1),
    "num_decoder_blocks": (2, 2, 1),
    "latent_channels": 4,
}
CHUNK = 512
# Why the pool grows while training: rendering + the full VAE costs ~46 ms an image on one thread,
# as much as ~40 training samples; growing the pool keeps early steps cheap and later ones varied.
POOL_START, POOL_MAX, GROW_EVERY = 4, 14, 90  # in chunks / steps


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def make_chunk(vae, index: int, path: Path) -> None:
    seeds = np.arange(index * CHUNK, (index + 1) * CHUNK)
    images = np.stack([S.render(S.sample_scene(int(s), "train")) for s in seeds])
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    g = torch.Generator().manual_seed(1000 + index)
    with torch.no_grad():
        dist = vae.encode(x).latent_dist
        # Diffusion models are trained on posterior samples, so their outputs sit around the mean
        # at up to one posterior std: cover the whole range.
        u = torch.rand(len(x), 1, 1, 1, generator=g)
        z = dist.mean + u * dist.std * torch.randn(dist.mean.shape, generator=g)
        y = vae.decode(z).sample
    target = ((y.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, latents=z.numpy(), means=dist.mean.numpy(), target=target, images=images.transpose(0, 3, 1, 2))
    tmp.replace(path)


def load_pool(work: Path, vae, chunks: int) -> dict[str, np.ndarray]:
    parts = []
    for i in range(chunks):
        path = work / "data" / f"chunk_{i:03d}.npz"
        if not path.exists():
            t = time.time()
            make_chunk(vae, i, path)
            print(f"chunk {i} made in {time.time() - t:.0f} s", flush=True)
        parts.append(dict(np.load(path)))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def to_image(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).float() / 127.5 - 1.0


def save_diffusers(model, out: Path, scaling: float, shift: float) -> None:
    model = copy.deepcopy(model).half()
    model.register_to_config(scaling_factor=scaling, shift_factor=shift)
    model.save_pretrained(out, safe_serialization=True)


def train(args) -> None:
    from diffusers import AutoencoderKL, AutoencoderTiny

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    (work / "data").mkdir(parents=True, exist_ok=True)
    vae = AutoencoderKL.from_pretrained(VAE).eval()
    torch.manual_seed(args.seed)
    model = AutoencoderTiny(**ARCH, scaling_factor=vae.config.scaling_factor)
    ema = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    ckpt, log = work / "ckpt.pt", work / "log.jsonl"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print("resumed at step", start, flush=True)
    chunks = min(POOL_MAX, POOL_START + start // GROW_EVERY)
    pool = load_pool(work, vae, chunks)
    t0 = time.time()
    for step in range(start, args.steps):
        want = min(POOL_MAX, POOL_START + step // GROW_EVERY)
        if want != chunks:
            chunks, pool = want, load_pool(work, vae, want)
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, args.steps, args.lr, 50)
        g = np.random.default_rng([args.seed, step])  # data order depends on the step only: resumes replay it
        idx = g.integers(0, len(pool["latents"]), args.batch)
        z = torch.from_numpy(pool["latents"][idx])
        target = to_image(pool["target"][idx])
        out = model.decoder(z)
        dec = F.mse_loss(out, target) + 0.5 * F.l1_loss(out, target)
        loss = dec
        if step % args.encoder_every == 0:
            lat = model.encoder(to_image(pool["images"][idx]))
            enc = F.mse_loss(lat, torch.from_numpy(pool["means"][idx]))
            loss = dec + enc
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.lerp_(p, 1 - decay)
        if step % 20 == 0:
            psnr = 10 * math.log10(4 / max(float(F.mse_loss(out.detach(), target)), 1e-12))
            enc_now = float(enc) if step % args.encoder_every == 0 else None
            rec = {"step": step, "dec": float(dec), "enc": enc_now, "psnr": psnr, "pool": chunks * CHUNK}
            with log.open("a") as f:
                f.write(json.dumps({**rec, "time": time.time() - t0}) + "\n")
            print(rec, flush=True)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            state = {"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step + 1}
            torch.save(state, work / "ckpt.tmp")
            (work / "ckpt.tmp").replace(ckpt)
            save_diffusers(ema, work / "vae_tiny", vae.config.scaling_factor, 0.0)
    if args.out:
        save_diffusers(ema, Path(args.out), vae.config.scaling_factor, 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/tiny-vae")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--checkpoint-every", type=int, default=100)
    # the run time decodes only: the encoder (shipped in the diffusers folder, not the ONNX ones) trains less often
    p.add_argument("--encoder-every", type=int, default=4)
    p.add_argument("--out", help="also write the final diffusers folder here")
    train(p.parse_args())


if __name__ == "__main__":
    main()
