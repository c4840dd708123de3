"""`BenchOptions`: the settings of one bench run; each field with help is also an option of the bench verb
(cli/options.py). Import-light: the CLI builds its options from this class at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..fields import option


def _recipes(items) -> tuple[str, ...]:
    from .quantized import parse_recipes

    return parse_recipes(items)


@dataclass(frozen=True)
class BenchOptions:
    """Settings of one bench run (None: the default for the model / --arch)."""

    model: Path | None = None
    variants: tuple[str, ...] = option(
        (), "names to run, comma-separated or repeated (default: every variant found), e.g. "
            "torch-fp32,ort-fp32,ort-fp32-loop,ort-fp32-dpmpp,ort-int8-dynamic,optimum-ort,openvino-fp32",
        flags=("--variants",))
    variants_dir: Path | None = option(
        None, "folder whose sub-folders are quantized model folders (default: MODEL's siblings)")
    # steps of the main sampler (default 20; --arch: arch.ARCHES)
    steps: int | None = option(None, "steps (default 20; --arch sd15: 10, the full-width families: 4)")
    # every row's sampler, peers included (None: the model's own; --arch: arch.ARCHES, sd15 DDIM)
    sampler: str | None = option(None, "the sampler every variant runs, peers included; a peer that cannot run it is "
                                       "refused (default: the model's own; --arch sd15: ddim)")
    # every row's decoder: None (the VAE; --arch sd15-lcm: tiny) | full | tiny (the folder's TAESD, the peers' too)
    decoder: str | None = option(None, "full | tiny: every row's decoder, peers included (tiny: the folder's "
                                       "vae_decoder_tiny; default: the VAE, --arch sd15-lcm: tiny)")
    fast_steps: int | None = option(None, "DPM-Solver++ 2M steps for *-dpmpp (default steps/2)")
    # timed repeats (default 5); --isolate: rounds of fresh processes (default 3)
    repeats: int | None = option(None, "timed repeats per variant, interleaved, after warm-up (default 5); --isolate: "
                                       "rounds (default 3)")
    # held-out prompts for the quality columns (default 16; sd15: none)
    prompts: int | None = option(None, "held-out prompts for the quality columns (default 16)")
    batch: int = option(8, "batch size of the quality pass")
    # None: the model's chosen guidance (its eval.json), else 4.0
    guidance: float | None = option(None, "default: the model's evaluated guidance (--arch sd15: 7.5), else 4.0")
    size: int | None = option(None, "image height = width (default: the model's)")
    # None: each library's default
    threads: int | None = option(None, "intra-op threads for every runtime (default: libraries')")
    rss: str = option("subprocess", "subprocess (peak RSS per variant in a fresh process) | off")
    # None (the given model) | arch.ARCHES (random weights, speed/memory/size only)
    arch: str | None = option(None, "sd15 | sd15-tiny | sd15-lcm | sd15-lcm-tiny | sdxl | sd3 | flux | qwenimage | "
                                    "zimage | flux2_klein: full-size (sd15, zimage, flux2_klein; sd15-lcm: the FastSD CPU "
                                    "recipe) or full-width random-weight model, speed/memory/size only")
    # --arch zimage / flux2_klein: depth overrides for proof runs (arch/release.py); None: release size
    arch_depth: str | None = option(
        None, "--arch zimage | flux2_klein: BACKBONE[/ENCODER] depth for proof runs, e.g. 1,1/2 (Z-Image main,refiner "
              "layers / narrow text-encoder layers; klein double,single / >= 28); default: release size")
    # --arch: where the model is built (reused when present)
    work: Path | None = option(
        None, "--arch: build folder (default /tmp/ARCH-bench); also where --quantize caches its folders "
              "(WORK/quantized; default without --arch: ~/.cache/onnxdiffusion/bench-quantized) and peers their "
              "converted models")
    # recipes whose quantized siblings the run builds first (quantized.py)
    quantize: tuple[str, ...] = option(
        (), "RECIPE[,RECIPE]: build these quantized siblings first (onnxdiffusion quantize, cached by the model's "
            "content hash + recipe) and bench them as ort-RECIPE", flags=("--quantize",), convert=_recipes)
    # every variant in fresh processes, interleaved rounds (isolate.py)
    isolate: bool = option(False, "measure each variant in fresh processes, interleaved rounds: CPU time and peak RSS "
                                  "per phase (speed and memory only, no quality columns)", flags=("--isolate",))
    # Pipeline.from_folder(memory=...) for our ONNX Runtime variants (e.g. lean)
    memory: str | None = option(
        None, "memory options for our ONNX Runtime variants, as generate --memory (e.g. lean)")
    out: Path = option(Path("bench-out"), "output directory", flags=("--out", "-o"))
    progress: bool = option(True, "no progress bar", flags=("--quiet/--no-quiet",), invert=True)
    # hardware profile (name or YAML) for the ONNX Runtime variants
    profile: str | None = option(None, "hardware profile (name or YAML file) for the ONNX Runtime variants")
    # report.html embeds its PNGs (False: links the files beside it)
    embed_images: bool = option(True, "report.html links the PNGs beside it instead of embedding them (committed "
                                      "reports)", flags=("--link-images",), invert=True)
    judge_path: Path | None = None
    peer_timeout: float = 3600.0
