"""What a per-step technique offers the host loop (runtime/run_loop.py) and a compiled graph's run, which call
these hooks on each active technique in the registry's order (registry.ORDER) and name none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class HostContext:
    """One generation as the techniques see it: the pipeline, the conditioning's inputs, the latent shape, the
    steps that run, and the backbones made for it (closed when the loop ends)."""

    pipe: Any
    prompts: list[str]
    negatives: list[str] | None
    guidance: float
    height: int
    width: int
    shape: tuple[int, ...]
    steps: int
    extra: Any = None  # an inpainting backbone's extra input channels
    adapter: Any = None  # run-time LoRA feeds
    references: Any = None  # an editing model's reference inputs (runtime/references.py)
    backbone: Any = None  # the guided backbone the wrappers sit on
    backbones: list = field(default_factory=list)

    def guided(self, session=None):
        """A guided backbone model function for this generation (`session`: another backbone's, e.g. high precision)."""
        return self.pipe.guided_backbone(self.prompts, self.negatives, self.guidance, self.height, self.width,
                                         self.shape, session, extra=self.extra, adapter=self.adapter,
                                         references=self.references)


class HostTechnique:
    """A per-step technique in one generation; every hook's default does nothing."""

    name = ""

    def backbone(self, ctx: HostContext):
        """(model_fn, its guided backbone) in place of the plain guided backbone, or None."""
        return None

    def wrap(self, model_fn, ctx: HostContext):
        """model_fn(x, t) around the one so far."""
        return model_fn

    def stops(self, i: int, num_steps: int, den, prev) -> bool:
        """Whether the loop ends after step i (the result is then den, the x0 estimate)."""
        return False

    def after_step(self):
        """iter_sample's after_step(i, x) -> x, or None."""
        return None

    def graph_feeds(self, graph, ctx: HostContext) -> dict:
        """A compiled sampling graph's run-time inputs for this technique."""
        return {}

    def settings(self) -> dict:
        """What the result's settings record of it, beyond the options."""
        return {}
