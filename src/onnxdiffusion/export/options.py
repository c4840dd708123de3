"""What `export` takes (a typed config; the CLI maps its options onto it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExportOptions:
    opset: int = 17
    validate: bool = True
    overwrite: bool = False
    # diffusers attention -> one ONNX Runtime MultiHeadAttention node (see export/attention.py)
    fuse_attention: bool = True
    # None: every component the family declares that the source has
    components: tuple[str, ...] | None = None
    # components left out (e.g. ("vae_encoder",): text-to-image never runs it); only optional ones
    skip: tuple[str, ...] = ()
    # the folder's default image size (square); None: the family's (diffusers' pipeline default)
    default_size: int | None = None
    # LoRAs merged into the weights before export: ((path, scale), ...) (adapters/fuse.py)
    loras: tuple = ()
    # LoRA insertion points on the backbone and text encoders: None | "linear" | "all" (adapters/points.py)
    lora_points: str | None = None
    # a diffusers AutoencoderTiny folder (TAESD) exported beside the VAE as vae_decoder_tiny / vae_encoder_tiny
    tiny_vae: str | None = None
    # ControlNets exported beside the backbone: ("NAME=DIR", ...) (export/controlnet.py)
    controlnets: tuple = ()
    # a GGUF file holding the backbone (export/gguf.py): its weights replace the source folder's backbone weights
    gguf: str | None = None
    # the backbone's Linear weights streamed from its safetensors shards into external data, never all in memory
    # (export/streamed_float.py): "auto" above 12 GiB of fp32 weights, "on", "off"
    stream_weights: str = "auto"
