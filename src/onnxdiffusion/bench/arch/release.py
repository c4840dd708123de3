"""Release-size Z-Image-Turbo (6B) and FLUX.2 [klein] 4B pipelines with random weights (`bench --arch zimage`,
`--arch flux2_klein`), written tensor by tensor so a 6B backbone beside its 4B text encoder builds in bounded memory.

The backbone and the text encoder are never instantiated: their shapes come from the meta device and each
safetensors shard (<= 1 GiB of bf16) is drawn and written alone (the peak is one shard, not the model). The VAE,
tokenizer and scheduler are real (small). Weights are bf16, as released; `onnxdiffusion export` widens them.

Configs are the released config.json values: the transformers' as experiments/families/fullsize_export.py
(Z-Image-Turbo's axes_lens), the text encoder Qwen3-4B for both (Z-Image reads hidden state -2, klein stacks layers
9, 18 and 27 into its 7680-wide context), the VAEs FLUX.1's (Z-Image) and FLUX.2's (klein, 32 latent channels).

`depth` overrides the backbone's block counts (Z-Image: main, refiner; klein: double, single); `encoder` picks the
text encoder: None = Qwen3-4B at release size (36 layers, its 151936-token embedding), or N = N layers of the release
width 2560 with narrow internals (2 heads, MLP 64; klein needs N >= 28) for proof runs that fit 3 GB.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SHARD_BYTES = 2**30
POOL = 64 * 2**20  # values drawn once and sliced: drawing 10 billion normals on 2 shared cores takes most of an hour

# backbone class, config(depth), released depth
BACKBONES = {
    "zimage": ("ZImageTransformer2DModel", lambda d: dict(
        all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=int(d[0]),
        n_refiner_layers=int(d[1]), n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
        rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512]), (30, 2)),
    "flux2_klein": ("Flux2Transformer2DModel", lambda d: dict(
        patch_size=1, in_channels=128, num_layers=int(d[0]), num_single_layers=int(d[1]), attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, eps=1e-6, guidance_embeds=False), (5, 20)),
}
# Qwen3-4B's config.json (both pipelines' text encoder)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
NARROW = dict(intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
# the deepest hidden state each pipeline reads (Z-Image: -2 of any depth; klein: layer 27)
MIN_ENCODER_LAYERS = {"zimage": 2, "flux2_klein": 28}
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def backbone_config(arch: str, depth) -> tuple[str, dict]:
    name, config, _ = BACKBONES[arch]
    return name, config(depth)


def encoder_config(arch: str, layers: int | None, vocab: int) -> dict:
    """Qwen3-4B (layers None), or `layers` narrow layers at its width (proof runs; the tokenizer's vocabulary)."""
    if layers is None:
        return dict(QWEN3_4B)
    if layers < MIN_ENCODER_LAYERS[arch]:
        from ...errors import UserError

        raise UserError(f"--arch {arch}: the pipeline reads text-encoder layer {MIN_ENCODER_LAYERS[arch] - 1}; "
                        f"give at least {MIN_ENCODER_LAYERS[arch]} encoder layers")
    return {**QWEN3_4B, **NARROW, "num_hidden_layers": int(layers), "vocab_size": vocab}


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    from ...evaluate import scenes

    words = scenes.vocabulary()
    corpus = [" ".join(words[i:i + 6]) for i in range(0, len(words), 3)] + ["a photo of a cat"]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = Qwen2TokenizerFast(tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                              pad_token="<|endoftext|>", model_max_length=512)
    fast.chat_template = QWEN3_TEMPLATE
    fast.save_pretrained(folder)
    return Qwen2TokenizerFast.from_pretrained(folder)


def _small_parts(arch: str, tmp: Path):
    """(pipeline class, VAE, scheduler, tokenizer, text-encoder class name): the parts built for real."""
    import diffusers
    import torch

    tok = _tokenizer(tmp / "tok")
    if arch == "zimage":  # FLUX.1's autoencoder; Z-Image-Turbo's scheduler_config.json
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
            norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
            use_post_quant_conv=False)
        sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                                          use_dynamic_shifting=False)
        return diffusers.ZImagePipeline, vae, sched, tok, "Qwen3Model"
    vae = diffusers.AutoencoderKLFlux2()  # FLUX.2's autoencoder (its defaults are the release's)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # per-channel latent statistics: drawn, not the identity
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=gen) * 0.3)
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=gen) * 2 + 0.3)
    sched = diffusers.FlowMatchEulerDiscreteScheduler(  # FLUX.2's scheduler_config.json
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")
    return diffusers.Flux2KleinPipeline, vae, sched, tok, "Qwen3ForCausalLM"


def _random(name: str, shape, gen, pool=None):
    """Norm weights 1, biases 0, the rest N(0, 0.02) bf16: sliced from `pool` at a drawn offset, or (no pool) drawn
    for the tensor itself."""
    import torch

    if len(shape) == 1 and ("norm" in name or name.endswith("running_var")):
        return torch.ones(shape, dtype=torch.bfloat16)
    if len(shape) == 1 and name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if pool is None:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    n = int(torch.Size(shape).numel())
    start = int(torch.randint(0, POOL, (1,), generator=gen))
    reps = (start + n + POOL - 1) // POOL
    flat = pool.repeat(reps)[start:start + n] if reps > 1 else pool[start:start + n]
    return flat.clone().reshape(shape)


def write_random(meta, out: Path, weights: str, index: str, skip: tuple[str, ...] = (), seed: int = 0,
                 shard_bytes: int = SHARD_BYTES, pooled: bool = True) -> int:
    """`meta`'s state (a module on the meta device) as random bf16 safetensors shards of at most `shard_bytes` under
    `out`, one shard's tensors in memory at a time, with the sharded-checkpoint index both libraries read (values
    sliced from one drawn pool, or drawn per tensor when not `pooled`); returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    shapes = [(n, tuple(t.shape)) for n, t in meta.state_dict().items() if n not in skip]
    plan, size = [[]], 0
    for name, shape in shapes:
        nbytes = 2 * int(torch.Size(shape).numel())
        if plan[-1] and size + nbytes > shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=gen) * 0.02).to(torch.bfloat16) if pooled else None
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    stem, ext = weights.rsplit(".", 1)
    for i, names in enumerate(plan):
        file = f"{stem}-{i + 1:05d}-of-{len(plan):05d}.{ext}"
        save_file({n: _random(n, s, gen, pool) for n, s in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n, _ in names})
    params = sum(int(torch.Size(s).numel()) for _, s in shapes)
    (out / index).write_text(json.dumps({"metadata": {"total_size": 2 * params}, "weight_map": weight_map}, indent=1))
    return params


def build(arch: str, folder: Path, depth=None, encoder_layers: int | None = None) -> dict:
    """The diffusers folder at `folder` (staged beside it, renamed when complete); returns its description."""
    import tempfile

    import diffusers
    import torch
    import transformers
    from accelerate import init_empty_weights

    name, _, released = BACKBONES[arch]
    depth = tuple(released if depth is None else depth)
    torch.manual_seed(0)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="release-tok-") as tmp:
        pipe_cls, vae, sched, tok, te_class = _small_parts(arch, Path(tmp))
        # klein 4B is the step-distilled release (no CFG pass: guidance is baked in)
        extra = {"is_distilled": True} if arch == "flux2_klein" else {}
        pipe = pipe_cls(scheduler=sched, vae=vae, text_encoder=None, tokenizer=tok, transformer=None, **extra)
        pipe.save_pretrained(staging, safe_serialization=True)
    te_cfg = transformers.Qwen3Config(**encoder_config(arch, encoder_layers, len(tok)))
    with init_empty_weights():
        backbone = getattr(diffusers, name)(**backbone_config(arch, depth)[1])
        encoder = getattr(transformers, te_class)(te_cfg)
    backbone.save_config(staging / "transformer")
    te_cfg.torch_dtype = "bfloat16"
    te_cfg.save_pretrained(staging / "text_encoder")
    params = write_random(backbone, staging / "transformer", "diffusion_pytorch_model.safetensors",
                          "diffusion_pytorch_model.safetensors.index.json", seed=1)
    te_params = write_random(encoder, staging / "text_encoder", "model.safetensors", "model.safetensors.index.json",
                             skip=("lm_head.weight",) if te_cfg.tie_word_embeddings else (), seed=2)
    index = json.loads((staging / "model_index.json").read_text())
    index["transformer"], index["text_encoder"] = ["diffusers", name], ["transformers", te_class]
    (staging / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    desc = {"arch": arch, "profile": "release", "backbone_class": name, "backbone_depth": list(depth),
            "released_depth": list(released), "backbone_params": params, "encoder_params": te_params,
            "encoder_layers": te_cfg.num_hidden_layers, "encoder": "Qwen3-4B" if encoder_layers is None else "narrow",
            "backbone_config": backbone_config(arch, depth)[1]}
    (staging / "fullwidth.json").write_text(json.dumps(desc, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return desc
