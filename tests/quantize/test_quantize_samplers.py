"""Calibration samples with any sampler the run time has: quantize's list is the samplers' own registry
(it once was a copy that lacked pndm, unipc, lcm and tcd, so `--calibration-sampler unipc` was refused)."""

from __future__ import annotations

import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.quantize.configs import SAMPLER_NAMES, CalibrationConfig
from onnxdiffusion.samplers import SAMPLERS


def test_calibration_accepts_every_runtime_sampler():
    assert SAMPLER_NAMES == SAMPLERS and {"pndm", "unipc", "lcm", "tcd"} <= set(SAMPLER_NAMES)
    for name in SAMPLERS:
        assert CalibrationConfig(sampler=name).sampler == name
    with pytest.raises(UserError, match="calibration sampler must be one of"):
        CalibrationConfig(sampler="nope")


@pytest.mark.parametrize("sampler", ["unipc"])
def test_capture_with_a_multistep_sampler(sampler):
    """A sampler the old copy refused calibrates on the embedded model (one backbone call per step); the
    embedded folder's own scheduler decides the rest, as for `generate` (its PNDM config asks for the
    Runge-Kutta warm-up, which the run time refuses for both)."""
    from onnxdiffusion.quantize.calibration import capture
    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(threads=1)
    cal = capture(pipe, ["a red circle"] * 4, CalibrationConfig(count=4, steps=3, batch=4, sampler=sampler))
    assert cal.provenance["sampler"] == sampler and cal.num_steps == len(cal.timesteps) >= 3
