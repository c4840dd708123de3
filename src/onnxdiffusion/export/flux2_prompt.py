"""What a FLUX.2 folder's manifest records beyond its JSON configs: the chat template as a format string, and
the VAE's batch-norm running statistics (weights, not config)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..families.flux2 import Flux2Base


def _messages(family: Flux2Base, prompt: str) -> list[dict]:
    if family.embedded_guidance:  # [dev]: format_input's system + user messages, content as lists
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        return [{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                {"role": "user", "content": [{"type": "text", "text": prompt}]}]
    return [{"role": "user", "content": prompt}]


def _render(family: Flux2Base, tok, prompt: str) -> str:
    if family.embedded_guidance:
        return tok.apply_chat_template([_messages(family, prompt)], tokenize=False, add_generation_prompt=False)[0]
    return tok.apply_chat_template(_messages(family, prompt), tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)


def _load_tokenizer(folder: Path):
    import transformers

    try:  # a processor renders its own chat template; a plain tokenizer folder has one of its own
        return transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, ImportError, AttributeError):
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


def prompt_template(family: Flux2Base, folder: Path) -> str:
    """The pipeline's chat-templated prompt as a str.format template with one `{}` (llm_text_encoder.prompt_format,
    the renderer Z-Image's slot template goes through too); the run time formats the prompt in, as the pipeline
    renders it per prompt."""
    from .llm_text_encoder import prompt_format

    try:
        tok = _load_tokenizer(folder)
        _render(family, tok, "x")  # a template that does not render at all: one line saying why
    except (OSError, ValueError, TypeError, ImportError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{folder}: cannot render the tokenizer's chat template: {first}") from None
    try:
        return prompt_format(lambda prompt: _render(family, tok, prompt))
    except ValueError as e:
        raise UserError(f"{folder}: {e}") from None


def vae_batch_norm(folder: Path) -> dict:
    """The VAE's `bn` running mean and variance (per patch channel), which the pipelines undo before decoding."""
    import diffusers

    try:
        vae = diffusers.AutoencoderKLFlux2.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load {folder}: {first}") from None
    mean, var = vae.bn.running_mean.float().tolist(), vae.bn.running_var.float().tolist()
    return {"vae_bn_mean": mean, "vae_bn_var": var}
