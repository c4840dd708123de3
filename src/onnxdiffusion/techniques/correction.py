"""Output correction (quantize --correct): the guided backbone output scaled and shifted per timestep. The
fitted table is runtime/hooks/correction.py's ``OutputCorrection``; its Loop twin samplers/graph_correct.py."""

from __future__ import annotations

from .host_base import HostTechnique

NAME = "correction"


class CorrectionHost(HostTechnique):
    name = NAME

    def __init__(self, correction):
        self.correction = correction

    def wrap(self, model_fn, ctx):
        return self.correction.wrap(model_fn)
