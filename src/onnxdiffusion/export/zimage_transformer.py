"""Z-Image's transformer as one traceable graph over batched tensors.

diffusers' ZImageTransformer2DModel.forward takes Python lists (one latent and one caption per sample),
pads each to a multiple of 32 tokens with Python-side lengths, numbers rotary positions with a complex
table and rotates q/k with complex multiplies: none of it traces to a graph with dynamic sizes. This
wrapper computes the same thing on a batch:

- `sample` (B, C, h, w) -> 2x2 patch tokens (channels last within a patch, rows outer), embedded, then
  padded to a multiple of 32 with `x_pad_token` (positions (0, 0, 0)), refined by the noise refiner;
- the caption (B, S, D_text) under its mask: row i keeps its L_i tokens, its own padding up to
  P_i = ceil32(L_i) becomes `cap_pad_token` (positions 1..P_i, as diffusers numbers them) and the rest of
  the row, the batch's raggedness, is masked out of attention (diffusers pads the list the same way);
- image positions start at (P_i + 1, row, column), per row; the unified sequence is [image, caption];
- the rotary table is diffusers' own (RopeEmbedder.precompute_freqs_cis), kept as cos/sin buffers and
  gathered by integer position, so the angles are the pipeline's bit for bit; the rotation is the complex
  multiply written on (real, imaginary) pairs (export/rope.py's rotate_pairs, batched);
- the table's timestep t = 1000 sigma goes in as (1000 - t) / 1000, and the output is negated: the graph
  predicts the flow velocity the samplers expect, as ZImagePipeline's loop hands its scheduler.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

SEQ_MULTIPLE = 32


def _ceil(n: torch.Tensor) -> torch.Tensor:
    return (n + SEQ_MULTIPLE - 1) // SEQ_MULTIPLE * SEQ_MULTIPLE


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with (real, imag) interleaved on D times exp(i angle); cos/sin [B, S, D/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2).to(x.dtype)


def _additive(keep: torch.Tensor) -> torch.Tensor:
    """A [B, S] boolean key mask as the additive [B, 1, 1, S] bias attention adds (what SDPA makes of a boolean
    one), built once per sequence: built inside each layer, ONNX Runtime's optimizer merges the copies into one
    node named after a later layer, which then feeds an earlier one and defeats step caching's cut."""
    bias = torch.zeros(keep.shape, dtype=torch.float32).masked_fill(~keep, torch.finfo(torch.float32).min)
    return bias[:, None, None, :]


class _RealRotarySelfAttention:
    """ZSingleStreamAttnProcessor with `freqs_cis` given as (cos, sin) and an additive [B, 1, 1, S] key mask."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        def heads(x):
            return x.unflatten(-1, (attn.heads, -1))

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if freqs_cis is not None:
            cos, sin = freqs_cis
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attention_mask)
        out = attn.to_out[0](out.transpose(1, 2).flatten(2).to(q.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


class ZImageTransformer(torch.nn.Module):
    """sample (B, C, h, w), timestep (B,) = 1000 sigma, encoder_hidden_states (B, S, D_text), its float mask
    (B, S) -> the flow velocity (B, C, h, w).

    The batched forward is bound to the diffusers model itself, so the exporter names its nodes and weights
    under `/model/...` after diffusers' module paths, the names LoRA insertion points map back to."""

    def __init__(self, model):
        super().__init__()
        from diffusers.models.transformers.transformer_z_image import RopeEmbedder

        cfg = model.config
        if tuple(cfg.all_patch_size) != (2,) or tuple(cfg.all_f_patch_size) != (1,) or model.siglip_embedder is not None:
            raise ValueError("only 2x2 patches of one frame, without SigLIP features, are supported for export")
        tables = RopeEmbedder.precompute_freqs_cis(list(cfg.axes_dims), list(cfg.axes_lens), theta=cfg.rope_theta)
        for i, t in enumerate(tables):
            model.register_buffer(f"rope_cos{i}", t.real.contiguous(), persistent=False)
            model.register_buffer(f"rope_sin{i}", t.imag.contiguous(), persistent=False)
        for block in (*model.noise_refiner, *model.context_refiner, *model.layers):
            block.attention.set_processor(_RealRotarySelfAttention())
        model.forward = types.MethodType(_batched_forward, model)
        self.model = model

    def forward(self, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask):
        return self.model(sample, timestep, encoder_hidden_states, encoder_hidden_states_mask)


def _rope(m, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, S, 3] int64 -> (cos, sin), each [B, S, sum(axes_dims) / 2]."""
    cos = torch.cat([getattr(m, f"rope_cos{i}")[ids[..., i]] for i in range(3)], dim=-1)
    sin = torch.cat([getattr(m, f"rope_sin{i}")[ids[..., i]] for i in range(3)], dim=-1)
    return cos, sin


def _inputs(m, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask) -> types.SimpleNamespace:
    """What the transformer and its ControlNet both build before their layers: the timestep embedding, the
    embedded image tokens with their pad tokens, the embedded caption, their masks and rotary angles."""
    b, c, h, w = sample.shape
    rows, cols = h // 2, w // 2
    adaln = m.t_embedder((1000 - timestep) / 1000 * m.t_scale).type_as(sample)
    # image: 2x2 patches, (ph, pw, C) within a token, rows outer; embedded, then the pad tokens
    tokens = sample.reshape(b, c, rows, 2, cols, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, rows * cols, 4 * c)
    x = m.all_x_embedder["2-1"](tokens)
    n = rows * cols
    total = n + (-n) % SEQ_MULTIPLE
    x = torch.cat([x, m.x_pad_token.to(x.dtype).expand(b, total - n, -1)], dim=1)
    # the caption: kept tokens, then the row's pad tokens up to a multiple of 32, then masked raggedness
    kept = encoder_hidden_states_mask.to(torch.int64).sum(-1)  # L_i
    padded = _ceil(kept)  # P_i
    j = torch.arange(encoder_hidden_states.shape[1], dtype=torch.int64)
    cap = m.cap_embedder(encoder_hidden_states)
    cap = torch.where((j[None] < kept[:, None])[..., None], cap, m.cap_pad_token.to(cap.dtype))
    cap_mask = j[None] < padded[:, None]
    zeros = torch.zeros_like(j)
    cap_ids = torch.stack([j + 1, zeros, zeros], dim=-1)[None].expand(b, -1, -1)
    # image positions (P_i + 1, row, column); its pad tokens (0, 0, 0)
    k = torch.arange(total, dtype=torch.int64)
    real = k < n
    img_ids = torch.stack([(padded[:, None] + 1) * real[None],
                           torch.where(real, k // cols, 0)[None].expand(b, -1),
                           torch.where(real, k % cols, 0)[None].expand(b, -1)], dim=-1)
    x_freqs, cap_freqs = _rope(m, img_ids), _rope(m, cap_ids)
    return types.SimpleNamespace(adaln=adaln, x=x, n=n, total=total, cap=cap, cap_mask=cap_mask, x_freqs=x_freqs,
                                 cap_freqs=cap_freqs)


def patch_tokens(sample: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> 2x2 patch tokens (B, h/2 x w/2, 4 C), (ph, pw, C) within a token, rows outer."""
    b, c, h, w = sample.shape
    return sample.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // 2) * (w // 2), 4 * c)


def unified_inputs(z: types.SimpleNamespace, x: torch.Tensor, cap: torch.Tensor):
    """The [image, caption] sequence of the main layers, its rotary angles and additive key mask."""
    unified = torch.cat([x, cap], dim=1)
    freqs = tuple(torch.cat([a, t], dim=1) for a, t in zip(z.x_freqs, z.cap_freqs))
    mask = _additive(torch.cat([torch.ones_like(x[..., 0], dtype=torch.bool), z.cap_mask], dim=1))
    return unified, freqs, mask


def _batched_forward(m, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask):
    """ZImageTransformer2DModel.forward (basic mode) on batched tensors, `m` the model."""
    b, c, h, w = sample.shape
    rows, cols = h // 2, w // 2
    z = _inputs(m, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask)
    x, cap, adaln = z.x, z.cap, z.adaln
    for layer in m.noise_refiner:
        x = layer(x, None, z.x_freqs, adaln)
    for layer in m.context_refiner:
        cap = layer(cap, _additive(z.cap_mask), z.cap_freqs)
    unified, freqs, mask = unified_inputs(z, x, cap)
    for layer in m.layers:
        unified = layer(unified, mask, freqs, adaln)
    out = m.all_final_layer["2-1"](unified, c=adaln)[:, :z.n]
    out = out.reshape(b, rows, cols, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
    return -out
