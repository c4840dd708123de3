"""Z-Image's ControlNet as one traceable graph over batched tensors (the twin of zimage_transformer.py).

`ZImageControlNetModel.forward` takes the transformer's Python lists and borrows its embedders, pad tokens,
rotary table and refiners (`from_transformer`); this wrapper builds the same inputs as the batched
transformer graph (zimage_transformer._inputs: image tokens padded to 32 with x_pad_token, the caption's
own padding as cap_pad_token, the rest masked) and returns the net's hints, each (B, unified tokens, dim)
and already times the conditioning scale, for the transformer cut to add after its control places:

- the control context (B, control_in_dim, h, w), made on the host (families/control_zimage.py: the control
  latents, for the inpainting pipeline the mask and kept latents, zeros up to control_in_dim), is cut into 2x2
  tokens like the sample, embedded, and padded with x_pad_token;
- with add_control_noise_refiner, the net's control refiner runs on the image tokens first and its hints
  go into the borrowed noise refiner's layers (the net's own copy of the image tokens, not the transformer's);
- the control layers walk [control tokens, refined caption] beside [image tokens, refined caption].
"""

from __future__ import annotations

import torch

from .zimage_transformer import (ZImageTransformer, _additive, _inputs, _RealRotarySelfAttention, patch_tokens,
                                 unified_inputs)


class ZImageControlNet(torch.nn.Module):
    """sample, timestep, encoder_hidden_states, its mask, controlnet_cond (B, control_in_dim, h, w) and the scale (1,) ->
    one hint per control place."""

    def __init__(self, net, transformer):
        super().__init__()
        ZImageTransformer(transformer)  # the borrowed refiners' real-rotary attention and the rotary cos/sin tables
        net = type(net).from_transformer(net, transformer)
        for i in range(len(transformer.config.axes_dims)):
            for part in ("cos", "sin"):
                net.register_buffer(f"rope_{part}{i}", getattr(transformer, f"rope_{part}{i}"), persistent=False)
        for block in (*net.control_layers, *(net.control_noise_refiner or ())):
            block.attention.set_processor(_RealRotarySelfAttention())
        self.model = net

    def forward(self, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask, cond, scale):
        return _control_forward(self.model, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask,
                                cond, scale)


def _control_forward(m, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask, cond, scale):
    z = _inputs(m, sample, timestep, encoder_hidden_states, encoder_hidden_states_mask)
    ctl = m.control_all_x_embedder["2-1"](patch_tokens(cond))
    ctl = torch.cat([ctl, m.x_pad_token.to(ctl.dtype).expand(ctl.shape[0], z.total - z.n, -1)], dim=1)
    x, cap, adaln = z.x, z.cap, z.adaln
    mode = m.add_control_noise_refiner
    into_refiner = {}
    if mode:
        layers = m.control_layers if mode == "control_layers" else m.control_noise_refiner
        for layer in layers:
            ctl = layer(ctl, x, None, z.x_freqs, adaln)
        *hints, ctl = torch.unbind(ctl)
        into_refiner = {p: hints[i] * scale for i, p in enumerate(m.control_refiner_layers_places)}
    for i, layer in enumerate(m.noise_refiner):
        x = layer(x, None, z.x_freqs, adaln)
        if i in into_refiner:
            x = x + into_refiner[i]
    for layer in m.context_refiner:
        cap = layer(cap, _additive(z.cap_mask), z.cap_freqs)
    unified, freqs, mask = unified_inputs(z, x, cap)
    if not mode:
        for layer in m.control_noise_refiner:
            ctl = layer(ctl, None, z.x_freqs, adaln)
    c = torch.cat([ctl, cap], dim=1)
    for layer in m.control_layers:
        c = layer(c, unified, mask, freqs, adaln)
    return tuple(h * scale for h in torch.unbind(c)[:-1])
