"""Export wrappers and specs for the rectified-flow transformer backbones and their text encoders.

Each wrapper gives a diffusers/transformers module a flat tensor signature the exporter can trace:

- `FluxTransformer`: packed 2x2 latent tokens, timestep (the table's t = 1000 sigma), T5
  sequence, CLIP pooled projection, rotary `img_ids` (batched like every conditioning input;
  `txt_ids` are zeros and made in the graph), guidance.
- `QwenImageTransformer`: the same token layout plus a text mask; its complex rotary table and
  complex q/k rotation are rewritten in real arithmetic from position ids (export/rope.py).
- `EncoderHiddenStates`: a bidirectional text encoder's last hidden state (T5 for Flux and SD3).
- `DecoderHiddenStates` (export/llm_text_encoder.py, re-exported here): a decoder-only language model's
  hidden state(s) under a padding mask (Qwen2.5-VL's text model for Qwen-Image; the prompt template prefix
  and the padding are dropped by the run-time side in numpy, as QwenImagePipeline does in torch).

Which family uses which wrapper is declared in families/; nothing here dispatches on a class name.
RMSNorm needs no rewrite: diffusers' and transformers' RMSNorms trace to Pow/ReduceMean/Add/Sqrt/
Div/Mul, which ONNX Runtime's optimizer fuses into SimplifiedLayerNormalization (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .llm_text_encoder import DecoderHiddenStates  # noqa: F401  (re-exported: its first home)
from .rope import axis_inv_freqs, cos_sin_from_ids, rotate_pairs


class _FluxJointAttention:
    """diffusers' FluxAttnProcessor with the rotation written on (cos, sin) pairs.

    diffusers' `apply_rotary_emb` reshapes with `x.shape` unpacked into Python ints, which the
    tracer bakes in (the exported graph then only runs at the export-time token count)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        def heads(x):
            return x.unflatten(-1, (attn.heads, -1))

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        q, k = attn.norm_q(q), attn.norm_k(k)
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if joint:
            tq = attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))
            tk = attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))
            q, k = torch.cat([tq, q], dim=1), torch.cat([tk, k], dim=1)
            v = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), v], dim=1)
        if image_rotary_emb is not None:
            # Flux's tables repeat each pair's angle twice along D: keep one per pair
            cos, sin = (t[:, 0::2].to(torch.float32) for t in image_rotary_emb)
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attention_mask)
        out = out.transpose(1, 2).flatten(2).to(q.dtype)
        if not joint:
            return out
        seq_txt = encoder_hidden_states.shape[1]
        img = attn.to_out[1](attn.to_out[0](out[:, seq_txt:].contiguous()))
        return img, attn.to_add_out(out[:, :seq_txt].contiguous())


class FluxTransformer(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.guidance = bool(model.config.guidance_embeds)
        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            block.attn.set_processor(_FluxJointAttention())

    def forward(self, sample, timestep, encoder_hidden_states, pooled_projections, img_ids, guidance=None):
        # the table's timestep is sigma * 1000; FluxPipeline hands the transformer t / 1000
        txt_ids = torch.zeros(encoder_hidden_states.shape[1], 3, dtype=img_ids.dtype)
        return self.model(hidden_states=sample, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled_projections, timestep=timestep / 1000, img_ids=img_ids[0],
                          txt_ids=txt_ids, guidance=guidance if self.guidance else None, return_dict=False)[0]


class FluxKontextTransformer(FluxTransformer):
    """FLUX.1 Kontext: the reference tokens joined after the noise tokens (their ids after the noise ids, frame 1),
    the output cut back to the noise tokens, as FluxKontextPipeline does around its transformer call."""

    def forward(self, sample, timestep, encoder_hidden_states, pooled_projections, img_ids, *rest):
        guidance, reference, reference_ids = rest if self.guidance else (None, *rest)
        out = super().forward(torch.cat([sample, reference], dim=1), timestep, encoder_hidden_states,
                              pooled_projections, torch.cat([img_ids, reference_ids], dim=1), guidance)
        return out[:, : sample.shape[1]]


class FluxControlNet(FluxTransformer):
    """FluxControlNetModel with the backbone wrapper's inputs, then the packed control latents and the
    scale -> its double-block samples, then its single-block samples."""

    def __init__(self, model):
        super().__init__(model)  # the same blocks, the same attention processor
        from .fixups import decompose_rms_norms

        decompose_rms_norms(model)

    def forward(self, sample, timestep, encoder_hidden_states, pooled_projections, img_ids, *rest):
        guidance, cond, scale = rest if self.guidance else (None, *rest)
        txt_ids = torch.zeros(encoder_hidden_states.shape[1], 3, dtype=img_ids.dtype)
        double, single = self.model(hidden_states=sample, controlnet_cond=cond, conditioning_scale=scale,
                                    encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                                    timestep=timestep / 1000, img_ids=img_ids[0], txt_ids=txt_ids, guidance=guidance,
                                    return_dict=False)
        return (*(double or ()), *(single or ()))


class EncoderHiddenStates(torch.nn.Module):
    """input_ids -> last hidden state."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, return_dict=True).last_hidden_state


class _RealRotaryJointAttention:
    """Qwen-Image's joint (text + image) attention with the rotation done on (cos, sin) pairs.

    `image_rotary_emb` is ((img_cos, img_sin), (txt_cos, txt_sin)); the text mask is a boolean
    key mask over [text, image] tokens, as in diffusers' QwenDoubleStreamAttnProcessor2_0."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        (img_cos, img_sin), (txt_cos, txt_sin) = image_rotary_emb
        mask = None
        if encoder_hidden_states_mask is not None:
            image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]

        def heads(x):
            return x.unflatten(-1, (attn.heads, -1))

        img_q, img_k, img_v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        txt_q = heads(attn.add_q_proj(encoder_hidden_states))
        txt_k = heads(attn.add_k_proj(encoder_hidden_states))
        txt_v = heads(attn.add_v_proj(encoder_hidden_states))
        img_q, img_k = attn.norm_q(img_q), attn.norm_k(img_k)
        txt_q, txt_k = attn.norm_added_q(txt_q), attn.norm_added_k(txt_k)
        img_q, img_k = rotate_pairs(img_q, img_cos, img_sin), rotate_pairs(img_k, img_cos, img_sin)
        txt_q, txt_k = rotate_pairs(txt_q, txt_cos, txt_sin), rotate_pairs(txt_k, txt_cos, txt_sin)
        q = torch.cat([txt_q, img_q], dim=1).transpose(1, 2)
        k = torch.cat([txt_k, img_k], dim=1).transpose(1, 2)
        v = torch.cat([txt_v, img_v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2).to(q.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out[:, seq_txt:].contiguous())
        return img_out, attn.to_add_out(out[:, :seq_txt].contiguous())


class QwenImageTransformer(torch.nn.Module):
    """QwenImageTransformer2DModel.forward with the rotary table built from position ids in real
    arithmetic. `img_ids` [B, S, 3] (rows of one image; the first is used, as diffusers uses one
    shape per batch); the mask is 1 for text tokens, 0 for padding."""

    def __init__(self, model):
        super().__init__()
        cfg = model.config
        # (a ControlNet's config has none of these options)
        if any(getattr(cfg, k, False) for k in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope", "guidance_embeds")):
            raise ValueError("QwenImageTransformer2DModel with zero_cond_t / additional_t_cond / layer3d rope / "
                             "guidance embeds is not supported for export")
        self.model = model
        self.axes_dim = tuple(int(d) for d in cfg.axes_dims_rope)
        self.register_buffer("inv_freq", axis_inv_freqs(self.axes_dim, float(model.pos_embed.theta)), persistent=False)
        for block in model.transformer_blocks:
            block.attn.set_processor(_RealRotaryJointAttention())

    def blocks(self, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask, img_ids, control=None):
        """The transformer blocks run; (image hidden_states after each block, temb). `control`: the image
        tokens' extra embedding a ControlNet adds after img_in."""
        m = self.model
        img_ids = img_ids[0]
        # text positions (p, p, p) count on from the largest image row/column index, as QwenEmbedRope does
        start = img_ids[:, 1:].max() + 1
        pos = torch.arange(encoder_hidden_states.shape[1], dtype=img_ids.dtype) + start
        txt_ids = pos[:, None].expand(-1, 3)
        hidden_states = m.img_in(sample)
        if control is not None:
            hidden_states = hidden_states + control
        text = m.txt_in(m.txt_norm(encoder_hidden_states))
        # the table's timestep is sigma * 1000; QwenImagePipeline hands the transformer t / 1000
        temb = m.time_text_embed((timestep / 1000).to(hidden_states.dtype), hidden_states)
        rotary = (cos_sin_from_ids(img_ids, self.axes_dim, self.inv_freq),
                  cos_sin_from_ids(txt_ids, self.axes_dim, self.inv_freq))
        mask = encoder_hidden_states_mask.to(torch.bool)
        outs = []
        for block in m.transformer_blocks:
            text, hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=text,
                                        encoder_hidden_states_mask=mask, temb=temb, image_rotary_emb=rotary)
            outs.append(hidden_states)
        return outs, temb

    def forward(self, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask, img_ids):
        outs, temb = self.blocks(sample, timestep, encoder_hidden_states, encoder_hidden_states_mask, img_ids)
        return self.model.proj_out(self.model.norm_out(outs[-1], temb))


class QwenImageControlNet(QwenImageTransformer):
    """QwenImageControlNetModel with the transformer wrapper's inputs, then the packed control latents and
    the scale -> one image-token sample per block (controlnet_blocks[i] of block i's output, x scale)."""

    def forward(self, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask, img_ids, cond, scale):
        m = self.model
        outs, _ = self.blocks(sample, timestep, encoder_hidden_states, encoder_hidden_states_mask, img_ids,
                              control=m.controlnet_x_embedder(cond))
        return tuple(lin(h) * scale for h, lin in zip(outs, m.controlnet_blocks))
