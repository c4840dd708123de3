"""ControlNet's Loop twin: ControlLoop and its builders, the twin of controlnet.py's ControlledBackbone.

The backbone is the residual-taking cut (runtime/control_graph.py); each compiled net is inlined beside it
in the step body, fed the step's [uncond; cond] sample, timestep and conditioning, its control image
(graph input `control_image_K`: (B, 3, H, W) in [0, 1], or a latent-conditioned net's VAE latents, doubled for the guidance batch once before the loop)
and `control_scale_K` x `control_keep_K`[i] as its conditioning_scale (keep: the per-step column of
diffusers' control_guidance_start/end, indexed by the run's step i). The nets' residuals are summed in net
order and bound to the backbone's residual inputs. A net left out of a run is fed scale 0: its residuals
are zeros, as the host loop's skipped net.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ..loopgraph.state import GraphState
from .controlnet import NAME
from .loop_base import LoopTechnique

COND, SCALE = "controlnet_cond", "conditioning_scale"


def control_inputs(ranks: list[int]) -> list:
    """Per net: its control image (pixels (B, 3, H, W) or a latent-conditioned net's VAE latents, in the
    net's controlnet_cond layout of that rank), scale and keep column."""
    f = TensorProto.FLOAT
    ins = []
    for k, rank in enumerate(ranks):
        dims = ["batch", *(f"control_image_{k}_{j}" for j in range(1, rank))]
        ins += [helper.make_tensor_value_info(f"control_image_{k}", f, dims),
                helper.make_tensor_value_info(f"control_scale_{k}", f, []),
                helper.make_tensor_value_info(f"control_keep_{k}", f, [f"control_steps_{k}"])]
    return ins


def control_prologue(b, pre: GraphState, nets: list, residuals: list[str], cond_only=None, cond_names=None) -> None:
    """`nets`: Backbone-like inlinable ControlNets (io "out:NAME" per residual); once-per-run values.
    `cond_only[k]`: net k runs on the conditional half of the guidance batch and both halves take its
    samples (QwenImageControlNetPipeline); `cond_names`: conditioning name -> its cond-only graph input."""
    b.const("control_scale_shape", np.array([1], np.int64))
    guided = pre.mode != "none"
    cond_only = list(cond_only or [False] * len(nets))
    state = []
    for k, net in enumerate(nets):
        image = f"control_image_{k}"
        half = guided and bool(cond_only[k])
        pixels = b.op("Concat", [image, image], f"control_pixels_{k}", axis=0) if guided and not half else image
        rows = b.op("Squeeze", [b.op("Slice", [b.op("Shape", [f"control_keep_{k}"], f"control_keep_shape_{k}"),
                                               "slice0_start", "slice0_end"], f"control_keep_rows_{k}"), "axes0"],
                    f"control_keep_len_{k}")
        state.append({"net": net, "pixels": pixels, "half": half,
                      "last": b.op("Sub", [rows, "one_i64"], f"control_keep_last_{k}")})
    pre.control = {"nets": state, "residuals": residuals}
    if any(s["half"] for s in state):
        first = cond_names[next(iter(pre.context))]
        batch = b.op("Slice", [b.op("Shape", [first], "control_cond_shape"), "slice0_start", "slice0_end"],
                     "control_cond_batch")
        pre.control["half"] = {"context": {k: cond_names[k] for k in pre.context}, "batch": batch}


def control_residuals(b, pre: GraphState, remap: dict, i: str, tag: str, n) -> dict[str, str]:
    """Inline every net for this step; backbone residual input name -> the summed residual tensor.
    `remap`: the step's sample and timestep (guidance batch), its single-batch sample "control:sample" and
    scalar timestep "control:t", and the conditioning by name."""
    from ..loopgraph.backbone import inline_backbone

    ctl = pre.control
    sums: dict[str, str] = {}
    for k, s in enumerate(ctl["nets"]):
        net = s["net"]
        keep = b.op("Gather", [f"control_keep_{k}", b.op("Min", [i, s["last"]], n(f"control_keep_idx_{k}"))],
                    n(f"control_keep_i_{k}"), axis=0)
        scale = b.op("Reshape", [b.op("Mul", [f"control_scale_{k}", keep], n(f"control_scale_i_{k}")),
                                 "control_scale_shape"], n(f"control_scale_vec_{k}"))
        if s["half"]:
            context = ctl["half"]["context"]
            sample = remap["control:sample"]
            timestep = b.op("Expand", [remap["control:t"], ctl["half"]["batch"]], n(f"control_t_{k}"))
        else:
            context, sample, timestep = remap, remap["sample"], remap["timestep"]
        feeds = {net.io["sample"]: sample, net.io["timestep"]: timestep,
                 net.io[f"cond:{COND}"]: s["pixels"], net.io[f"cond:{SCALE}"]: scale}
        feeds.update({net.io[key]: context[key[len("cond:"):]] for key in net.io
                      if key.startswith("cond:") and key[len("cond:"):] not in (COND, SCALE)})
        inline_backbone(b.nodes, net, feeds, tag)
        for r in ctl["residuals"]:
            out = tag + net.io[f"out:{r}"] if tag else net.io[f"out:{r}"]
            if s["half"]:  # both halves of the guidance batch take the conditional samples
                out = b.op("Concat", [out, out], n(f"control_both_{k}_{r}"), axis=0)
            sums[r] = out if r not in sums else b.op("Add", [sums[r], out], n(f"control_sum_{k}_{r}"))
    return sums


def load_net(model, residuals: list[str], k: int):
    """Compiled ControlNet k as an inlinable component: its residual outputs named as the backbone's inputs."""
    from ..loopgraph.backbone import BACKBONE_IO, conditioning_inputs, load_component

    io = {"sample": BACKBONE_IO["sample"], "timestep": BACKBONE_IO["timestep"], "out": residuals[-1],
          **{f"out:{r}": r for r in residuals}, f"cond:{COND}": COND, f"cond:{SCALE}": SCALE}
    io.update({f"cond:{i.name}": i.name for i in conditioning_inputs(model)})
    return load_component(model, io, f"controlnet_{k}/")


class ControlLoop(LoopTechnique):
    """The nets inlined beside the residual-taking backbone in each step (the builders above): `models` the ControlNets, `residuals` the backbone's residual inputs they feed, `cond_only[k]`: net
    k runs on the guidance batch's conditional half."""

    name = NAME
    loop_only = False

    def __init__(self, models: list, residuals: list[str], cond_only: list[bool] | None = None):
        self.nets_models, self.residuals, self.cond_only = list(models), list(residuals), cond_only
        self.nets: list = []

    def residual_inputs(self) -> list[str]:
        return self.residuals

    def inputs(self) -> list:
        return control_inputs([next(len(i.type.tensor_type.shape.dim) for i in m.graph.input if i.name == COND)
                               for m in self.nets_models])

    def prologue(self, b, bb, form: str, state) -> None:
        from ..loopgraph.builder import cond_input_names

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
        io = {"sample": step.sample, "timestep": step.timestep, "control:sample": step.single_sample,
              "control:t": step.t, **state.context}
        return {bb.io[f"cond:{r}"]: v for r, v in control_residuals(b, state, io, step.i, step.tag, step.n).items()}
