"""ControlNet's per-step part: the nets' residuals into the backbone cut to take them, in place of the plain
guided backbone (runtime/controlnet.py loads and prepares the nets; samplers/graph_control.py is the Loop twin)."""

from __future__ import annotations

from .host_base import HostTechnique

NAME = "controlnet"


class ControlHost(HostTechnique):
    name = NAME

    def __init__(self, controls: list):
        self.controls = controls

    def backbone(self, ctx):
        from ..runtime.controlnet import controlled_backbone

        model_fn = controlled_backbone(ctx.pipe, self.controls, ctx.prompts, ctx.negatives, ctx.guidance, ctx.height,
                                       ctx.width, ctx.shape, ctx.steps, extra=ctx.extra)
        return model_fn, model_fn.g

    def graph_feeds(self, graph, ctx) -> dict:
        if not graph.controlnets:
            return {}
        from ..runtime.controlnet import graph_feeds

        # every net built into the graph is fed (scale 0 when this run does not use it)
        return graph_feeds(ctx.pipe, graph.controlnets, self.controls, ctx.steps, ctx.shape[0], ctx.height, ctx.width)

    def settings(self) -> dict:
        if not self.controls:
            return {}
        return {"controlnets": [{"name": c.spec.name, "scale": c.spec.scale, "start": c.spec.start, "end": c.spec.end}
                                for c in self.controls]}
