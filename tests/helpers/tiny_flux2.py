"""Tiny random-weight FLUX.2 pipelines ([klein] and [dev]), built offline (nothing from the hub).

Configs unlike diffusers' own tests (tests/pipelines/flux2): 4 latent channels, a VAE factor of 2, one double and
two single blocks, 4 rotary axes of unequal widths, text lengths of 40 and 96 tokens, and batch-norm statistics that are
not the identity (so undoing them is exercised). The language models are as deep as the layers the pipelines read
(27 for Qwen3, 30 for Mistral) but 16 wide. Tokenizers are byte-level BPEs trained in memory with the chat special
tokens, and chat templates that render the way the real ones do for these messages.
"""

from __future__ import annotations

from pathlib import Path

TEXT_LENGTH = 40
DEV_TEXT_LENGTH = 96  # the [dev] system prompt alone is ~40 tokens here
# Qwen3's template for one user message, generation prompt, thinking off
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Mistral Small 3's template for a system and a user message whose content is a list of text parts
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{ '[INST]' + message['content'][0]['text'] + '[/INST]' }}{%- endif %}"
    "{%- endfor %}"
)


def _bpe(special: list[str], extra_text: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tiny_families import _corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus() + extra_text, trainer)
    return tok


def qwen3_tokenizer():
    from transformers import Qwen2TokenizerFast

    tok = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], [])
    out = Qwen2TokenizerFast(tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", model_max_length=TEXT_LENGTH)
    out.chat_template = QWEN3_TEMPLATE
    return out


def mistral_processor():
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
               "[IMG_BREAK]", "[IMG_END]"]
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(special, [SYSTEM_MESSAGE]), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>", model_max_length=DEV_TEXT_LENGTH)
    return PixtralProcessor(image_processor=PixtralImageProcessor(patch_size={"height": 4, "width": 4}), tokenizer=tok,
                            patch_size=4, spatial_merge_size=1, chat_template=MISTRAL_TEMPLATE)


def flux2_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.2's scheduler_config.json (dynamic shifting with an exponential time shift)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, time_shift_type="exponential")


def _vae():
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        latent_channels=4, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )
    gen = torch.Generator().manual_seed(2)
    vae.bn.running_mean.copy_(torch.randn(16, generator=gen) * 0.3)
    vae.bn.running_var.copy_(torch.rand(16, generator=gen) * 2 + 0.3)
    return vae.eval()


def _transformer(guidance: bool):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=48, timestep_guidance_channels=32, mlp_ratio=2.0, axes_dims_rope=(2, 4, 6, 4),
        rope_theta=2000, guidance_embeds=guidance,
    )


def build_tiny_flux2_klein(folder: Path) -> Path:
    """Flux2KleinPipeline (base, not distilled: true CFG): a 28-layer Qwen3ForCausalLM of width 16."""
    import torch
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    tokenizer = qwen3_tokenizer()
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24, num_hidden_layers=28, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=256, rope_theta=1000000.0, tie_word_embeddings=True,
    )).eval()
    pipe = Flux2KleinPipeline(scheduler=flux2_scheduler(), vae=_vae(), text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=_transformer(False), is_distilled=False)
    out = folder / "flux2_klein"
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_flux2_dev(folder: Path) -> Path:
    """Flux2Pipeline: a Mistral3ForConditionalGeneration whose language model is 31 layers of width 16."""
    import torch
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    processor = mistral_processor()
    vocab = len(processor.tokenizer)
    config = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": vocab, "hidden_size": 16, "intermediate_size": 24,
                     "num_hidden_layers": 31, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "max_position_embeddings": 256, "sliding_window": None, "rope_theta": 1000000000.0},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 32, "patch_size": 4},
        image_token_index=processor.tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1,
    )
    text_encoder = Mistral3ForConditionalGeneration(config).eval()
    pipe = Flux2Pipeline(scheduler=flux2_scheduler(), vae=_vae(), text_encoder=text_encoder, tokenizer=processor,
                         transformer=_transformer(True))
    out = folder / "flux2_dev"
    pipe.save_pretrained(out, safe_serialization=True)
    return out
