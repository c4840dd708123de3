"""The export wrapper of FLUX.2's transformer (families/flux2.py declares it).

`Flux2Transformer`: packed latent tokens, the table's timestep, the stacked text hidden states, 4-axis image
ids (batched like every conditioning input; the text ids (0, 0, 0, k) are made in the graph), and for [dev]
the embedded guidance scale. diffusers' `apply_rotary_emb` unpacks `x.shape` into Python ints, which the
tracer bakes in, so both attention processors are replaced by ones rotating on (cos, sin) pairs.
The text encoders are export/llm_text_encoder.py's (layers 9/18/27 or 10/20/30 side by side, positions 0..L-1).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .rope import rotate_pairs


def _pairs(rotary):
    # the tables repeat each pair's angle twice along D (repeat_interleave_real): keep one per pair
    return tuple(t[:, 0::2].to(torch.float32) for t in rotary)


def _attend(q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2).to(q.dtype)


class _JointAttention:
    """Flux2AttnProcessor (double-stream blocks) with the rotation on (cos, sin) pairs."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

        q, k, v, tq, tk, tv = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)

        def heads(x):
            return x.unflatten(-1, (attn.heads, -1))

        q, k, v = attn.norm_q(heads(q)), attn.norm_k(heads(k)), heads(v)
        joint = attn.added_kv_proj_dim is not None
        if joint:
            q = torch.cat([attn.norm_added_q(heads(tq)), q], dim=1)
            k = torch.cat([attn.norm_added_k(heads(tk)), k], dim=1)
            v = torch.cat([heads(tv), v], dim=1)
        if image_rotary_emb is not None:
            cos, sin = _pairs(image_rotary_emb)
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = _attend(q, k, v)
        if not joint or encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        seq_txt = encoder_hidden_states.shape[1]
        img = attn.to_out[1](attn.to_out[0](out[:, seq_txt:]))
        return img, attn.to_add_out(out[:, :seq_txt])


class _ParallelAttention:
    """Flux2ParallelSelfAttnProcessor (single-stream blocks: fused QKV + MLP in) with the rotation on pairs."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        h = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = torch.split(h, [3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor], dim=-1)
        q, k, v = (x.unflatten(-1, (attn.heads, -1)) for x in qkv.chunk(3, dim=-1))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            cos, sin = _pairs(image_rotary_emb)
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = _attend(q, k, v)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class Flux2Transformer(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.guidance = bool(model.config.guidance_embeds)
        for block in model.transformer_blocks:
            block.attn.set_processor(_JointAttention())
        for block in model.single_transformer_blocks:
            block.attn.set_processor(_ParallelAttention())
        # called through the module (so the exporter scopes its nodes /model/..., as LoRA points read them)
        model.forward = types.MethodType(_split_stream_forward, model)

    def forward(self, sample, timestep, encoder_hidden_states, img_ids, *rest):
        guidance, reference, reference_ids = rest if self.guidance else (None, *rest)
        # text ids (0, 0, 0, k), k = 0..L-1 (the pipelines' _prepare_text_ids)
        seq = torch.arange(encoder_hidden_states.shape[1], dtype=img_ids.dtype)
        txt_ids = torch.cat([torch.zeros(seq.shape[0], 3, dtype=img_ids.dtype), seq[:, None]], dim=1)
        # reference tokens (none without a picture) follow the noise tokens; the output is cut back to the latter
        hidden = torch.cat([sample, reference], dim=1)
        ids = torch.cat([img_ids, reference_ids], dim=1)[0]
        # the table's timestep is sigma * 1000; the pipelines hand the transformer t / 1000 (it multiplies back)
        out = self.model(hidden, encoder_hidden_states, timestep / 1000, ids, txt_ids, guidance)
        return out[:, : sample.shape[1]]


def _split_stream_forward(m, hidden, text, timestep, img_ids, txt_ids, guidance):
    """Flux2Transformer2DModel.forward (no KV cache), except that each single-stream block takes the text and image
    streams apart and returns them apart (its own split_hidden_states): the same numbers, but the blocks' image
    stream is a tensor of its own, as in FLUX.1, which step caching follows across the blocks."""
    timestep = timestep.to(hidden.dtype) * 1000
    guidance = None if guidance is None else guidance.to(hidden.dtype) * 1000
    temb = m.time_guidance_embed(timestep, guidance)
    mod_img, mod_txt = m.double_stream_modulation_img(temb), m.double_stream_modulation_txt(temb)
    mod_single = m.single_stream_modulation(temb)
    hidden, text = m.x_embedder(hidden), m.context_embedder(text)
    img_rot, txt_rot = m.pos_embed(img_ids), m.pos_embed(txt_ids)
    rotary = (torch.cat([txt_rot[0], img_rot[0]], dim=0), torch.cat([txt_rot[1], img_rot[1]], dim=0))
    for block in m.transformer_blocks:
        text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, temb_mod_img=mod_img,
                             temb_mod_txt=mod_txt, image_rotary_emb=rotary)
    for block in m.single_transformer_blocks:
        text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, temb_mod=mod_single,
                             image_rotary_emb=rotary, split_hidden_states=True)
    return m.proj_out(m.norm_out(hidden, temb))
