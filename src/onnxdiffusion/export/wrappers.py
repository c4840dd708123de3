"""Torch wrappers whose forward takes a component's ONNX inputs in order and returns its outputs.

Which wrapper, and with which options, is the family's declaration (ComponentSpec.kind/options);
this module only knows how each kind of diffusers/transformers module is called.
"""

from __future__ import annotations

import math

import torch

from ..families.base import SAMPLE, TIMESTEP, ComponentSpec
from ..families.sd import StableDiffusion
from ..families.tiny_vae import DECODER as TINY_DECODER
from ..families.tiny_vae import ENCODER as TINY_ENCODER

UNET_KIND = StableDiffusion.backbone_kind  # the UNet wrapper's kind, as its family names it

# text-encoder outputs a family may ask for: the HF output field, or a hidden state by index
_HIDDEN = {"penultimate_hidden_state": -2}


class TextEncoder(torch.nn.Module):
    def __init__(self, model, outputs: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.outputs = outputs
        self.hidden = any(o in _HIDDEN for o in outputs)

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, output_hidden_states=self.hidden, return_dict=True)
        return tuple(out.hidden_states[_HIDDEN[o]] if o in _HIDDEN else getattr(out, o) for o in self.outputs)


def guidance_embedding(scale: torch.Tensor, dim: int) -> torch.Tensor:
    """The sinusoidal embedding of (scale - 1) * 1000 an LCM-distilled UNet takes as timestep_cond
    (the w-conditioning of the LCM paper; diffusers' pipelines compute it from guidance_scale - 1)."""
    w = (scale.float() - 1.0) * 1000.0
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
    emb = w[:, None] * freqs[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    return torch.nn.functional.pad(emb, (0, 1)) if dim % 2 else emb


class UNet(torch.nn.Module):
    """sample, timestep, encoder_hidden_states, then any added conditioning (SDXL: text_embeds, time_ids),
    and last the guidance scale of an LCM-distilled UNet (``time_cond_proj_dim``), embedded here."""

    def __init__(self, model, added: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.guided = bool(added) and added[-1] == "guidance"
        self.added = added[:-1] if self.guided else added

    def forward(self, sample, timestep, encoder_hidden_states, *added):
        kwargs = {"added_cond_kwargs": dict(zip(self.added, added))} if self.added else {}
        if self.guided:
            kwargs["timestep_cond"] = guidance_embedding(added[-1], int(self.model.config.time_cond_proj_dim))
        return self.model(sample, timestep, encoder_hidden_states, return_dict=False, **kwargs)[0]


class Transformer(torch.nn.Module):
    """A diffusers transformer backbone called by keyword: our input names -> its argument names."""

    def __init__(self, model, arg_names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.arg_names = arg_names

    def forward(self, *inputs):
        return self.model(**dict(zip(self.arg_names, inputs)), return_dict=False)[0]


class VaeDecoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample):
        return self.vae.decode(latent_sample, return_dict=False)[0]


class VaeEncoder(torch.nn.Module):
    """Outputs the posterior's raw moments (mean and log-variance stacked on channels). `frames`: a video VAE
    (Qwen-Image's) takes the picture as one frame, through its own causal-cache encode path."""

    def __init__(self, vae, frames: bool = False):
        super().__init__()
        self.vae = vae
        self.frames = frames

    def forward(self, sample):
        if self.frames:
            return self.vae._encode(sample[:, :, None])
        h = self.vae.encoder(sample)
        if self.vae.quant_conv is not None:
            h = self.vae.quant_conv(h)
        return h


class TinyVaeDecoder(torch.nn.Module):
    """AutoencoderTiny's decoder (TAESD): latents -> image in [-1, 1], unclamped like the VAE's."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample):
        return self.vae.decode(latent_sample, return_dict=False)[0]


class TinyVaeEncoder(torch.nn.Module):
    """AutoencoderTiny's encoder: image in [-1, 1] -> latents (no posterior: they are the mean)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, sample):
        return self.vae.encode(sample, return_dict=False)[0]


def wrap(spec: ComponentSpec, module) -> torch.nn.Module:
    names = [t.name for t in spec.inputs]
    if spec.kind == "text_encoder":
        return TextEncoder(module, tuple(spec.options["outputs"]))
    if spec.kind == "decoder_text_encoder":
        # options: the hidden layers read, rotary axes and position numbering (export/llm_text_encoder.py)
        from .llm_text_encoder import DecoderHiddenStates, decoder_stack

        return DecoderHiddenStates(decoder_stack(module), **spec.options)
    if spec.kind == UNET_KIND:
        return UNet(module, tuple(names[3:]))
    if spec.kind == "transformer":
        # options["args"] renames our inputs to the model's arguments (sample -> hidden_states, ...)
        rename = {SAMPLE: "hidden_states", TIMESTEP: "timestep", **spec.options.get("args", {})}
        return Transformer(module, tuple(rename.get(n, n) for n in names))
    if spec.kind == "vae_decoder":
        return VaeDecoder(module)
    if spec.kind == "vae_encoder":
        return VaeEncoder(module, frames=bool(spec.options.get("frames")))
    if spec.kind == TINY_DECODER:
        return TinyVaeDecoder(module)
    if spec.kind == TINY_ENCODER:
        return TinyVaeEncoder(module)
    raise ValueError(f"no torch wrapper for component kind {spec.kind!r}")
