"""Tiny random-weight Flux, Qwen-Image and Z-Image pipelines, built offline (nothing from the hub).

Configs follow diffusers' own pipeline tests (tests/pipelines/flux, tests/pipelines/qwenimage):
every block type of the real model, widths of 16-32. Tokenizers are trained in memory with the
`tokenizers` library on a few sentences (CLIP: the project's own builder; T5: Unigram with
Metaspace and a `</s>` post-processor; Qwen2: byte-level BPE with the chat special tokens), then
wrapped in transformers' fast classes so diffusers loads them, and saved with a tokenizer.json
that the run-time side reads without transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Sentences the in-memory tokenizers are trained on: the scene words plus Qwen's prompt template.
QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _corpus() -> list[str]:
    from onnxdiffusion.evaluate import scenes

    words = scenes.vocabulary()
    lines = [" ".join(words[i:i + 6]) for i in range(0, len(words), 3)]
    return lines + [QWEN_TEMPLATE.format("a red circle"), "a photo of a cat, blurry, low quality"]


def t5_tokenizer(model_max_length: int):
    """A T5TokenizerFast over a trained Unigram model: pad=0, eos=1, unk=2, like T5's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import T5TokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Replace("  ", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))])
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, additional_special_tokens=[], model_max_length=model_max_length)


def qwen2_tokenizer():
    """A Qwen2TokenizerFast over a trained byte-level BPE with Qwen's chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return Qwen2TokenizerFast(tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                              pad_token="<|endoftext|>", model_max_length=2048)


def _clip(folder: Path, max_length: int, hidden: int):
    from tokenizer_build import build_tokenizer_files
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from onnxdiffusion.evaluate import scenes

    build_tokenizer_files(scenes.vocabulary() + ["photo", "cat"], folder / "_clip_tok", max_length)
    tokenizer = CLIPTokenizer.from_pretrained(folder / "_clip_tok")
    encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=max_length, projection_dim=hidden, hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    return tokenizer, encoder


def flux_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev's scheduler_config.json
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096)


@dataclass(frozen=True)
class FluxSizes:
    """A tiny FLUX.1's sizes (defaults: build_tiny_flux's; tiny_kontext.py's Kontext has its own)."""
    seed: int = 0
    width: int = 32  # the CLIP and T5 widths, the transformer's joint and pooled projections
    t5_length: int = 16
    t5_ff: int = 37
    t5_layers: int = 2
    t5_heads: int = 4
    blocks: int = 1
    single_blocks: int = 1
    head_dim: int = 16
    heads: int = 2
    axes: tuple[int, ...] = (4, 4, 8)
    vae_shift: float = 0.0609
    vae_scale: float = 1.5035
    vae_attention: bool = True  # the VAE's mid-block attention (diffusers' default)


def flux_components(folder: Path, s: FluxSizes, prepare=None) -> dict:
    """A FLUX.1 pipeline's components (FluxPipeline and FluxKontextPipeline take the same): 16 latent channels
    packed 2x2 -> 64, a guidance embedding, VAE factor 2. `prepare(transformer)`: weights set before the VAE is
    drawn (Kontext's sharpening)."""
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(s.seed)
    tokenizer, text_encoder = _clip(folder, 16, s.width)
    tokenizer_2 = t5_tokenizer(s.t5_length)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=s.width, d_kv=8, d_ff=s.t5_ff, num_layers=s.t5_layers,
        num_heads=s.t5_heads, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, out_channels=None, num_layers=s.blocks, num_single_layers=s.single_blocks,
        attention_head_dim=s.head_dim, num_attention_heads=s.heads, joint_attention_dim=s.width,
        pooled_projection_dim=s.width, guidance_embeds=True, axes_dims_rope=s.axes,
    )
    if prepare is not None:
        prepare(transformer)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=s.vae_shift, scaling_factor=s.vae_scale, mid_block_add_attention=s.vae_attention,
    )
    return dict(scheduler=flux_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


def build_tiny_flux(folder: Path, t5_length: int = 16) -> Path:
    """FluxPipeline (dev-style: guidance embedding), 16 latent channels packed 2x2 -> 64, VAE factor 2."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(**flux_components(folder, FluxSizes(t5_length=t5_length)))
    out = folder / "flux"
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_qwenimage(folder: Path, heads: int = 3) -> Path:
    """QwenImagePipeline: a 2-layer Qwen2.5-VL text encoder (width 16), a 2-layer MMDiT (`heads` x 16 wide: 2 makes
    its projections GGUF-blockable), a 3D VAE whose per-channel latents_mean/latents_std are not the identity (so
    normalization is exercised)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = qwen2_tokenizer()
    vocab = len(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0, "vocab_size": vocab + 3,
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=vocab + 3,
        vision_start_token_id=vocab, vision_end_token_id=vocab + 1, vision_token_id=vocab + 2, image_token_id=vocab + 2,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=heads,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    gen = torch.Generator().manual_seed(1)
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[round(float(v), 4) for v in torch.randn(4, generator=gen) * 0.5],
        latents_std=[round(float(v), 4) for v in torch.rand(4, generator=gen) * 2 + 0.5],
    )
    # Qwen-Image's scheduler_config.json (exponential time shift, dynamic shifting, shift_terminal)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
        invert_sigmas=False, stochastic_sampling=False, use_beta_sigmas=False, use_exponential_sigmas=False,
        use_karras_sigmas=False,
    )
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    out = folder / "qwenimage"
    pipe.save_pretrained(out, safe_serialization=True)
    return out


# Qwen3's chat template, shortened to what a one-message prompt reaches: the user turn, the generation
# prompt, and the empty think block when thinking is turned off
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_tiny_zimage(folder: Path, dim: int = 48, axes_dims: tuple[int, ...] = (8, 8, 8)) -> Path:
    """ZImagePipeline: a 3-layer Qwen3 text encoder (width 24, grouped-query attention) read at hidden state -2,
    a DiT of 2 main layers and 1 refiner each (width 48, head 24 = rotary axes 8/8/8; 64 and 12/12/8 make its
    projections GGUF-blockable) with random pad tokens,
    an AutoencoderKL of factor 4 with Z-Image's scaling and shift, and Z-Image-Turbo's scheduler_config.json."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, rope_theta=1000000.0,
    )).eval()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=dim, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=24, rope_theta=256.0, axes_dims=list(axes_dims), axes_lens=[640, 48, 48],
    )
    with torch.no_grad():  # trained pad tokens are not zero: make them matter
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.1159, scaling_factor=0.3611,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    out = folder / "zimage"
    pipe.save_pretrained(out, safe_serialization=True)
    return out
