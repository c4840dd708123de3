"""The sampling-graph builder's typed state: what it computes once before the loop and every step reads
(the guided conditioning, batch sizes, the starting state, the image inputs' helpers, the active techniques)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GraphState:
    context: dict[str, str]  # conditioning input name -> the tensor a step feeds the backbone ([uncond; cond])
    batch2: str  # the guided batch, as a 1-element shape
    noise_last: str  # index of the last noise row
    x0: str  # the starting latents
    d0: str  # the starting denoised estimate (zeros)
    mode: str  # guidance mode: cfg | cfg_rescale | none
    inv_keep: str  # 1 - keep (inpainting)
    blend_last: str  # index of the last blend row
    extra: bool = False  # an inpainting backbone: mask + masked-image latents after the scaled latents
    extra_axis: int = 1
    techniques: list = field(default_factory=list)  # the Loop twins, in the registry's order
    control: dict | None = None  # the ControlNets inlined beside the backbone (control.py)


@dataclass
class GraphRequest:
    """What build_sampling_graph builds (its docstring says what each field does)."""

    backbone: Any  # onnx.ModelProto
    form: str = "loop"
    steps: int | None = None
    latent_channels: int = 4
    text_encoder: Any = None
    vae_decoder: Any = None
    vae_scaling_factor: float = 1.0
    text_encoders: dict | None = None
    combine: Callable | None = None
    vae_shift_factor: float = 0.0
    guidance_mode: str = "cfg"
    latent_patch: int | None = None
    techniques: Sequence = ()
    # a whole graph's family hooks: (encoder name, ops, its outputs, its attention mask or None) -> what combine reads
    # (Family.text_outputs), and the decoder's input beyond scale and shift (a families.graph_ends.DecodeFeed)
    text_outputs: Callable | None = None
    decode: Any = None
