"""Train the SD3-family model `shapes-mmdit` on the project's scene generator.

An SD3Transformer2DModel (MMDiT, patch 2 on the 16x16x4 latents: 64 image tokens) trained from
scratch with SD3's rectified-flow objective (logit-normal sigma, velocity target noise - x0).
What transfers from `shapes-sd` is reused frozen: its VAE (plus SD3's latent shift, measured here)
and its parse-trained CLIP text encoder (as `text_encoder`, a CLIPTextModelWithProjection whose
projection is the identity). SD3 wants a second CLIP encoder: a tiny one (hidden 32) pre-trained
here on the same parse objective. T5 is omitted, as SD3 allows: the pipeline then appends
`t5_tokens` zero tokens (diffusers' default max_sequence_length, 256), and training
computes exactly that with one token (NullTokenJointAttention).

Stages (resumable: the transformer stage restarts from its last checkpoint in WORK):
  train     text_encoder_2 parse pre-training, then the transformer (+ periodic judge evaluation)
  assemble  write a standard StableDiffusion3Pipeline folder (float32; to_fp16.py then stores it in float16)

Usage: python models/training/train_mmdit.py CONFIG --stage train|assemble --work runs/NAME [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_common import posterior_sample, save_folder  # noqa: E402
from train_pipeline import ParseHead, caption_slot_targets, encode_scenes, log_line, pretrain_parse, render_batch  # noqa: E402


class NullTokenJointAttention:
    """diffusers' JointAttnProcessor2_0 math, where the last context token stands for `copies` identical ones.

    Without T5, StableDiffusion3Pipeline appends max_sequence_length (default 256) zero tokens. They stay
    identical through every block (same input, same per-token maps, same attention), and identical keys
    with identical values act as one key whose softmax weight is multiplied by their count. Training with
    one such token and log(copies) added to its attention logit is therefore the model run with `copies`
    of them, at the cost of one token.
    """

    def __init__(self, copies: int):
        self.log_copies = math.log(copies)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        b, n = hidden_states.shape[:2]

        def heads(x):
            return x.view(b, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        e = encoder_hidden_states
        q = torch.cat([q, heads(attn.add_q_proj(e))], 2)
        k = torch.cat([k, heads(attn.add_k_proj(e))], 2)
        v = torch.cat([v, heads(attn.add_v_proj(e))], 2)
        bias = torch.zeros(k.shape[2], dtype=q.dtype)
        bias[-1] = self.log_copies
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.view(1, -1))
        out = out.transpose(1, 2).reshape(b, -1, q.shape[1] * q.shape[-1])
        img, ctx = out[:, :n], out[:, n:]
        if not attn.context_pre_only:
            ctx = attn.to_add_out(ctx)
        return attn.to_out[1](attn.to_out[0](img)), ctx


def round_fp16_(module: torch.nn.Module) -> torch.nn.Module:
    """Round float weights to float16 values (kept float32): the shipped folders store float16."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(t.half().float())
    return module


def text_encoder_with_projection(config: dict, state: dict | None = None):
    """CLIPTextModelWithProjection; a given CLIPTextModel state loads with an identity projection."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    conf = CLIPTextConfig(**{"projection_dim": config["hidden_size"], **config})
    conf.architectures = ["CLIPTextModelWithProjection"]
    model = CLIPTextModelWithProjection(conf)
    if state is not None:
        with torch.no_grad():
            model.text_projection.weight.copy_(torch.eye(config["hidden_size"]))
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "text_projection.weight"]:
            raise RuntimeError(f"text encoder state mismatch: {missing} {unexpected}")
    return model.eval()


def encode(te1, te2, ids: torch.Tensor, t5_tokens: int, joint_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What StableDiffusion3Pipeline.encode_prompt computes without T5: penultimate CLIP states of both
    encoders side by side (padded to joint_dim), then t5_tokens zero tokens; pooled = both projections."""
    o1, o2 = te1(ids, output_hidden_states=True), te2(ids, output_hidden_states=True)
    ctx = torch.cat([o1.hidden_states[-2], o2.hidden_states[-2]], -1)
    ctx = F.pad(ctx, (0, joint_dim - ctx.shape[-1]))
    ctx = torch.cat([ctx, ctx.new_zeros(ctx.shape[0], t5_tokens, joint_dim)], 1)
    return ctx, torch.cat([o1.text_embeds, o2.text_embeds], -1)


class _Pooled(torch.nn.Module):
    """Adapter so pretrain_parse reads the projected pooled output, the state SD3 conditions on."""

    def __init__(self, te):
        super().__init__()
        self.te = te

    def forward(self, ids):
        return type("Out", (), {"pooler_output": self.te(ids).text_embeds})()


def prepare(cfg: dict, work: Path):
    """Frozen parts in WORK: tokenizers, VAE (+ latent shift/scale), text encoders; latents cache."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    src = Path(cfg["source"])
    for name in ("tokenizer", "tokenizer_2"):
        if not (work / name).exists():
            shutil.copytree(src / "tokenizer", work / name)
    tokenizer = CLIPTokenizer.from_pretrained(work / "tokenizer")
    if not (work / "vae" / "config.json").exists():
        vae = round_fp16_(AutoencoderKL.from_pretrained(src / "vae", torch_dtype=torch.float32).eval())
        torch.manual_seed(cfg["seed"])
        with torch.no_grad():  # SD3 normalises latents as (z - shift) * scale; measure both here
            x, _ = render_batch("train", np.arange(10_000_000, 10_000_512))
            z = vae.encode(x).latent_dist.sample()
        vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))
        vae.save_pretrained(work / "vae", safe_serialization=True)
    vae = AutoencoderKL.from_pretrained(work / "vae", torch_dtype=torch.float32).eval()
    if not (work / "text_encoder" / "config.json").exists():
        conf = json.loads((src / "text_encoder" / "config.json").read_text())
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "layer_norm_eps")
        te1 = text_encoder_with_projection({k: conf[k] for k in keep}, load_file(src / "text_encoder" / "model.safetensors"))
        round_fp16_(te1).save_pretrained(work / "text_encoder", safe_serialization=True)
    te1 = CLIPTextModelWithProjection.from_pretrained(work / "text_encoder", torch_dtype=torch.float32).eval()

    cache = work / "latents.npz"
    if cache.exists():
        data = np.load(cache)
        means, stds = data["means"], data["stds"]
        captions = json.loads((work / "captions.json").read_text())
    else:
        torch.manual_seed(cfg["seed"])
        means, stds, captions = encode_scenes(vae, cfg["transformer"]["num_scenes"])
        np.savez(cache, means=means, stds=stds)
        (work / "captions.json").write_text(json.dumps(captions))
    L = tokenizer.model_max_length
    ids_all = tokenizer(captions, padding="max_length", max_length=L, truncation=True, return_tensors="np").input_ids

    if not (work / "text_encoder_2" / "config.json").exists():
        torch.manual_seed(cfg["seed"] + 2)
        c1 = te1.config
        te2 = text_encoder_with_projection({
            **cfg["text_encoder_2"], "vocab_size": c1.vocab_size, "max_position_embeddings": c1.max_position_embeddings,
            "bos_token_id": c1.bos_token_id, "eos_token_id": c1.eos_token_id, "pad_token_id": c1.pad_token_id,
        }).train()
        head = ParseHead(te2.config.projection_dim)
        targets = caption_slot_targets(range(len(captions)))
        pretrain_parse(_Pooled(te2), head, ids_all, targets, {**cfg["text_parse"], "seed": cfg["seed"]},
                       work / "parse_log.jsonl")
        round_fp16_(te2.eval()).save_pretrained(work / "text_encoder_2", safe_serialization=True)
    te2 = CLIPTextModelWithProjection.from_pretrained(work / "text_encoder_2", torch_dtype=torch.float32).eval()
    for m in (vae, te1, te2):
        m.requires_grad_(False)
    empty_ids = tokenizer([""], padding="max_length", max_length=L, return_tensors="np").input_ids
    return vae, te1, te2, tokenizer, means, stds, ids_all, empty_ids


def make_transformer(cfg: dict, latent_channels: int, latent_size: int, joint_dim: int, pooled_dim: int):
    from diffusers import SD3Transformer2DModel

    tc = cfg["transformer"]
    width = tc["attention_head_dim"] * tc["num_attention_heads"]
    return SD3Transformer2DModel(
        sample_size=latent_size, patch_size=tc["patch_size"], in_channels=latent_channels,
        out_channels=latent_channels, num_layers=tc["num_layers"], attention_head_dim=tc["attention_head_dim"],
        num_attention_heads=tc["num_attention_heads"], joint_attention_dim=joint_dim,
        caption_projection_dim=width, pooled_projection_dim=pooled_dim,
        pos_embed_max_size=latent_size // tc["patch_size"],
    )


def make_pipeline(cfg: dict, work: Path, transformer, vae, te1, te2):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTokenizer

    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**cfg["scheduler"]), vae=vae,
        text_encoder=te1, tokenizer=CLIPTokenizer.from_pretrained(work / "tokenizer"),
        text_encoder_2=te2, tokenizer_2=CLIPTokenizer.from_pretrained(work / "tokenizer_2"),
        text_encoder_3=None, tokenizer_3=None,
    )


def generate_torch(pipe, captions: list[str], seeds: list[int], steps: int, guidance: float, t5_tokens: int,
                   batch: int = 32) -> np.ndarray:
    """uint8 images from the diffusers pipeline; per-item initial latents as `onnxdiffusion evaluate` draws them."""
    from onnxdiffusion.evaluate.run import item_latents

    c = pipe.transformer.config
    shape = (c.in_channels, c.sample_size, c.sample_size)
    out = []
    for s in range(0, len(captions), batch):
        lat = torch.from_numpy(item_latents(shape, seeds[s : s + batch]))
        img = pipe(prompt=captions[s : s + batch], num_inference_steps=steps, guidance_scale=guidance, latents=lat,
                   height=c.sample_size * pipe.vae_scale_factor, width=c.sample_size * pipe.vae_scale_factor,
                   max_sequence_length=t5_tokens, output_type="np").images
        out.append((np.clip(img, 0, 1) * 255).round().astype(np.uint8))
    return np.concatenate(out)


def evaluate_torch(pipe, count: int, guidance: float, steps: int, t5_tokens: int, split: str = "heldout") -> dict:
    from onnxdiffusion.evaluate import scenes as S
    from onnxdiffusion.evaluate.judge import Judge
    from onnxdiffusion.evaluate.run import evaluate_images

    scs = S.scenes(split, count)
    images = generate_torch(pipe, [s.caption for s in scs], list(range(count)), steps, guidance, t5_tokens)
    r = evaluate_images(images, scs, Judge.from_file(threads=1))
    return {k: r[k] for k in ("attribute_accuracy", "strict_accuracy", "frechet_distance")} | {"_images": images}


def save_checkpoint(work: Path, model, ema, opt, step: int, gen: np.random.Generator) -> None:
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"ema.{k}": v for k, v in ema.state_dict().items()}
    opt_state = opt.state_dict()
    for i, st in opt_state["state"].items():
        tensors |= {f"opt.{i}.{k}": v.reshape(-1) if v.dim() == 0 else v for k, v in st.items()}
    tensors["torch_rng"] = torch.get_rng_state()
    save_file({k: v.contiguous() for k, v in tensors.items()}, work / "ckpt.tmp.safetensors")
    meta = {"step": step, "numpy_rng": gen.bit_generator.state, "param_groups": opt_state["param_groups"]}
    (work / "ckpt.tmp.json").write_text(json.dumps(meta))
    (work / "ckpt.tmp.safetensors").replace(work / "ckpt.safetensors")
    (work / "ckpt.tmp.json").replace(work / "ckpt.json")
    ema.save_pretrained(work / "transformer", safe_serialization=True)


def load_checkpoint(work: Path, model, ema, opt, gen: np.random.Generator) -> int:
    t = load_file(work / "ckpt.safetensors")
    meta = json.loads((work / "ckpt.json").read_text())
    model.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
    ema.load_state_dict({k[4:]: v for k, v in t.items() if k.startswith("ema.")})
    state: dict = {}
    for k, v in t.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            state.setdefault(int(i), {})[name] = v.reshape(()) if name == "step" else v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(t["torch_rng"])
    gen.bit_generator.state = meta["numpy_rng"]
    return meta["step"]


def train(cfg: dict, work: Path, max_minutes: float | None) -> None:
    tc, t5 = cfg["transformer"], cfg["t5_tokens"]
    vae, te1, te2, _, means, stds, ids_all, empty_ids = prepare(cfg, work)
    joint = te1.config.hidden_size + te2.config.hidden_size
    pooled_dim = te1.config.projection_dim + te2.config.projection_dim
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    torch.manual_seed(cfg["seed"] + 1)
    model = make_transformer(cfg, means.shape[1], means.shape[2], joint, pooled_dim)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    model.set_attn_processor(NullTokenJointAttention(t5))  # the t5 zero tokens as one (exact, see class)
    opt = torch.optim.AdamW(model.parameters(), lr=tc["lr"], weight_decay=0.01)
    gen = np.random.default_rng([cfg["seed"], 7])
    step = load_checkpoint(work, model, ema, opt, gen) if (work / "ckpt.json").exists() else 0
    if step:
        print("resumed at step", step)
    nparams = sum(p.numel() for p in model.parameters())
    (work / "model_info.json").write_text(json.dumps({"transformer_params": nparams, "joint_attention_dim": joint,
                                                      "pooled_projection_dim": pooled_dim}))
    with torch.no_grad():
        uncond_ctx, uncond_pooled = encode(te1, te2, torch.from_numpy(empty_ids), 1, joint)
    pipe = make_pipeline(cfg, work, ema, vae, te1, te2)
    log, elog = work / "train_log.jsonl", work / "eval_log.jsonl"
    t0 = last_ckpt = time.time()
    end = tc.get("stop_at", tc["steps"])  # the shipped run stopped early in its LR decay (session deadline)
    bar = tqdm(range(step, end), desc="mmdit", mininterval=10, initial=step, total=end)
    model.train()
    for step in bar:
        lr = tc["lr"] * min(1.0, (step + 1) / tc["warmup"])  # constant after warm-up, then a cosine to 0
        if step >= tc["decay_start"]:
            lr *= 0.5 * (1 + math.cos(math.pi * (step - tc["decay_start"]) / (tc["steps"] - tc["decay_start"])))
        for gr in opt.param_groups:
            gr["lr"] = lr
        idx = gen.integers(0, len(means), tc["batch_size"])
        drop = torch.from_numpy(gen.random(tc["batch_size"]) < tc["uncond_prob"])
        with torch.no_grad():
            ctx, pooled = encode(te1, te2, torch.from_numpy(ids_all[idx]), 1, joint)
            ctx = torch.where(drop[:, None, None], uncond_ctx, ctx)
            pooled = torch.where(drop[:, None], uncond_pooled, pooled)
        mu, sd = torch.from_numpy(means[idx]), torch.from_numpy(stds[idx])
        x0 = posterior_sample(mu, sd, scale, shift)
        noise = torch.randn_like(x0)
        sigma = torch.sigmoid(tc["logit_mean"] + tc["logit_std"] * torch.randn(len(x0)))  # SD3 logit-normal
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pred = model(hidden_states=xt, encoder_hidden_states=ctx, pooled_projections=pooled,
                     timestep=sigma * cfg["scheduler"]["num_train_timesteps"]).sample
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(tc["ema_decay"], (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.lerp_(p, 1 - decay)
        done = step + 1
        if step % 25 == 0:
            bar.set_postfix(loss=f"{float(loss):.4f}")
            log_line(log, {"step": step, "loss": float(loss), "grad_norm": float(gnorm), "lr": lr,
                           "time": round(time.time() - t0, 1)})
        evaluate_now = done % tc["eval_every"] == 0 or done == end
        out_of_time = max_minutes is not None and time.time() - t0 > max_minutes * 60
        if evaluate_now or out_of_time or time.time() - last_ckpt > 60 * tc["checkpoint_minutes"]:
            save_checkpoint(work, model, ema, opt, done, gen)
            (work / "progress.json").write_text(json.dumps({"step": done, "seconds": round(time.time() - t0)}))
            last_ckpt = time.time()
        if evaluate_now:
            te = time.time()
            rec = {"step": done}
            for g in tc["eval_guidance"]:
                r = evaluate_torch(pipe, tc["eval_count"], g, cfg["sampling"]["steps"], t5)
                r.pop("_images")
                rec[f"g{g}"] = {k: round(v, 4) for k, v in r.items()}
            rec["eval_seconds"] = round(time.time() - te, 1)
            log_line(elog, rec)
            print("eval", json.dumps(rec), flush=True)
        if out_of_time:
            print(f"stopping at step {done}: --max-minutes reached")
            return
    (work / "done.json").write_text(json.dumps({"step": end, "seconds": round(time.time() - t0)}))


def assemble(cfg: dict, work: Path, out: Path) -> None:
    """Standard StableDiffusion3Pipeline folder (float32; to_fp16.py then stores it in float16)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    f32 = {"torch_dtype": torch.float32}
    pipe = make_pipeline(
        cfg, work, SD3Transformer2DModel.from_pretrained(work / "transformer", **f32),
        AutoencoderKL.from_pretrained(work / "vae", **f32),
        CLIPTextModelWithProjection.from_pretrained(work / "text_encoder", **f32),
        CLIPTextModelWithProjection.from_pretrained(work / "text_encoder_2", **f32),
    )
    save_folder(pipe, out)
    print("wrote", out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--stage", choices=["train", "assemble"], required=True)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-minutes", type=float, default=None, help="checkpoint and stop after this long")
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    torch.set_num_threads(cfg["threads"])
    work = Path(args.work or f"runs/{cfg['name']}")
    work.mkdir(parents=True, exist_ok=True)
    if args.stage == "train":
        train(cfg, work, args.max_minutes)
    else:
        assemble(cfg, work, Path(args.out or f"models/{cfg['name']}"))


if __name__ == "__main__":
    main()
