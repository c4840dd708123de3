"""ControlNet's per-step part: the nets' residuals into the backbone cut to take them, in place of the plain
guided backbone (``ControlHost``; runtime/controlnet.py loads and prepares the nets), and in the sampling graph
(``ControlLoop``, over controlnet_graph.py's builders)."""

from __future__ import annotations

from .host_base import HostTechnique
from .loop_base import LoopTechnique

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


class ControlLoop(LoopTechnique):
    """The nets inlined beside the residual-taking backbone in each step (controlnet_graph.py builds
    them): `models` the ControlNets, `residuals` the backbone's residual inputs they feed, `cond_only[k]`: net
    k runs on the guidance batch's conditional half."""

    name = NAME
    loop_only = False

    def __init__(self, models: list, residuals: list[str], cond_only: list[bool] | None = None):
        self.nets_models, self.residuals, self.cond_only = list(models), list(residuals), cond_only
        self.nets: list = []

    def residual_inputs(self) -> list[str]:
        return self.residuals

    def inputs(self) -> list:
        from .controlnet_graph import COND, control_inputs

        return control_inputs([next(len(i.type.tensor_type.shape.dim) for i in m.graph.input if i.name == COND)
                               for m in self.nets_models])

    def prologue(self, b, bb, form: str, state) -> None:
        from ..loopgraph.builder import cond_input_names
        from .controlnet_graph import control_prologue, load_net

        self.nets = [load_net(m, self.residuals, k) for k, m in enumerate(self.nets_models)]
        # a cond-only net reads each conditioning input's cond half
        control_prologue(b, state, self.nets, self.residuals, self.cond_only,
                         {k: cond_input_names(k)[0] for k in state.context})

    def initializers(self) -> list:
        return [t for net in self.nets for t in net.initializers]

    def functions(self) -> list:
        return [f for net in self.nets for f in net.functions]

    def models(self) -> list:
        return self.nets_models

    def backbone_inputs(self, b, state, bb, step) -> dict[str, str]:
        from .controlnet_graph import control_residuals

        io = {"sample": step.sample, "timestep": step.timestep, "control:sample": step.single_sample,
              "control:t": step.t, **state.context}
        return {bb.io[f"cond:{r}"]: v for r, v in control_residuals(b, state, io, step.i, step.tag, step.n).items()}
