"""`--arch NAME`: released-size / full-width random-weight models for the speed, memory and size columns.

  sd15       Stable Diffusion v1.5's architecture at full size (arch/sd15.py), exported by `onnxdiffusion export`
  sd15-tiny  the same block types, narrow: builds, exports and benches in about a minute (tests, smoke runs)
  sd15-lcm, sd15-lcm-tiny
             the FastSD CPU recipe at SD1.5 size (or narrow): LCM-distilled UNet, LCM 4 steps, 512x512 (the
             narrow one 128x128), TAESD as the tiny decoder (`--decoder tiny`), against OpenVINO's pipeline of the
             same folder with TAESD
  zimage, flux2_klein
             Z-Image-Turbo and FLUX.2 [klein] 4B at release size (arch/release.py: random bf16 shards written
             tensor by tensor; `--arch-depth` cuts them down for proof runs)
  sdxl, sd3, flux, qwenimage
             the released widths (hidden sizes, heads, channels) with fewer blocks/layers so that diffusers and
             ONNX Runtime fit side by side on a 24 GB CPU machine, built by arch/fullwidth.py (profile
             `bench`; its DEPTHS table) and exported with `onnxdiffusion export`

The builders are modules of the package (an installed package runs them; they need the export extra). Each
phase runs as a subprocess into a work folder that is reused when it already holds both the diffusers folder
and the export. Quality columns are left out (random weights make noise images).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...errors import UserError


def _run(cmd: list[str], arch: str, what: str, progress: bool) -> None:
    print(f"bench: {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL, env={**os.environ})
    if proc.returncode != 0:
        raise UserError(f"--arch {arch}: {what} failed (exit {proc.returncode})")


def _sd15(arch: str, work: Path, threads: int, progress: bool, depth: str | None = None) -> None:
    """sd15.py's build (skipped when the diffusers folder is there) and export phases."""
    tiny = (["--tiny"] if arch.endswith("-tiny") else []) + (["--lcm"] if "-lcm" in arch else [])
    mod = [sys.executable, "-m", "onnxdiffusion.bench.arch.sd15"]
    if not (work / "diffusers" / "model_index.json").is_file():
        _run([*mod, "build", str(work), *tiny], arch, "building the model", progress)
    _run([*mod, "export", str(work), "--threads", str(threads)], arch, "exporting it", progress)


def depth_args(arch: str, depth: str | None) -> list[str]:
    """--arch-depth BACKBONE[/ENCODER] -> fullwidth.py's --depth / --encoder-layers (checked here: one-line errors)."""
    if depth is None:
        return []
    backbone, _, encoder = depth.partition("/")
    try:
        parts = [int(p) for p in backbone.split(",")]
        layers = int(encoder) if encoder else None
    except ValueError:
        raise UserError(f"--arch-depth {depth!r}: expected BACKBONE[/ENCODER], e.g. 1,1/2") from None
    if not parts or min(parts) < 1 or (layers is not None and layers < 1):
        raise UserError(f"--arch-depth {depth!r}: depths are positive integers")
    if encoder and arch not in ("zimage", "flux2_klein"):
        raise UserError(f"--arch-depth {depth!r}: /ENCODER applies to --arch zimage and flux2_klein only")
    return ["--depth", ",".join(map(str, parts)), *(["--encoder-layers", str(layers)] if layers else [])]


def _fullwidth(arch: str, work: Path, threads: int, progress: bool, depth: str | None = None) -> None:
    """fullwidth.py builds the diffusers folder (profile `bench`); `onnxdiffusion export` exports it."""
    diff_dir, onnx_dir = work / "diffusers", work / "onnx"
    if not (diff_dir / "model_index.json").is_file():
        _run([sys.executable, "-m", "onnxdiffusion.bench.arch.fullwidth", "build", arch, str(diff_dir),
              "--profile", "bench", *depth_args(arch, depth)], arch, "building the full-width model", progress)
    _run([sys.executable, "-m", "onnxdiffusion.cli", "export", str(diff_dir), str(onnx_dir), "--overwrite"],
         arch, "exporting it", progress)


QUANTIZE_ARGS = ("--calib-count", "4", "--calib-steps", "4", "--latency-runs", "3", "--no-quality")


# the release-size rows by default (the quantized folders found beside the export are added): an fp32 ONNX Runtime
# row of a 6B backbone holds 24.6 GB of weights
RELEASE_ROWS = ("torch-bf16", "sdcpp-q8_0", "sdcpp-q4_K")


@dataclass(frozen=True)
class Arch:
    what: str
    steps: int  # default sampling steps
    variants: tuple[str, ...]  # default rows
    build: Callable[..., None]  # (arch, work, threads, progress, depth)
    # `bench --quantize` on this random-weight model: calibration kept small (its statistics only set the int8
    # ranges; images are noise either way), no quality probes (meaningless on random weights)
    quantize_args: tuple[str, ...] = QUANTIZE_ARGS
    guidance: float | None = None  # the bench's default guidance (None: the folder's evaluated one, else 4.0)
    # every row's sampler (None: the folder's own scheduler's): pinned where a peer could not run the folder's own
    sampler: str | None = None
    size: int = 256  # the bench's default image size
    decoder: str | None = None  # our rows' and the peers' decoder (None: the VAE; tiny: the folder's TAESD)


ARCHES = {
    # DDIM 10, the committed figures' sampler: the folder's own PNDM makes 11 UNet calls where the peers' DDIM
    # makes 10, and stable-diffusion.cpp has no PNDM (one sampler for every row, issue 43)
    "sd15": Arch("Stable Diffusion v1.5-sized components", 10,
                 ("torch-fp32", "ort-fp32", "optimum-ort"), _sd15,
                 QUANTIZE_ARGS + ("--calib-guidance", "7.5"), 7.5, "ddim"),  # SD1.5's usual guidance (the committed figures')
    # FastSD CPU's recipe (LCM 4 steps + TAESD, 512x512) against OpenVINO's pipeline of the same folder + TAESD
    "sd15-lcm": Arch("Stable Diffusion v1.5-sized, LCM-distilled UNet + TAESD (the FastSD CPU recipe)", 4,
                     ("ort-fp32", "openvino-fp32"), _sd15, QUANTIZE_ARGS + ("--calib-guidance", "8.0"), 8.0, "lcm",
                     512, "tiny"),
    "sd15-lcm-tiny": Arch("the FastSD recipe's model, narrow, 128x128 (a smoke-test model)", 4,
                          ("ort-fp32", "openvino-fp32"), _sd15, QUANTIZE_ARGS, 8.0, "lcm", 128, "tiny"),
    "sd15-tiny": Arch("Stable Diffusion v1.5's block types, narrow (a smoke-test model)", 4,
                      ("torch-fp32", "ort-fp32"), _sd15),
    "sdxl": Arch("SDXL-base widths (UNet 320/640/1280, CLIP-L + OpenCLIP-bigG), fewer transformer blocks", 4,
                 ("torch-fp32", "ort-fp32"), _fullwidth),
    "sd3": Arch("SD3-medium widths (MMDiT 1536 wide, 24 heads; CLIP-L, OpenCLIP-bigG, T5-XXL), fewer blocks", 4,
                ("torch-fp32", "ort-fp32"), _fullwidth),
    "flux": Arch("FLUX.1-dev widths (MMDiT 3072 wide, 24 heads; CLIP-L, T5-XXL), fewer blocks", 4,
                 ("torch-fp32", "ort-fp32"), _fullwidth),
    "qwenimage": Arch("Qwen-Image widths (MMDiT 3072 wide, 24 heads; Qwen2.5-VL-7B text width), fewer blocks", 4,
                      ("torch-fp32", "ort-fp32"), _fullwidth),
    # release size (arch/release.py): the eager peer in bf16 (fp32 of a 6B backbone beside its 4B encoder is 40 GB);
    # both are step-distilled, run without CFG (guidance 1) as their model cards do
    "zimage": Arch("Z-Image-Turbo at release size (6.15B DiT 3840 wide, 30+2 layers; Qwen3-4B; FLUX.1 VAE)", 8,
                   RELEASE_ROWS, _fullwidth, guidance=1.0),
    "flux2_klein": Arch("FLUX.2 [klein] 4B at release size (3.88B DiT 3072 wide, 5+20 blocks; Qwen3-4B; FLUX.2 VAE)",
                        4, RELEASE_ROWS, _fullwidth, guidance=1.0),
}


def default_work(arch: str) -> Path:
    return Path(f"/tmp/{arch}-bench")


def prepare(arch: str, work: Path, threads: int = 1, progress: bool = True,
            depth: str | None = None) -> tuple[Path, Path, str]:
    """(exported model folder, diffusers folder, note stating the config) of `arch` under `work`, built if needed."""
    spec = ARCHES[arch]
    work = Path(work).resolve()
    onnx_dir, diff_dir = work / "onnx", work / "diffusers"
    ready = (onnx_dir / "manifest.json").is_file() and (diff_dir / "model_index.json").is_file()
    if not ready:
        try:
            import diffusers  # noqa: F401
            import torch  # noqa: F401
        except ImportError:
            raise UserError(f"--arch {arch} builds the model with torch and diffusers: install the export extra") from None
        work.mkdir(parents=True, exist_ok=True)
        if depth is not None and spec.build is _sd15:
            raise UserError(f"--arch-depth applies to the full-width arches, not --arch {arch}")
        depth_args(arch, depth)  # bad input fails before anything is built
        spec.build(arch, work, threads, progress, depth)
    if not (onnx_dir / "manifest.json").is_file():
        raise UserError(f"--arch {arch}: no exported model at {onnx_dir} after the build")
    return onnx_dir, diff_dir, _note(arch, diff_dir)


def _note(arch: str, diff_dir: Path) -> str:
    note = f"--arch {arch}: {ARCHES[arch].what}, random weights; quality columns are left out (the images are noise)."
    try:
        d = json.loads((diff_dir / "fullwidth.json").read_text())
        width = "narrow internals at the release width" if d.get("encoder") == "narrow" else "full width"
        note += (f" Built: {d['backbone_class']} depth {d['backbone_depth']} (released {d['released_depth']}), text "
                 f"encoders {d['encoder_layers']} layer(s) each, {width}; config in the model's diffusers folder.")
    except (OSError, ValueError, KeyError):
        pass
    return note
