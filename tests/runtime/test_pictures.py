"""runtime/pictures.py: the Pipeline's picture stages live in their own mixin, reached through the Pipeline."""

from __future__ import annotations

from onnxdiffusion.runtime.pictures import PictureStages
from onnxdiffusion.runtime.pipeline import Pipeline


def test_the_pipeline_has_the_picture_stages_once():
    assert issubclass(Pipeline, PictureStages)
    for name in ("decode", "encode_image", "encode_pixels", "backbone_extra_channels"):
        assert getattr(Pipeline, name) is getattr(PictureStages, name)  # not defined a second time in pipeline.py
