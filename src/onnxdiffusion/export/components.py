"""Declarative export specs, one per component kind (names, dtypes, named dynamic axes, tolerance).

Input and output names follow optimum's ONNX diffusion layout so its pipeline can load our folders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    dims: tuple[str | int, ...]  # str = named dynamic axis


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    wrap: Callable[[Any], torch.nn.Module]
    atol: float  # max abs error allowed, relative to max(1, max |reference|)

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)}
            for t in (*self.inputs, *self.outputs)
        }

    def to_manifest(self) -> dict:
        def one(t: TensorSpec) -> dict:
            return {"name": t.name, "dtype": t.dtype, "shape": list(t.dims)}

        return {"inputs": [one(t) for t in self.inputs], "outputs": [one(t) for t in self.outputs]}


class _TextEncoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, return_dict=True)
        return out.last_hidden_state, out.pooler_output


class _UNet(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.model(sample, timestep, encoder_hidden_states, return_dict=False)[0]


class _VaeDecoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample):
        return self.vae.decode(latent_sample, return_dict=False)[0]


class _VaeEncoder(torch.nn.Module):
    """Outputs the posterior's raw moments (mean and log-variance stacked on channels)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, sample):
        h = self.vae.encoder(sample)
        if self.vae.quant_conv is not None:
            h = self.vae.quant_conv(h)
        return h


def specs_for(latent_channels: int, hidden: int) -> dict[str, ComponentSpec]:
    lat = ("batch_size", latent_channels, "height_latent", "width_latent")
    img = ("batch_size", 3, "height", "width")
    return {
        "text_encoder": ComponentSpec(
            "text_encoder",
            (TensorSpec("input_ids", "int32", ("batch_size", "sequence_length")),),
            (
                TensorSpec("last_hidden_state", "float32", ("batch_size", "sequence_length", hidden)),
                TensorSpec("pooler_output", "float32", ("batch_size", hidden)),
            ),
            _TextEncoder,
            atol=1e-4,
        ),
        "unet": ComponentSpec(
            "unet",
            (
                TensorSpec("sample", "float32", ("batch_size", latent_channels, "height_latent", "width_latent")),
                TensorSpec("timestep", "float32", ("batch_size",)),
                TensorSpec("encoder_hidden_states", "float32", ("batch_size", "sequence_length", hidden)),
            ),
            (TensorSpec("out_sample", "float32", lat),),
            _UNet,
            atol=1e-3,
        ),
        "vae_decoder": ComponentSpec(
            "vae_decoder",
            (TensorSpec("latent_sample", "float32", lat),),
            (TensorSpec("sample", "float32", img),),
            _VaeDecoder,
            atol=2e-3,
        ),
        "vae_encoder": ComponentSpec(
            "vae_encoder",
            (TensorSpec("sample", "float32", img),),
            (TensorSpec("latent_parameters", "float32", ("batch_size", 2 * latent_channels, "height_latent", "width_latent")),),
            _VaeEncoder,
            atol=2e-3,
        ),
    }
