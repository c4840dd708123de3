"""`QuantizeOptions`: the flat view of a quantize run that the `quantize` verb's options are (each field's help
written once here; cli/options.py makes the options), and `config(model)`, which turns it into the typed
QuantizeConfig (recipe options parsed, calibration settings resolved from the model's recommended ones)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..fields import option

RECIPE_HELP = "fp16 | int8-dynamic | int8-static | int8-naive | int8-timestep | mixed | int4-weights | w4a8 | fp8 | nvfp4"


@dataclass(frozen=True)
class QuantizeOptions:
    recipe: str = option(help=RECIPE_HELP)
    recipe_fields: tuple[str, ...] = option((), "recipe field KEY=VALUE (repeatable), e.g. -O groups=4",
                                            flags=("--option", "-O"))
    calib_prompts: Path | None = option(
        None, "calibration prompts, one per line (default: the scene world's calib split)")
    calib_count: int = option(32, "calibration prompts to use")
    calib_seed: int = option(10_000, "prompt i starts from the latents of seed CALIB_SEED + i")
    # None: the model's recommended (manifest), else the defaults named in the help
    calib_sampler: str | None = option(None, "default: the model's recommended, else ddim")
    calib_steps: int | None = option(None, "default: the model's recommended, else 20")
    calib_guidance: float | None = option(None, "default: the model's recommended, else 4.0")
    correct: bool = option(False, "fit a per-timestep scale/bias correction of the backbone output, applied in the "
                                  "sampler")
    precision_schedule: str | None = option(
        None, "run a higher-precision backbone at the steps where the quantized one hurts the image most, chosen by "
              "measured per-step sensitivity: auto | K (steps) | KEY=VALUE,... (steps, target, max_latency, "
              "precision=fp32|fp16, prompts)")
    provider: str = option("cpu", "ONNX Runtime execution provider, e.g. cpu | cuda | tensorrt | openvino")
    threads: int = option(1, "ONNX Runtime threads for calibration and latency")
    latency_runs: int = option(30, "timed backbone calls per side for the report's latency ratio")
    latency: str = option("auto", "auto | on | off: open sessions of the backbone to time fp32 against the new one "
                                  "(the report's ratio, --require-speedup's gate, ORT's fused ops, resident memory); "
                                  "auto: off when the fp32 backbone is over half this machine's memory (the report "
                                  "then says 'not measured' and why)")
    quality: bool = option(True, "measure backbone SQNR and probe-image PSNR vs fp32 (--no-quality: skip, e.g. "
                                 "random weights)")
    require_speedup: bool = option(False, "fail (no output) unless the backbone is measurably faster than fp32")
    force: bool = option(False, "quantize a folder that is already quantized")
    overwrite: bool = option(False, "replace an existing output folder written by this tool")

    def recipe_options(self) -> dict[str, str]:
        """-O KEY=VALUE items -> {key: value} (the recipe parses and checks the values)."""
        options = {}
        for item in self.recipe_fields:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise UserError(f"--option expects KEY=VALUE, got {item!r}")
            options[key.strip()] = value.strip()
        return options

    def config(self, model: Path):
        """The QuantizeConfig of this run on `model` (its manifest read for unset calibration settings)."""
        from .configs import CalibrationConfig, QuantizeConfig, recipe_class
        from .schedule import ScheduleConfig

        built = recipe_class(self.recipe).with_options(self.recipe_options())
        sampler, steps, guidance = self.calib_sampler, self.calib_steps, self.calib_guidance
        if None in (sampler, steps, guidance):
            # calibrate on the trajectories the model is run with: its recommended settings (manifest)
            from ..folder.artifacts import read_manifest

            rec = read_manifest(model).recommended
            sampler = sampler if sampler is not None else (rec.sampler if rec.sampler is not None else "ddim")
            steps = steps if steps is not None else (rec.steps if rec.steps is not None else 20)
            guidance = guidance if guidance is not None else (rec.guidance if rec.guidance is not None else 4.0)
        prompts = str(self.calib_prompts) if self.calib_prompts else None
        return QuantizeConfig(
            recipe=built,
            calibration=CalibrationConfig(count=self.calib_count, prompts_file=prompts, seed=self.calib_seed,
                                          sampler=sampler, steps=steps, guidance=guidance),
            correct=self.correct, provider=self.provider, threads=self.threads, latency_runs=self.latency_runs,
            latency=self.latency,
            schedule=ScheduleConfig.parse(self.precision_schedule) if self.precision_schedule is not None else None,
        )

    def run(self, model: Path, out: Path, log=None) -> dict:
        """quantize(model, out, self.config(model), ...) with this run's flags; returns the report."""
        from .api import quantize

        return quantize(model, out, self.config(model), overwrite=self.overwrite, force=self.force,
                        require_speedup=self.require_speedup, log=log, measure_quality=self.quality)
