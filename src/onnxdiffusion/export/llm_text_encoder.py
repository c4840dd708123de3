"""A decoder-only language model as a text encoder: one KV-free pass returning the hidden layer(s) a
diffusion pipeline reads, under a padding mask.

The pipelines of 2025-26 condition on an LLM's hidden states instead of a CLIP/T5 output: Qwen-Image reads
the last one (after the final norm), Z-Image `hidden_states[-2]` (the input of the last layer), FLUX.2
[klein] layers 9/18/27 side by side. Layers are numbered as transformers' `output_hidden_states` tuple:
0 is the token embeddings, k (1..n) the output of decoder layer k, and n, the last, is the final norm's
output; negative indices count from that end (-1 = n, -2 = n - 1).

Only the layers up to the deepest one read are run, and the others are dropped from the module before
tracing (the final norm too unless entry n is read), so their weights never reach the ONNX file: Z-Image's
encoder exports without its last layer, FLUX.2 [klein]'s without the layers after 27.

transformers builds causal masks with vmap, which the tracer cannot follow, so the causal + padding mask is
built here in plain tensor ops and handed over pre-made, as a 4-D additive mask (transformers' mask builders
return such a mask as they find it; Mistral, unlike Qwen, takes no {"full_attention": mask} mapping). Position ids: `positions="arange"` is what a plain text LM uses when none
are given (0..L-1 for every row, padding included); `positions="mask"` numbers the kept tokens only, the
way Qwen2.5-VL's `get_rope_index` numbers text-only input (`rope_axes` copies for its 3D rotary). For the
tokens the mask keeps, with right padding, the two agree; they differ on the padding tokens, which matters
to a pipeline that hands padding to its backbone.
"""

from __future__ import annotations

import torch

POSITIONS = ("mask", "arange")


def hidden_index(layer: int, n_layers: int) -> int:
    """A hidden-states index (negative from the end) -> 0..n_layers, as `output_hidden_states` numbers them."""
    k = layer + n_layers + 1 if layer < 0 else layer
    if not 0 <= k <= n_layers:
        raise ValueError(f"hidden layer {layer} is outside a {n_layers}-layer model's 0..{n_layers} (or -{n_layers + 1}..-1)")
    return k


class DecoderHiddenStates(torch.nn.Module):
    """input_ids, attention_mask -> the hidden states of `layers` ((-1,): the last, after the final norm),
    concatenated on the last axis in the order given when there are several.

    `model` is the decoder stack itself (transformers' `*Model`: `.layers`, `.norm`, `config.num_hidden_layers`),
    not a `*ForCausalLM`: the LM head is never part of a text encoder."""

    def __init__(self, model, rope_axes: int = 1, layers: tuple[int, ...] = (-1,), positions: str = "mask"):
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        n = int(model.config.num_hidden_layers)
        self.index = tuple(hidden_index(int(k), n) for k in layers)
        if not self.index:
            raise ValueError("no hidden layer asked for")
        deepest = max(self.index)
        if deepest < n:  # the layers after the deepest read, and the final norm, never run: drop them
            model.layers = model.layers[:deepest]
            model.config.num_hidden_layers = deepest
            model.norm = torch.nn.Identity()
        self.model, self.rope_axes, self.positions = model, rope_axes, positions
        # one layer read: it is the (truncated) stack's last_hidden_state; several: the recorded tuple
        self.several = len(self.index) > 1

    def forward(self, input_ids, attention_mask):
        keep = attention_mask.to(torch.bool)
        seq = input_ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
        allowed = causal[None, None] & keep[:, None, None, :]
        mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
        if self.positions == "mask":
            pos = (attention_mask.to(torch.int64).cumsum(-1) - 1).masked_fill(~keep, 1)
        else:
            pos = torch.ones_like(input_ids, dtype=torch.int64).cumsum(-1) - 1
        if self.rope_axes > 1:
            pos = pos[None].expand(self.rope_axes, -1, -1)
        record = {"output_hidden_states": True} if self.several else {}
        # a 4-D mask is taken as is by every decoder here; the {"full_attention": mask} mapping is not (Mistral)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos,
                         use_cache=False, return_dict=True, **record)
        if not self.several:
            return out.last_hidden_state
        return torch.cat([out.hidden_states[k] for k in self.index], dim=-1)


def decoder_stack(module):
    """The decoder stack of a transformers LM as loaded: a `*Model` itself, `.model` of a `*ForCausalLM`, or
    `.model.language_model` of a vision-language model (Qwen2.5-VL)."""
    inner = getattr(module, "model", module)
    return getattr(inner, "language_model", inner)


def chat_prompt_template(tokenizer, options: tuple[tuple[str, object], ...]) -> str:
    """The tokenizer's chat template rendered around one user message (TextEncoderSlot.chat_template: `options`,
    the pipeline's apply_chat_template keyword arguments: add_generation_prompt, enable_thinking, ...), as
    prompt_format's template."""
    return prompt_format(lambda prompt: tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                                      tokenize=False, **dict(options)))


def prompt_format(render) -> str:
    """`render(prompt)` -> the pipeline's chat-templated text, as a `str.format` template with one {} where the
    prompt goes (the run time formats it without transformers or jinja): rendered once with a marker in the
    prompt's place; a template that does not place it exactly once, or whose own text depends on the prompt
    (one format string could not serve), is a ValueError. The one renderer of every chat-template encoder
    (export/pipeline.py's slots, FLUX.2's prompt in export/flux2_prompt.py)."""
    marker = "\u2063PROMPT\u2063"  # invisible separators: no chat template writes them
    text = render(marker)
    if not isinstance(text, str) or text.count(marker) != 1:
        raise ValueError("the chat template does not place the prompt exactly once")
    head, tail = text.split(marker)
    if render("x") != head + "x" + tail:
        raise ValueError("the chat template's text depends on the prompt; not supported")
    return "{}".join(part.replace("{", "{{").replace("}", "}}") for part in (head, tail))
