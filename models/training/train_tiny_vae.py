"""Distil a tiny autoencoder (diffusers AutoencoderTiny, TAESD's architecture) from the embedded VAE.

Decoder: raw VAE latents of rendered scenes -> the full VAE decoder's images of those latents.
Encoder: rendered scenes -> the full VAE encoder's posterior means (raw, unscaled latents).

The tiny autoencoder works on raw latents (like TAESD3 / TAEF1), so one set of weights serves both
embedded models (they share the VAE); each model's folder carries a config whose scaling_factor /
shift_factor are that model's, which is how diffusers pipelines call it: decode(latents / scaling
+ shift). Weights are stored in float16 and exported from the fp16-rounded values.

Resumable: scene data is generated in chunks (saved under WORK/data) while training runs, the model
state is checkpointed every --checkpoint-every steps; rerun the same command to continue.

Fine-tuning on the diffusion models' own final latents (the posterior samples above are only a proxy
for them): `--make-latents FOLDER` samples train-split captions with an ONNX model folder at its
recommended settings and keeps (the tiny decoder's feed, the VAE decoder's image) in chunks under
DIR/<folder name>; `--finetune-latents DIR --init TINY_FOLDER` then trains the decoder from TINY_FOLDER
on every chunk under DIR (re-read at each checkpoint, so it can run while --make-latents still adds
chunks), mixed with --posterior-share of the posterior-sample data (so what it learnt there is kept).
The encoder is left as it is (the run time only decodes).

Usage: python models/training/train_tiny_vae.py --work runs/tiny-vae [--steps 900] [--out DIR]
       python models/training/train_tiny_vae.py --make-latents models/shapes-sd-onnx --latents DIR [--count 768]
       python models/training/train_tiny_vae.py --work runs/tiny-vae-ft --finetune-latents DIR \
           --init models/shapes-sd/vae_tiny --steps 400 --lr 4e-4 [--edge-weight 4]
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

from onnxdiffusion.evaluate import scenes as S
from train_common import lr_at, save_arrays, save_state

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


LATENT_CHUNK = 64
LATENT_SEED = 10_000_000  # noise seeds of the made latents: far from evaluate's held-out seeds (0..)


def make_latents(folder: Path, out: Path, count: int, batch: int, scene_start: int) -> None:
    """Chunks of (tiny decoder feed, VAE image) for train-split captions sampled by `folder`; resumable."""
    from onnxdiffusion.evaluate.run import EvaluateOptions, generate_set
    from onnxdiffusion.runtime import GenerationResult, Pipeline
    from onnxdiffusion.runtime.generation import GenerateOptions
    from onnxdiffusion.runtime.tiny_decoder import TinyDecoder

    pipe = Pipeline.from_folder(folder, threads=1)
    rec = pipe.resolve(GenerateOptions())
    h, w = pipe.image_size(rec)
    tiny = TinyDecoder(pipe)
    (out / folder.name).mkdir(parents=True, exist_ok=True)
    for start in range(0, count, LATENT_CHUNK):
        path = out / folder.name / f"chunk_{start // LATENT_CHUNK:03d}.npz"
        if path.exists():
            continue
        t = time.time()
        scenes = S.scenes("train", min(LATENT_CHUNK, count - start), scene_start + start)
        options = EvaluateOptions(count=len(scenes), steps=rec.steps, sampler=rec.sampler, guidance=rec.guidance,
                                  batch=batch, split="train", seed_offset=LATENT_SEED + scene_start + start)
        finals: list[np.ndarray] = []
        images = generate_set(pipe, scenes, options, progress=False, step_callback=lambda _, e: finals.append(
            e.latents) if isinstance(e, GenerationResult) else None)
        # the tiny decoder's own feed (latents / scaling + shift): raw latents, what the decoder is trained on
        feed = tiny.prepare(np.concatenate(finals), h, w)[0].astype(np.float32)
        save_arrays(path, latents=feed, target=images.transpose(0, 3, 1, 2))
        print(f"{path}: {len(scenes)} in {time.time() - t:.0f} s", flush=True)


def load_latents(root: Path) -> dict[str, np.ndarray]:
    paths = sorted(root.glob("*/chunk_*.npz"))
    if not paths:
        raise SystemExit(f"no latent chunks under {root}: make them with --make-latents")
    parts = [dict(np.load(p)) for p in paths]
    print(f"{sum(len(p['latents']) for p in parts)} model latents from {len(paths)} chunks", flush=True)
    return {k: np.concatenate([p[k] for p in parts]) for k in ("latents", "target")}


def edge_weights(target: torch.Tensor, strength: float) -> torch.Tensor:
    """1 + strength at the target's edges (where shapes are told apart), 1 in flat regions."""
    if strength <= 0:
        return torch.ones_like(target[:, :1])
    g = target.mean(1, keepdim=True)
    dx = F.pad((g[..., :, 1:] - g[..., :, :-1]).abs(), (0, 1, 0, 0))
    dy = F.pad((g[..., 1:, :] - g[..., :-1, :]).abs(), (0, 0, 0, 1))
    edge = F.max_pool2d(torch.maximum(dx, dy), 3, stride=1, padding=1)  # widen to the pixels beside each edge
    return 1 + strength * (edge / 0.2).clamp(max=1)


def worst_patch(err: torch.Tensor, size: int) -> torch.Tensor:
    """Mean over the batch of each image's largest `size` x `size` patch mean of `err` (N, C, H, W): a small
    object the decoder blurs is a few pixels of a 64x64 image, lost in the image mean, not in its patch's."""
    return F.avg_pool2d(err.mean(1, keepdim=True), size, stride=size // 2).flatten(1).amax(1).mean()


def hardest(model, own: dict[str, np.ndarray], share: float, patch: int) -> np.ndarray:
    """Indices of the `share` of the model latents the decoder now gets most wrong (worst patch, as above)."""
    errs = []
    with torch.no_grad():
        for i in range(0, len(own["latents"]), 128):
            out = model.decoder(torch.from_numpy(own["latents"][i : i + 128]))
            d = out - to_image(own["target"][i : i + 128])
            errs.append(F.avg_pool2d((d**2 + 0.5 * d.abs()).mean(1, keepdim=True), patch, stride=patch // 2)
                        .flatten(1).amax(1).numpy())
    errs = np.concatenate(errs)
    return np.argsort(-errs, kind="stable")[: max(1, round(share * len(errs)))]


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
    save_arrays(path, latents=z.numpy(), means=dist.mean.numpy(), target=target, images=images.transpose(0, 3, 1, 2))


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
    finetune = args.finetune_latents is not None
    if finetune:
        if not args.init:
            raise SystemExit("--finetune-latents needs --init (the tiny autoencoder folder to start from)")
        model = AutoencoderTiny.from_pretrained(args.init).float()
        model.encoder.requires_grad_(False)
        own = load_latents(Path(args.finetune_latents))
    else:
        model = AutoencoderTiny(**ARCH, scaling_factor=vae.config.scaling_factor)
    ema = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=1e-4)
    ckpt, log = work / "ckpt.pt", work / "log.jsonl"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print("resumed at step", start, flush=True)
    grow = (lambda step: args.posterior_chunks) if finetune else (
        lambda step: min(POOL_MAX, POOL_START + step // GROW_EVERY))
    chunks = grow(start)
    pool = load_pool(work, vae, chunks)
    hard = hardest(model, own, args.hard_top, args.patch) if finetune and args.hard_share > 0 else None
    t0 = time.time()
    for step in range(start, args.steps):
        if finetune and step > start and step % args.checkpoint_every == 0:
            own = load_latents(Path(args.finetune_latents))  # chunks still being made join as they land
            if hard is not None:  # recomputed at each checkpoint (so a resumed run draws what it would have)
                hard = hardest(model, own, args.hard_top, args.patch)
        want = grow(step)
        if want != chunks:
            chunks, pool = want, load_pool(work, vae, want)
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, args.steps, args.lr, 20 if finetune else 50)
        g = np.random.default_rng([args.seed, step])  # data order depends on the step only: resumes replay it
        old = round(args.batch * args.posterior_share) if finetune else args.batch
        idx = g.integers(0, len(pool["latents"]), old)
        z, target = pool["latents"][idx], pool["target"][idx]
        if finetune:
            mine = g.integers(0, len(own["latents"]), args.batch - old)
            if hard is not None:  # a share of the model latents from those the decoder now gets most wrong
                n_hard = round((args.batch - old) * args.hard_share)
                mine[:n_hard] = hard[g.integers(0, len(hard), n_hard)]
            z = np.concatenate([z, own["latents"][mine]])
            target = np.concatenate([target, own["target"][mine]])
        z, target = torch.from_numpy(z), to_image(target)
        out = model.decoder(z)
        w = edge_weights(target, args.edge_weight)
        dec = ((out - target) ** 2 * w).mean() / w.mean() + 0.5 * ((out - target).abs() * w).mean() / w.mean()
        loss = dec
        if args.patch_weight > 0:
            loss = dec + args.patch_weight * worst_patch((out - target) ** 2 + 0.5 * (out - target).abs(), args.patch)
        if not finetune and step % args.encoder_every == 0:
            lat = model.encoder(to_image(pool["images"][idx]))
            enc = F.mse_loss(lat, torch.from_numpy(pool["means"][idx]))
            loss = dec + enc
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.lerp_(p, 1 - decay)
        if step % 20 == 0:
            psnr = 10 * math.log10(4 / max(float(F.mse_loss(out.detach(), target)), 1e-12))
            enc_now = float(enc) if not finetune and step % args.encoder_every == 0 else None
            rec = {"step": step, "dec": float(dec.detach()), "enc": enc_now, "psnr": psnr, "pool": chunks * CHUNK}
            with log.open("a") as f:
                f.write(json.dumps({**rec, "time": time.time() - t0}) + "\n")
            print(rec, flush=True)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            state = {"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step + 1}
            save_state(state, ckpt)
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
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the saved weights")
    p.add_argument("--make-latents", type=Path, metavar="FOLDER",
                   help="sample train-split captions with this ONNX model folder into --latents, then stop")
    p.add_argument("--latents", type=Path, default=Path("runs/tiny-vae-ft/latents"), help="where --make-latents writes")
    p.add_argument("--count", type=int, default=768, help="how many latents --make-latents makes")
    p.add_argument("--gen-batch", type=int, default=16, help="--make-latents' sampling batch")
    p.add_argument("--scene-start", type=int, default=0, help="first train-split scene --make-latents captions")
    p.add_argument("--finetune-latents", metavar="DIR", help="fine-tune the decoder on the latent chunks under DIR")
    p.add_argument("--init", help="the tiny autoencoder folder a fine-tune starts from")
    p.add_argument("--posterior-share", type=float, default=0.25, help="share of a fine-tune batch from posterior data")
    p.add_argument("--posterior-chunks", type=int, default=2, help="posterior-sample chunks a fine-tune keeps")
    p.add_argument("--edge-weight", type=float, default=0.0, help="extra loss weight on the target's edges")
    p.add_argument("--patch-weight", type=float, default=0.0,
                   help="weight of an extra loss term: each image's worst --patch x --patch patch")
    p.add_argument("--patch", type=int, default=8, help="the worst-patch term's patch size (pixels)")
    p.add_argument("--hard-share", type=float, default=0.0,
                   help="share of a fine-tune's model latents drawn from the hardest --hard-top of them "
                        "(worst-patch error, recomputed at each checkpoint)")
    p.add_argument("--hard-top", type=float, default=0.1, help="the share of the model latents counted hardest")
    args = p.parse_args()
    if args.make_latents is not None:
        torch.set_num_threads(args.threads)
        make_latents(args.make_latents, args.latents, args.count, args.gen_batch, args.scene_start)
    else:
        train(args)


if __name__ == "__main__":
    main()
