"""What a generation takes, typed: `GenerateOptions` (the sampling settings; unset ones resolved from the model's
recommended settings, runtime/generation.py) and `GenerateRequest` (the rest: negative prompt, pictures, run-time
LoRAs and ControlNets, where it runs). Each field's help is written once here: the CLI's `generate` options are
these fields (cli/options.py), and runtime/request.py checks them all before any model loads. Import-light on
purpose: the CLI builds its options from these classes at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..fields import option

CACHE_HELP = (
    "step caching (host loop, or a Loop graph compiled with compile-loop --cache): first_block:THRESHOLD | "
    "taylorseer:INTERVAL[:ORDER] | residual:INTERVAL[:ORDER] | magcache:THRESHOLD[:MAX_SKIP[:RETENTION]] "
    "(transformers; magcache after `cache calibrate`) | deepcache:INTERVAL[:BRANCH] (UNets; BRANCH block pairs, or "
    "L<N> skip layers)")
STOP_HELP = (
    "THRESHOLD[:MIN_STEPS]: end sampling once the denoised estimate changes by less than THRESHOLD (mean |D_i - "
    "D_i-1| / mean |D_i-1|) after at least MIN_STEPS steps (default 1) and decode that estimate; host loop, or a "
    "Loop graph compiled with compile-loop --stop-early; 0 never stops")


@dataclass(frozen=True)
class GenerateOptions:
    """None for steps/sampler/guidance: the model's recommended value (manifest `recommended`), else the
    defaults in runtime/generation.py (sampler: the one the folder's scheduler_config.json names). Ranges are in
    runtime/guards.py."""
    steps: int | None = option(None, "1..1000 (default: the model's recommended, else 20)")
    sampler: str | None = option(
        None, "default: the model's recommended, else the one the folder's scheduler_config.json names")
    guidance: float | None = option(None, "0..100, <= 1 turns guidance off (default: the model's recommended, else 7.5)")
    seed: int = option(0, "0..2**63-1")
    height: int | None = option(None, "image height in pixels (default: the model's)")
    width: int | None = option(None, "image width in pixels (default: the model's)")
    batch: int = option(1, "images per prompt (1..4096), written as OUT-0.png, OUT-1.png, ...")
    spacing: str | None = option(
        None, "timestep spacing: leading | trailing | linspace (default: the scheduler config's)")
    # host | loop | unrolled; the CLI's None: the profile's, else host (runtime/request.py)
    loop: str = option("host", "host | loop | unrolled (the last two need compile-loop; default: the profile's, else "
                               "host)", cli_default=None, cli_type=str | None)
    # img2img / inpainting: share of the schedule that runs, (0, 1]; None: 1
    strength: float | None = option(None, "with --image: share of the schedule that runs, (0, 1] (default 1; 0.8 "
                                          "keeps the layout, lower keeps more)")
    # inpainting: Gaussian blur radius (pixels) of the mask before it is binarized
    mask_blur: float = option(0.0, "with --mask: Gaussian blur radius in pixels before the mask is binarized")
    # inpainting from a picture: paste its pixels back outside the mask (diffusers' apply_overlay), so the
    # VAE's round trip does not touch them; off: the decoded image as is (diffusers' default)
    mask_overlay: bool = option(False, "with --mask: paste the picture's own pixels back outside the mask (the VAE "
                                       "round trip then leaves them unchanged)")
    # step caching (techniques/caching.py): a SPEC like "first_block:0.2", a dict {"method": ..., setting: value}
    # or a method's spec object; host loop or a Loop graph compiled with compile-loop --cache
    cache: str | dict | None = option(None, CACHE_HELP, cli_type=str | None)
    # adaptive stopping (techniques/stop.py): "THRESHOLD[:MIN_STEPS]" or a number; host loop or a Loop graph
    # compiled with compile-loop --stop-early; the result's settings["steps_run"] says how many steps ran
    stop_early: str | float | None = option(None, STOP_HELP, cli_type=str | None)
    # full (the VAE) | tiny (the folder's vae_decoder_tiny: runtime/tiny_decoder.py); None: the folder's
    # recommended (a tuned folder's), else full
    decoder: str | None = option(None, "full (the VAE) | tiny (the folder's tiny autoencoder, vae_decoder_tiny: "
                                       "export --tiny-vae) (default: the folder's recommended, a tuned folder's, else "
                                       "full)")


def _image_help() -> str:
    from ..families import describe_image_roles

    return ("a picture; its meaning is the model family's: " + describe_image_roles() + ". A start picture is "
            "resized to the generation size with a notice, a picture to edit to the size its family encodes "
            "references at (the output keeps --height/--width); repeatable where the family takes several "
            "references; needs the folder's vae_encoder")


MEMORY_HELP = (
    "default | lean (text encoder let go after encoding, no ORT memory pattern: lower peak RSS, same image) | "
    "bounded (lean, and the backbone let go before the VAE decode, no packed weight copies, no arena: one component "
    "resident at a time) | KEY=0|1,... with KEY release_text_encoders, release_backbone, prepacking, arena, "
    "mem_pattern; vae_tile=PIXELS[,vae_overlap=PIXELS]: "
    "tiled VAE decoding (lower peak at large sizes, image close, not identical) (default: the profile's, else default)")


@dataclass(frozen=True)
class GenerateRequest:
    """A generation's inputs besides the prompt and its GenerateOptions. Pictures are files (read and checked
    before any model loads) or pictures already in memory (PIL, arrays); `lora` FILE[:SCALE] strings or
    (file, scale) pairs; `controlnet` NAME[:SCALE[:START:END]] strings paired in order with `control` pictures
    (and, where given, `control_inpaint` contexts)."""
    negative_prompt: str | None = option(None, "what the image should not show (default: the empty prompt)",
                                         flags=("--negative-prompt", "-n"))
    provider: str = option("cpu", "ONNX Runtime execution provider, e.g. cpu | cuda | tensorrt | openvino")
    profile: str | None = option(None, "hardware profile: a name from `onnxdiffusion profiles` or a YAML file "
                                       "(overrides --provider)")
    memory: str | None = option(None, MEMORY_HELP)
    image: tuple[Path, ...] = option((), _image_help, metavar="PICTURE")
    mask: Path | None = option(None, "inpainting: white = repaint, black = keep (the image's size; needs --image)")
    lora: tuple[str, ...] = option((), "FILE[:SCALE]: a run-time LoRA (repeatable; a folder without insertion points "
                                       "gets a copy with them, derived once and cached)", flags=("--lora",))
    lora_dir: Path | None = option(None, "where a prompt's <lora:NAME:WEIGHT> tags find NAME.safetensors (default: "
                                         "the shipped models/loras)")
    control: tuple[Path, ...] = option((), "a control image (repeatable; paired in order with --controlnet; resized "
                                           "to the generation size with a notice)", flags=("--control",))
    controlnet: tuple[str, ...] = option((), "NAME[:SCALE[:START:END]]: a ControlNet of the folder (add-controlnet) "
                                             "steering by the matching --control image; SCALE default 1, START/END "
                                             "the share of the steps it acts in (default 0:1)", flags=("--controlnet",))
    # ZImageControlNetInpaintPipeline's image and mask_image: ControlNetSpec(..., inpaint=(picture, mask)); a
    # "PICTURE,MASK" string or a (picture, mask) pair per --controlnet, in order
    control_inpaint: tuple = option((), "PICTURE,MASK: the inpainting context of the matching --controlnet (one per "
                                        "--controlnet, in order; white = repaint) for a net that takes one (Z-Image's "
                                        "2.0 nets, as ZImageControlNetInpaintPipeline's image and mask_image): it "
                                        "conditions the net only, the sampling stays text-to-image",
                                    flags=("--control-inpaint",), cli_type=list[str] | None)
