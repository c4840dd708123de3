"""`quantize`'s first stages: open the source folder, calibrate (data made on first use), plan the
build (what the recipe declared it needs), build. Each stage is a function with typed inputs and
outputs, so plan and build can be tested without capture, probe, latency or save."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import onnx
from google.protobuf.message import EncodeError

from ..folder.artifacts import (check_external_paths, check_output_folder, component_path, load_component,
                                read_manifest, verify_folder)
from ..errors import UserError
from ..families import get_family
from ..folder.manifest import Component
from ..onnxio import release_memory
from ..runtime.memory import MEMORY_MODES
from ..runtime.session import check_external_data
from . import files
from .configs import BACKBONE, QuantizeConfig
from .graphs import is_quantized, sort_graph
from .speed_plan import SpeedPlan, speed_plan

# the calibration pipeline's sessions for a backbone past the inline limit (runtime/memory.py's `bounded`, less its
# letting the backbone go after each generation: calibration runs it again for every prompt)
LARGE_CALIBRATION_MEMORY = replace(MEMORY_MODES["bounded"], release_backbone=False)


@dataclass
class Source:
    """The fp32 folder being quantized, checked, and its backbone as the recipe takes it."""

    folder: Path
    manifest: dict
    backbone_name: str  # the folder's (the family's) name for the backbone
    backbone_path: Path
    backbone: onnx.ModelProto  # past the inline limit and a recipe that takes one: a skeleton
    large: bool  # past the inline limit: weights left in their file until the quantizer reads them
    speed: SpeedPlan  # whether the backbone is timed (sessions opened) after the build

    def folder_name(self, name: str) -> str:
        """A recipe's component name (BACKBONE for the backbone) as this folder names it."""
        return self.backbone_name if name == BACKBONE else name

    @property
    def components(self) -> Mapping[str, Component]:
        return self.manifest.components


def open_source(model: Path, out: Path, config: QuantizeConfig, overwrite: bool, force: bool,
                measure_quality: bool, require_speedup: bool = False) -> Source:
    """Every input checked before any model runs."""
    from ..runtime.session import resolve_provider

    recipe = config.recipe
    resolve_provider(config.provider)  # installed?
    if config.correct and not measure_quality:
        raise UserError("--correct is fitted on the quality measurement's fp32 trajectories; it needs --quality")
    if out.resolve() == model.resolve():
        raise UserError("OUT must be a new folder, not MODEL itself")
    check_output_folder(out, overwrite, inputs=(model,))  # before anything is loaded
    manifest = read_manifest(model)
    verify_folder(model, manifest)
    check_external_paths(model, manifest)  # the output copies every component: all must be clean
    if manifest.quantization and not force:
        q = manifest.quantization
        prev = q if isinstance(q, str) else str((q.get("config") or {}).get("recipe", {}).get("name", "?"))
        raise UserError(f"{model} is already quantized (recipe {prev}); quantize the fp32 folder, or pass --force")
    name = get_family(manifest.family).backbone
    path = component_path(model, manifest, name)
    check_external_data(path)
    backbone = files.load_backbone(path)  # past the inline limit: a skeleton, weights left in their file
    large = files.data_dir(backbone) is not None
    if large and not recipe.takes_skeleton:
        backbone = files.with_weights(backbone)
    if is_quantized(backbone) and not force:
        raise UserError(f"{model}: the backbone is already quantized; quantize the fp32 folder, or pass --force")
    for target in recipe.targets:
        if target != BACKBONE and target not in manifest.components:
            raise UserError(f"{model}: no '{target}' component to convert")
    speed = speed_plan(config.latency, manifest.components[name].bytes)
    if require_speedup and not speed.measure:
        raise UserError(f"--require-speedup gates on the measured latency, which this run does not measure: "
                        f"{speed.why}")
    return Source(model, manifest, name, path, backbone, large, speed)


@dataclass
class Calibration:
    """The fp32 runs a recipe and its measurement use, each made on first use and kept."""

    pipe: object  # runtime.Pipeline of the source folder, fp32, CPU
    config: QuantizeConfig
    prompts: list[str]
    prompt_source: dict
    log: Callable[[str], None]
    _made: dict = field(default_factory=dict)

    def calibration(self):
        """The recipe's calibration set (random for int8-naive, fp32 trajectories otherwise)."""
        from .calibration import capture, naive_set

        if "calib" not in self._made:
            recipe, cal = self.config.recipe, self.config.calibration
            if recipe.random_calibration:
                self._made["calib"] = naive_set(self.pipe, recipe, cal.seed)
            else:
                self.log(f"capturing fp32 trajectories: {len(self.prompts)} prompts x {cal.steps} {cal.sampler} steps")
                self._made["calib"] = capture(self.pipe, self.prompts, cal)
                self._made["calib"].provenance["prompt_source"] = self.prompt_source
        return self._made["calib"]

    def trajectories(self):
        """fp32 runs over the calibration prompts: calibration data for calibrated recipes, and for
        every recipe the reference its backbone error (and --correct) is measured against."""
        from .calibration import capture

        if self.config.recipe.calibrated:
            return self.calibration()
        if "traj" not in self._made:
            self._made["traj"] = capture(self.pipe, self.prompts, self.config.calibration)
            self._made["traj"].provenance["prompt_source"] = self.prompt_source
        return self._made["traj"]

    def probe(self):
        from .runner import ImageProbe

        if "probe" not in self._made:
            n, cal = self.config.recipe.probe_count, self.config.calibration
            self._made["probe"] = ImageProbe(self.pipe, self.prompts[:n], cal.seed, cal.steps, cal.sampler, cal.guidance,
                                             self.config.threads)
        return self._made["probe"]

    def provenance(self) -> dict:
        calib = self._made.get("calib")
        return dict(calib.provenance) if calib is not None else {"kind": "none"}


def runs_fp32_backbone(config: QuantizeConfig, measure_quality: bool) -> bool:
    """Whether anything before the latency pair runs the fp32 backbone: calibration (on trajectories or random
    latents), the quality measurement, a recipe's image search, the precision schedule, --correct."""
    recipe = config.recipe
    return (measure_quality or recipe.calibrated or recipe.random_calibration or recipe.searches
            or config.schedule is not None or config.correct)


def calibrate(source: Source, config: QuantizeConfig, log: Callable[[str], None],
              measure_quality: bool = True) -> Calibration:
    from ..runtime import Pipeline
    from .calibration import load_prompts

    prompts, prompt_source = load_prompts(config.calibration)
    # a backbone past the inline limit runs unpacked from its mapped external data (file-backed pages the kernel can
    # drop, not an anonymous packed copy of the fp32 weights), the text encoders let go after each prompt
    memory = LARGE_CALIBRATION_MEMORY if source.large else None
    pipe = Pipeline.from_folder(source.folder, provider="cpu", verify=False, threads=config.threads, memory=memory)
    if not source.large or runs_fp32_backbone(config, measure_quality):
        pipe.backbone  # its session now: a graph ONNX Runtime refuses is one line here, not a crash mid-quantize
    # else: a backbone past the inline limit that nothing runs in fp32 gets no session (its weights' size in RSS)
    pipe.correction = pipe.precision_schedule = None  # (a forced re-quantization) references are the plain backbone's
    return Calibration(pipe, config, prompts, prompt_source, log)


def plan(source: Source, data: Calibration, config: QuantizeConfig, log: Callable[[str], None], measure_quality: bool):
    """What the builder gets (recipes.Context). For a backbone past the inline limit, everything the
    fp32 backbone must run for is made first; then its session (the size of the weights) is let go,
    so the quantizer's copy of the weights is the only one held."""
    from .components import calibration_feeds
    from .recipes import Context, prepare_unet

    recipe = config.recipe
    others = {name: load_component(source.folder, source.manifest, name) for name in recipe.targets if name != BACKBONE}
    ctx = Context(config, prepare_unet(source.backbone), others, data.calibration, data.probe, log,
                  lambda name: calibration_feeds(data.pipe, name, data.calibration(), data.prompts))
    if source.large:
        if measure_quality:
            data.trajectories()
        if measure_quality or recipe.searches:
            data.probe()
        if recipe.calibrated:
            data.calibration()
        if config.schedule is None and data.pipe.backbone_loaded:  # a precision schedule runs it again
            data.pipe.backbone = None
            release_memory()
    return ctx


def build(ctx, source: Source):
    """The recipe's registered builder; its graphs sorted. A model past protobuf's 2 GB limit that the
    recipe cannot serialize is one UserError."""
    from .recipes import BUILDERS

    recipe = ctx.config.recipe
    ctx.log(f"building {recipe.name}")
    try:
        built = BUILDERS[type(recipe)](ctx, recipe)
    except (EncodeError, ValueError) as e:
        if isinstance(e, ValueError) and "2GB" not in str(e):  # onnx's own size check says "2GB"
            raise
        raise UserError(f"recipe {recipe.name}: a model past protobuf's 2 GB limit could not be serialized ({e}); "
                        f"this recipe does not support backbones of {files.tensor_bytes(source.backbone) / 1e9:.2f} GB") from None
    for m in built.components.values():
        sort_graph(m)
    return built
