"""Export wrapper of a vision-language text encoder (Qwen2.5-VL with its vision tower, Qwen-Image-Edit's).

One graph: the picture's pixel patches through the vision tower, the merged picture tokens put in place of the
prompt's image-pad tokens, the language model's last hidden state under the padding mask. transformers computes
the tower's grid bookkeeping (rotary rows, the window permutation, cu_seqlens splits done as a Python loop) and
the 3D text positions from `image_grid_thw` as Python ints, which tracing would freeze at the export-time size;
they are graph inputs here, computed in numpy at run time (families/qwenimage_vision.py), and the per-window /
per-picture attention splits are masks over the window and picture ids (the same softmax, zero weight across).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F



def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionTower(torch.nn.Module):
    """Qwen2_5_VisionTransformerPretrainedModel.forward on patches already in window order."""

    def __init__(self, visual):
        super().__init__()
        self.visual = visual
        self.full = set(int(i) for i in visual.fullatt_block_indexes)

    def _attention(self, attn, x, cos, sin, mask):
        n = x.shape[0]
        q, k, v = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        c, s = cos[:, None, :], sin[:, None, :]
        q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=mask, scale=attn.scaling)
        return attn.proj(out[0].transpose(0, 1).reshape(n, -1))

    def forward(self, pixel_values, position_ids, window_ids, image_ids, merge_order):
        vis = self.visual
        x = vis.patch_embed(pixel_values)
        inv = vis.rotary_pos_emb.inv_freq
        freqs = torch.cat([position_ids[:, :1].to(inv.dtype) * inv, position_ids[:, 1:].to(inv.dtype) * inv], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        window = (window_ids[:, None] == window_ids[None, :])[None, None]
        picture = (image_ids[:, None] == image_ids[None, :])[None, None]
        for i, blk in enumerate(vis.blocks):
            mask = picture if i in self.full else window
            x = x + self._attention(blk.attn, blk.norm1(x), cos, sin, mask)
            x = x + blk.mlp(blk.norm2(x))
        return vis.merger(x)[merge_order]


class VisionLanguageHiddenStates(torch.nn.Module):
    """(input_ids, attention_mask, position_ids [3, B, L], the vision tower's inputs) -> last hidden state.

    The picture tokens fill the image-pad positions in order across the batch (transformers' masked_scatter); the
    language model runs on the embeddings under the causal + padding mask built in plain tensor ops (the tracer
    cannot follow transformers' vmap mask builders; llm_text_encoder.py does the same for text-only encoders)."""

    def __init__(self, model):
        super().__init__()
        self.model = model.model.language_model
        self.tower = VisionTower(model.model.visual)
        self.image_token = int(model.config.image_token_id)

    def forward(self, input_ids, attention_mask, position_ids, pixel_values, vision_position_ids, vision_window_ids,
                vision_image_ids, vision_merge_order):
        pictures = self.tower(pixel_values, vision_position_ids, vision_window_ids, vision_image_ids, vision_merge_order)
        embeds = self.model.embed_tokens(input_ids)
        is_image = input_ids == self.image_token
        slot = (is_image.reshape(-1).to(torch.int64).cumsum(0) - 1).clamp(min=0).reshape(is_image.shape)
        embeds = torch.where(is_image[..., None], pictures[slot].to(embeds.dtype), embeds)
        keep = attention_mask.to(torch.bool)
        seq = input_ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
        allowed = causal[None, None] & keep[:, None, None, :]
        mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
        out = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=False,
                         return_dict=True)
        return out.last_hidden_state
