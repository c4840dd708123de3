"""Export diffusers' attention as one ONNX Runtime `com.microsoft.MultiHeadAttention` node.

The TorchScript exporter writes scaled-dot-product attention as ~25 nodes per block (head
split/merge reshapes and transposes, a runtime sqrt(head_dim) from Shape ops, two scalings, two
MatMuls, Softmax). ONNX Runtime's CPU provider has a fused kernel for the whole thing, but its
graph optimizer does not recognise the exported pattern, so the fusion is made here, where the
module structure is still known: each supported `Attention` module gets a processor whose core
is an autograd Function that runs PyTorch's SDPA eagerly and exports as the fused node. Both the
fp32 backbone and every quantized one derived from it run the same kernel; projections stay
ordinary MatMuls (and so stay quantizable).

The fused node is an ONNX Runtime contrib op: a folder exported this way runs on ONNX Runtime
only (any provider with the op: CPU, CUDA, ...). `export --no-fuse-attention` writes plain ONNX.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DOMAIN_OP = "com.microsoft::MultiHeadAttention"


class _MultiHeadAttention(torch.autograd.Function):
    """q [B, S, heads*d], k/v [B, L, heads*d] -> [B, S, heads*dv]: no mask, no bias, no dropout."""

    @staticmethod
    def forward(ctx, q, k, v, heads: int, scale: float):
        def heads_first(x):
            return x.unflatten(-1, (heads, -1)).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), scale=scale)
        return out.transpose(1, 2).flatten(2)

    @staticmethod
    def symbolic(g, q, k, v, heads: int, scale: float):
        return g.op(DOMAIN_OP, q, k, v, num_heads_i=heads, scale_f=scale)


def supported(attn) -> bool:
    """The attention configurations of the SD family: plain self/cross attention, optionally with
    a GroupNorm on spatial input and a residual (the VAE's mid-block). Anything else keeps its
    processor (and exports unfused)."""
    plain = all(getattr(attn, name, None) is None for name in
                ("spatial_norm", "norm_q", "norm_k", "add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q"))
    if not plain or getattr(attn, "only_cross_attention", False) or len(attn.to_out) < 1:
        return False
    # one head count for q, k and v (no grouped key/value heads)
    width = attn.to_q.out_features
    return attn.to_k.out_features == width and attn.to_v.out_features == width and width % attn.heads == 0


class FusedAttnProcessor:
    """A diffusers attention processor whose attention core exports as one fused node."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kwargs):
        if attention_mask is not None:
            raise ValueError("fused attention export does not support attention masks")
        residual = hidden_states
        spatial = hidden_states.ndim == 4
        if spatial:
            b, c, h, w = hidden_states.shape
            hidden_states = hidden_states.flatten(2).transpose(1, 2)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if encoder_hidden_states is not None and attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)
        out = _MultiHeadAttention.apply(attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context),
                                        int(attn.heads), float(attn.scale))
        for layer in attn.to_out:  # projection, dropout
            out = layer(out)
        if spatial:
            out = out.transpose(1, 2).reshape(b, c, h, w)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


class FusedJointAttnProcessor:
    """Joint (MMDiT) attention, SD3's `JointAttnProcessor2_0` with the core as one fused node.

    Image and text tokens are projected separately (per-head q/k norms applied on (B, S, H, D),
    the same normalization as diffusers' (B, H, S, D)), concatenated along the sequence, attended
    as one self-attention, then split back and projected out."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if attention_mask is not None:
            raise ValueError("fused attention export does not support attention masks")
        heads = int(attn.heads)

        def project(x, linear, norm):
            y = linear(x)
            return y if norm is None else norm(y.unflatten(-1, (heads, -1))).flatten(2)

        n = hidden_states.shape[1]
        q = project(hidden_states, attn.to_q, attn.norm_q)
        k = project(hidden_states, attn.to_k, attn.norm_k)
        v = attn.to_v(hidden_states)
        ctx = encoder_hidden_states
        if ctx is not None:
            q = torch.cat([q, project(ctx, attn.add_q_proj, attn.norm_added_q)], dim=1)
            k = torch.cat([k, project(ctx, attn.add_k_proj, attn.norm_added_k)], dim=1)
            v = torch.cat([v, attn.add_v_proj(ctx)], dim=1)
        out = _MultiHeadAttention.apply(q, k, v, heads, float(attn.scale))
        if ctx is not None:
            out, ctx = out[:, :n], out[:, n:]
            if not attn.context_pre_only:
                ctx = attn.to_add_out(ctx)
        for layer in attn.to_out:  # projection, dropout
            out = layer(out)
        return out if ctx is None else (out, ctx)


def joint_supported(attn) -> bool:
    """SD3-style joint attention: JointAttnProcessor2_0, one head count for q, k and v."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    if not isinstance(attn.processor, JointAttnProcessor2_0) or getattr(attn, "spatial_norm", None) is not None:
        return False
    width = attn.to_q.out_features
    return attn.to_k.out_features == width and attn.to_v.out_features == width and width % attn.heads == 0


def fuse_attention(module: torch.nn.Module, joint: bool = True) -> int:
    """Give every supported diffusers `Attention` in `module` a fused processor; returns how many.

    `joint`: also SD3's joint (MMDiT) attention (see FusedJointAttnProcessor)."""
    from diffusers.models.attention_processor import Attention

    count = 0
    for sub in module.modules():
        if not isinstance(sub, Attention):
            continue
        if joint and joint_supported(sub):
            sub.set_processor(FusedJointAttnProcessor())
            count += 1
        elif supported(sub):
            sub.set_processor(FusedAttnProcessor())
            count += 1
    return count
