"""Train the embedded text-to-image pipeline on the project's scene generator.

Stages (each resumable from its output folder):
  vae       AutoencoderKL, 64x64 RGB -> 16x16x4 latents
  unet      CLIPTextModel pre-trained to parse captions into scene slots, then UNet2DConditionModel
            + CLIPTextModel trained jointly on the denoising loss (+ the parse loss, kept on)
  assemble  write a standard StableDiffusionPipeline folder (safetensors) under models/

Usage: python models/training/train_pipeline.py CONFIG --stage vae|unet|assemble --work runs/NAME
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_build import build_tokenizer_files  # noqa: E402
from train_common import lr_at, posterior_sample, save_folder, save_state  # noqa: E402

from onnxdiffusion.evaluate import scenes as S  # noqa: E402


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def images_to_tensor(images: list[np.ndarray]) -> torch.Tensor:
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    return x / 127.5 - 1.0


def render_batch(split: str, seeds: np.ndarray) -> tuple[torch.Tensor, list[str]]:
    sc = [S.sample_scene(int(s), split) for s in seeds]
    return images_to_tensor([S.render(s) for s in sc]), [s.caption for s in sc]


def log_line(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def make_vae(cfg: dict):
    from diffusers import AutoencoderKL

    n = len(cfg["block_out_channels"])
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(cfg["block_out_channels"]),
        layers_per_block=cfg["layers_per_block"],
        latent_channels=cfg["latent_channels"],
        norm_num_groups=cfg["norm_num_groups"],
        sample_size=S.IMAGE_SIZE,
    )


def train_vae(cfg: dict, work: Path) -> None:
    vc = cfg["vae"]
    out = work / "vae"
    if (out / "config.json").exists():
        print("vae already trained:", out)
        return
    seed_all(cfg["seed"])
    vae = make_vae(vc)
    opt = torch.optim.AdamW(vae.parameters(), lr=vc["lr"], weight_decay=0.0)
    log = work / "vae_log.jsonl"
    log.unlink(missing_ok=True)
    t0 = time.time()
    bar = tqdm(range(vc["steps"]), desc="vae", mininterval=10)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, vc["steps"], vc["lr"], 100)
        seeds = np.arange(step * vc["batch_size"], (step + 1) * vc["batch_size"])
        x, _ = render_batch("train", seeds)
        post = vae.encode(x).latent_dist
        y = vae.decode(post.sample()).sample
        rec = F.mse_loss(y, x) + 0.5 * F.l1_loss(y, x)
        kl = post.kl().mean()
        loss = rec + vc["kl_weight"] * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == vc["steps"] - 1:
            rec_v = float(rec)
            bar.set_postfix(rec=f"{rec_v:.4f}")
            log_line(log, {"step": step, "rec": rec_v, "kl": float(kl), "time": time.time() - t0})
    # scaling factor makes latents unit-variance, as Stable Diffusion's 0.18215 does for its VAE
    vae.eval()
    with torch.no_grad():
        x, _ = render_batch("train", np.arange(10_000_000, 10_000_512))
        z = vae.encode(x).latent_dist.sample()
        scale = float(1.0 / z.std())
    vae.register_to_config(scaling_factor=scale)
    vae.save_pretrained(out, safe_serialization=True)
    (work / "vae_time.json").write_text(json.dumps({"seconds": time.time() - t0, "scaling_factor": scale}))
    print(f"vae done in {time.time() - t0:.0f}s, scaling_factor={scale:.4f}")


def make_text_encoder(cfg: dict, vocab_size: int, bos: int, eos: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    tc = cfg["text_encoder"]
    conf = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=tc["hidden_size"],
        intermediate_size=tc["intermediate_size"],
        num_hidden_layers=tc["num_hidden_layers"],
        num_attention_heads=tc["num_attention_heads"],
        max_position_embeddings=cfg["model_max_length"],
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return CLIPTextModel(conf)


def make_unet(cfg: dict, latent_channels: int, latent_size: int, cross_dim: int):
    from diffusers import UNet2DConditionModel

    uc = cfg["unet"]
    return UNet2DConditionModel(
        sample_size=latent_size,
        in_channels=latent_channels,
        out_channels=latent_channels,
        block_out_channels=tuple(uc["block_out_channels"]),
        down_block_types=tuple(uc["down_block_types"]),
        up_block_types=tuple(uc["up_block_types"]),
        layers_per_block=uc["layers_per_block"],
        cross_attention_dim=cross_dim,
        attention_head_dim=uc["attention_head_dim"],
        norm_num_groups=uc["norm_num_groups"],
    )


def encode_scenes(vae, count: int, batch: int = 256) -> tuple[np.ndarray, np.ndarray, list[str]]:
    means, stds, captions = [], [], []
    with torch.no_grad():
        for start in tqdm(range(0, count, batch), desc="encode scenes", mininterval=10):
            seeds = np.arange(start, min(count, start + batch))
            x, caps = render_batch("train", seeds)
            dist = vae.encode(x).latent_dist
            means.append(dist.mean.numpy())
            stds.append(dist.std.numpy())
            captions += caps
    return np.concatenate(means), np.concatenate(stds), captions


# Why a parse loss: CLIP's causal mask means the first object's tokens never see the relation word
# that decides where they go, and the denoising loss alone taught the text encoder almost nothing
# about relations (a first run gave random layouts for "above" vs "left of", 50/50 on train
# prompts). Asking the end-of-text state to name every slot's shape, colour and size makes it carry
# the whole layout, linearly readable by the UNet's cross-attention.
SLOT_KEYS = (("shape", len(S.SHAPES) + 1), ("colour", len(S.COLOUR_NAMES) + 1), ("size", len(S.SIZE_NAMES) + 1))
IGNORE = -100


def caption_slot_targets(seeds: range, split: str = "train") -> np.ndarray:
    """(N, slots, 3) class ids per slot (0 = empty); size is IGNORE where the caption omits it."""
    out = np.zeros((len(seeds), len(S.POSITION_NAMES), len(SLOT_KEYS)), np.int64)
    for i, seed in enumerate(seeds):
        sc = S.sample_scene(int(seed), split)
        lab = S.slot_labels(sc)
        for k, (key, _) in enumerate(SLOT_KEYS):
            out[i, :, k] = lab[key]
        if not sc.size_in_caption:
            out[i, :, 2] = np.where(out[i, :, 2] > 0, IGNORE, 0)
    return out


class ParseHead(torch.nn.Module):
    """Linear read-out of the slots from the pooled (first end-of-text) text state; training only."""

    def __init__(self, width: int):
        super().__init__()
        self.sizes = [n for _, n in SLOT_KEYS]
        self.linear = torch.nn.Linear(width, len(S.POSITION_NAMES) * sum(self.sizes))

    def parts(self, pooled: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Logits per slot key: (N, slots, classes) each, in SLOT_KEYS order."""
        logits = self.linear(pooled).view(len(pooled), len(S.POSITION_NAMES), sum(self.sizes))
        return torch.split(logits, self.sizes, dim=-1)

    def loss(self, pooled: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        parts = self.parts(pooled)
        return sum(
            F.cross_entropy(part.reshape(-1, part.shape[-1]), targets[..., k].reshape(-1), ignore_index=IGNORE)
            for k, part in enumerate(parts)
        ) / len(parts)

    @torch.no_grad()
    def accuracy(self, pooled: torch.Tensor, targets: torch.Tensor) -> float:
        parts = self.parts(pooled)
        ok = [(p.argmax(-1) == targets[..., k]) | (targets[..., k] == IGNORE) for k, p in enumerate(parts)]
        return float(torch.stack(ok, -1).all(-1).all(-1).float().mean())


def pretrain_parse(text_encoder, head: ParseHead, ids_all: np.ndarray, targets: np.ndarray, pc: dict, log: Path) -> None:
    """Text encoder + head on the parse loss alone, so the UNet starts from a structured condition."""
    params = list(text_encoder.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=pc["lr"], weight_decay=0.01)
    g = np.random.default_rng([pc["seed"], 11])
    bar = tqdm(range(pc["steps"]), desc="text parse", mininterval=10)
    for step in bar:
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, pc["steps"], pc["lr"], 50)
        idx = g.integers(0, len(ids_all), pc["batch_size"])
        pooled = text_encoder(torch.from_numpy(ids_all[idx])).pooler_output
        tgt = torch.from_numpy(targets[idx])
        loss = head.loss(pooled, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == pc["steps"] - 1:
            acc = head.accuracy(pooled, tgt)
            bar.set_postfix(loss=f"{loss.item():.4f}", acc=f"{acc:.3f}")
            log_line(log, {"step": step, "parse_loss": loss.item(), "parse_acc": acc})


def train_unet(cfg: dict, work: Path) -> None:
    from diffusers import AutoencoderKL, DDPMScheduler
    from transformers import CLIPTokenizer

    uc = cfg["unet"]
    tok_dir = work / "tokenizer"
    build_tokenizer_files(S.vocabulary(), tok_dir, cfg["model_max_length"])
    tokenizer = CLIPTokenizer.from_pretrained(tok_dir)
    vae = AutoencoderKL.from_pretrained(work / "vae").eval()
    sf = vae.config.scaling_factor
    cache = work / "latents.npz"
    if cache.exists():
        data = np.load(cache)
        means, stds = data["means"], data["stds"]
        captions = json.loads((work / "captions.json").read_text())
    else:
        seed_all(cfg["seed"])
        means, stds, captions = encode_scenes(vae, uc["num_scenes"])
        np.savez(cache, means=means, stds=stds)
        (work / "captions.json").write_text(json.dumps(captions))
    ids_all = tokenizer(
        captions, padding="max_length", max_length=cfg["model_max_length"], truncation=True, return_tensors="np"
    ).input_ids
    empty_ids = tokenizer([""], padding="max_length", max_length=cfg["model_max_length"], return_tensors="np").input_ids

    seed_all(cfg["seed"] + 1)
    text_encoder = make_text_encoder(cfg, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    unet = make_unet(cfg, means.shape[1], means.shape[2], cfg["text_encoder"]["hidden_size"])
    pc = cfg.get("text_parse")
    head = ParseHead(cfg["text_encoder"]["hidden_size"]) if pc else None
    targets = caption_slot_targets(range(len(captions))) if pc else None
    ckpt = work / "unet_ckpt.pt"
    start_step = 0
    if pc and not ckpt.exists():
        pretrain_parse(text_encoder, head, ids_all, targets, {**pc, "seed": cfg["seed"]}, work / "parse_log.jsonl")
    params = list(unet.parameters()) + list(text_encoder.parameters()) + (list(head.parameters()) if head else [])
    opt = torch.optim.AdamW(params, lr=uc["lr"], weight_decay=0.01)
    ema_unet, ema_te = copy.deepcopy(unet).eval(), copy.deepcopy(text_encoder).eval()
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        unet.load_state_dict(state["unet"])
        text_encoder.load_state_dict(state["te"])
        ema_unet.load_state_dict(state["ema_unet"])
        ema_te.load_state_dict(state["ema_te"])
        if head is not None:
            head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        start_step = state["step"]
        torch.set_rng_state(state["rng"])
        print("resumed at step", start_step)
    sched = DDPMScheduler(**{k: v for k, v in cfg["scheduler"].items() if k != "set_alpha_to_one"})
    ac = sched.alphas_cumprod
    log = work / "unet_log.jsonl"
    if start_step == 0:
        log.unlink(missing_ok=True)
    n = len(captions)
    g = np.random.default_rng([cfg["seed"], 7])
    for _ in range(start_step):  # keep the data order identical across resumes
        g.integers(0, n, uc["batch_size"])
        g.random(uc["batch_size"])
    t0 = time.time()
    bar = tqdm(range(start_step, uc["steps"]), desc="unet", mininterval=10, initial=start_step, total=uc["steps"])
    unet.train()
    text_encoder.train()
    for step in bar:
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, uc["steps"], uc["lr"], uc["warmup"])
        idx = g.integers(0, n, uc["batch_size"])
        drop = g.random(uc["batch_size"]) < uc["uncond_prob"]
        ids = torch.from_numpy(np.where(drop[:, None], empty_ids, ids_all[idx]))
        mu, sd = torch.from_numpy(means[idx]), torch.from_numpy(stds[idx])
        z0 = posterior_sample(mu, sd, sf)
        noise = torch.randn_like(z0)
        t = torch.randint(0, sched.config.num_train_timesteps, (z0.shape[0],))
        a = ac[t].view(-1, 1, 1, 1)
        zt = a.sqrt() * z0 + (1 - a).sqrt() * noise
        enc = text_encoder(ids)
        pred = unet(zt, t, enc.last_hidden_state).sample
        denoise = F.mse_loss(pred, noise)
        loss = denoise
        if head is not None:
            # empty (dropped) captions name no objects: leave them out of the parse loss
            tgt = torch.from_numpy(np.where(drop[:, None, None], IGNORE, targets[idx]))
            loss = loss + pc["weight"] * head.loss(enc.pooler_output, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(uc["ema_decay"], (1 + step) / (10 + step))
        with torch.no_grad():
            for m_ema, m in ((ema_unet, unet), (ema_te, text_encoder)):
                for pe, p in zip(m_ema.parameters(), m.parameters()):
                    pe.lerp_(p, 1 - decay)
        if step % 25 == 0:
            bar.set_postfix(loss=f"{float(denoise):.4f}")
            log_line(log, {"step": step, "loss": float(denoise), "total_loss": float(loss), "time": time.time() - t0})
        if (step + 1) % uc["checkpoint_every"] == 0 or step + 1 == uc["steps"]:
            state = {
                "unet": unet.state_dict(),
                "te": text_encoder.state_dict(),
                "ema_unet": ema_unet.state_dict(),
                "ema_te": ema_te.state_dict(),
                **({"head": head.state_dict()} if head is not None else {}),
                "opt": opt.state_dict(),
                "step": step + 1,
                "rng": torch.get_rng_state(),
            }
            save_state(state, ckpt)
            ema_unet.save_pretrained(work / "unet", safe_serialization=True)
            ema_te.save_pretrained(work / "text_encoder", safe_serialization=True)
            (work / "unet_progress.json").write_text(json.dumps({"step": step + 1}))


def assemble(cfg: dict, work: Path, out: Path) -> None:
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL.from_pretrained(work / "vae"),
        text_encoder=CLIPTextModel.from_pretrained(work / "text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(work / "tokenizer"),
        unet=UNet2DConditionModel.from_pretrained(work / "unet"),
        scheduler=DDIMScheduler(**cfg["scheduler"]),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    save_folder(pipe, out)
    print("wrote", out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--stage", choices=["vae", "unet", "assemble"], required=True)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=None, help="override the config's seed (reproducibility studies)")
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    if args.seed is not None:
        cfg["seed"] = args.seed
    # a stage may override the thread count (the UNet stage scales to both cores, the VAE barely)
    torch.set_num_threads(cfg.get(args.stage, {}).get("threads", cfg["threads"]))
    work = Path(args.work or f"runs/{cfg['name']}")
    work.mkdir(parents=True, exist_ok=True)
    if args.stage == "vae":
        train_vae(cfg, work)
    elif args.stage == "unet":
        train_unet(cfg, work)
    else:
        assemble(cfg, work, Path(args.out or f"models/{cfg['name']}"))


if __name__ == "__main__":
    main()
