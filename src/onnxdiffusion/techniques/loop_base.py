"""What a per-step technique's Loop-graph twin offers the graph builder (loopgraph/builder.py), which calls these
hooks on each active technique in the registry's order and names none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Carried:
    """What the sampler's Loop carries for a technique: loop-carried state (body inputs/outputs, Loop inputs and
    final outputs), per-step scan outputs (body outputs, Loop outputs), and the graph outputs among those. The
    builder lists every technique's carried state before any scan output, as ONNX's Loop wants."""

    body_in: list = field(default_factory=list)
    body_out: list = field(default_factory=list)
    loop_in: list = field(default_factory=list)
    loop_out: list = field(default_factory=list)
    scan_body: list = field(default_factory=list)
    scan_out: list = field(default_factory=list)
    graph_out: list = field(default_factory=list)


@dataclass
class StepIO:
    """One step being built: its index tensor, its timestep (the table's t), and `n(hint)`, the step's name for a
    new tensor (unrolled: tagged per copy)."""

    i: str
    t: str
    tag: str
    n: Callable[[str], str]
    sample: str = ""  # the backbone's sample this step (the guidance batch)
    timestep: str = ""  # its timestep vector
    single_sample: str = ""  # the sample before the guidance batch is doubled


class LoopTechnique:
    """A technique's Loop-graph twin; every hook's default does nothing."""

    name = ""
    loop_only = True  # built for the Loop form only (not unrolled, not a whole-pipeline graph)

    def inputs(self) -> list:
        """Graph inputs it adds (each with a default initializer that leaves the plain Loop's image)."""
        return []

    def prologue(self, b, bb, form: str, state) -> None:
        """Constants and loaded pieces, before the loop; `bb` the loaded backbone, `form` loop | unrolled, `state`
        the builder's GraphState (loopgraph/state.py)."""

    def residual_inputs(self) -> list[str]:
        """Backbone inputs the technique feeds itself (not graph inputs)."""
        return []

    def initializers(self) -> list:
        """Outer-scope weights it adds."""
        return []

    def functions(self) -> list:
        return []

    def models(self) -> list:
        """The ONNX models it inlines beyond the backbone (their opsets count)."""
        return []

    def backbone_initializers(self) -> list | None:
        """The outer-scope weights that stand in for the backbone's (None: the backbone's own)."""
        return None

    def carried(self) -> Carried:
        return Carried()

    def backbone_inputs(self, b, state, bb, step: StepIO) -> dict[str, str]:
        """More of the backbone's inputs bound for this step (ControlNet residuals), by backbone input name."""
        return {}

    def call_backbone(self, b, bb, remap: dict[str, str], step: StepIO) -> str | None:
        """Appends this step's backbone call in its place (None: the plain call); returns its output."""
        return None

    def after_guidance(self, b, guided: str, step: StepIO) -> str:
        """The guided model output, changed (output correction) or as it is."""
        return guided

    def end_of_step(self, b, i: str, x_new: str, den: str, d_prev: str) -> tuple[str, str] | None:
        """After the step in the Loop body: (the Loop's cond output, the x to carry), or None."""
        return None
