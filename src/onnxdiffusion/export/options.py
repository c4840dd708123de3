"""What `export` takes: a typed config whose fields are also the `export` verb's options (help written once
here; cli/options.py makes the options)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..fields import option


def _loras(values) -> tuple:
    """--lora FILE[:SCALE] (repeatable) -> ((file, scale), ...), scales checked."""
    from ..adapters.feeds import normalize

    return tuple((str(p), w) for p, w in normalize(list(values or [])))


@dataclass(frozen=True)
class ExportOptions:
    opset: int = option(17, "ONNX opset of the exported graphs")
    validate: bool = option(True, "skip the PyTorch comparison", flags=("--no-validate",), invert=True)
    overwrite: bool = option(False, "replace an existing output folder written by this tool")
    # diffusers attention -> one ONNX Runtime MultiHeadAttention node (see export/attention.py)
    fuse_attention: bool = option(True, "plain ONNX attention (portable beyond ONNX Runtime, slower on it)",
                                  flags=("--no-fuse-attention",), invert=True)
    # None: every component the family declares that the source has
    components: tuple[str, ...] | None = None
    # components left out (e.g. ("vae_encoder",): text-to-image never runs it); only optional ones
    skip: tuple[str, ...] = option((), "leave out an optional component (repeatable), e.g. vae_encoder: "
                                       "text-to-image never runs it", flags=("--skip",))
    # the folder's default image size (square); None: the family's (diffusers' pipeline default)
    default_size: int | None = option(None, "the folder's default (square) image size; default: the pipeline's own",
                                      flags=("--default-size",))
    # LoRAs merged into the weights before export: ((path, scale), ...) (adapters/fuse.py)
    loras: tuple = option((), "FILE[:SCALE]: merge a LoRA (.safetensors, diffusers/peft layout or `lora convert`ed) "
                              "into the weights before export (repeatable)", flags=("--lora",),
                          cli_type=list[str] | None, convert=_loras)
    # LoRA insertion points on the backbone and text encoders: None | "linear" | "all" (adapters/points.py)
    lora_points: str | None = option(None, "linear | all: LoRA insertion points on the backbone and text encoders "
                                           "for run-time LoRAs (generate --lora); all adds k x k convolutions",
                                     flags=("--lora-points",))
    # a diffusers AutoencoderTiny folder (TAESD) exported beside the VAE as vae_decoder_tiny / vae_encoder_tiny
    tiny_vae: str | None = option(None, "a diffusers AutoencoderTiny (TAESD) folder for this pipeline's VAE: "
                                        "exported beside it as vae_decoder_tiny / vae_encoder_tiny (generate "
                                        "--decoder tiny)", flags=("--tiny-vae",), cli_type=Path | None,
                                  convert=lambda v: None if v is None else str(v))
    # ControlNets exported beside the backbone: ("NAME=DIR", ...) (export/controlnet.py)
    controlnets: tuple = option((), "NAME=DIR: a diffusers ControlNet folder (ControlNetModel, SD3ControlNetModel, "
                                    "FluxControlNetModel) exported beside the backbone as controlnets/NAME "
                                    "(repeatable; generate --controlnet NAME)", flags=("--controlnet",),
                                cli_type=list[str] | None)
    # a GGUF file holding the backbone (export/gguf.py): its weights replace the source folder's backbone weights
    gguf: str | None = None
    # the backbone's Linear weights streamed from its safetensors shards into external data, never all in memory
    # (export/streamed_float.py): "auto" above 12 GiB of fp32 weights, "on", "off". A GGUF backbone's blocks are
    # always streamed; the setting says whether it validates on a cut-down copy (streamed_backbone.cut_validation)
    stream_weights: str = option("auto", "auto | on | off: the backbone's Linear weights streamed from its safetensors "
                                         "shards (export bounded by memory; validated on a cut-down copy, as a GGUF "
                                         "backbone then is); auto above 12 GiB fp32. LLM text encoders alike",
                                 flags=("--stream-weights",))
    # an LLM text encoder's weights (export/llm_streamed.py): float, or int8 / int4 MatMulNBits blocks written from
    # the shards one layer at a time (streamed whatever --stream-weights says)
    # a GGUF backbone's quantized Linear weights (export/gguf_backbone.py): "blocks", its blocks as MatMulNBits (Q8_0,
    # Q4_0 exact), or "int8-channel", re-quantized to int8 with a scale per output channel (DynamicQuantizeMatMul)
    gguf_layout: str = option("blocks", "blocks | int8-channel: a GGUF backbone's weights as its own blocks "
                                        "(MatMulNBits; Q8_0, Q4_0 exact) or re-quantized to int8 per output channel "
                                        "(DynamicQuantizeMatMul: ~2x faster steps on AVX-512 VNNI, weights "
                                        "re-rounded, activations int8 per tensor)", flags=("--gguf-layout",))
    text_encoder_weights: str = option("float", "float | int8 | int4: an LLM text encoder's (Qwen3, Qwen2.5-VL, ...) "
                                                "Linear weights, int8/int4 as block-wise MatMulNBits (embedding int8 "
                                                "blocks), streamed from its shards", flags=("--text-encoder-weights",))


@dataclass(frozen=True)
class AddControlNetOptions:
    """`add-controlnet MODEL NET`: `add_controlnet(model, net, o.name, overwrite=o.overwrite, backbone=o.backbone)`."""
    name: str = option(help="the name generate --controlnet uses")
    overwrite: bool = option(False, "replace a ControlNet of that name")
    backbone: Path | None = option(None, "the diffusers folder MODEL was exported from, for a ControlNet that borrows "
                                         "the backbone's layers (ZImageControlNetModel)")
