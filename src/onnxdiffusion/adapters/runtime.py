"""The run-time side of LoRA: adapter tensors as extra feeds of the text encoders' and backbone's sessions.

The insertion points are graph inputs with rank-0 default initializers. ORT's IO binding refuses to
bind an input that has an initializer ("Failed to find NodeArg ... in the def list", measured on
1.32), and ORT's own `LoraAdapter` is silently ignored by `run_with_iobinding`; so a generation with
an adapter runs the backbone through `run()` with the adapter's arrays in the feed (FedBackbone),
and a generation without one keeps the bound path untouched (the plain image, bit for bit).
"""

from __future__ import annotations

import numpy as np

from ..families.base import OUT, SAMPLE, TIMESTEP
from ..runtime.backbone import GuidedBackbone
from ..samplers import cfg_combine


class FeedingSession:
    """An ORT session whose every run() also feeds `extra` (other attributes go to the session)."""

    def __init__(self, session, extra: dict[str, np.ndarray]):
        self._session = session
        self._extra = extra

    def run(self, output_names, input_feed, run_options=None):
        return self._session.run(output_names, {**self._extra, **input_feed}, run_options)

    def __getattr__(self, name):
        return getattr(self._session, name)


def with_feeds(session, extra: dict[str, np.ndarray] | None):
    return FeedingSession(session, extra) if extra else session


class FedBackbone(GuidedBackbone):
    """GuidedBackbone whose step runs `session.run` with the adapter's tensors beside the sample."""

    def __init__(self, session, latents_shape, cond, uncond, guidance: float, rescale: bool = False,
                 extra: dict[str, np.ndarray] | None = None):
        super().__init__(session, latents_shape, cond, uncond, guidance, rescale)
        self.feeds = {SAMPLE: self.sample, TIMESTEP: self.timestep, **self.conditioning, **(extra or {})}

    def __call__(self, x: np.ndarray, t: float) -> np.ndarray:
        b = self.batch
        self.sample[:b] = x
        if self.guided:
            self.sample[b:] = x
        self.timestep.fill(t)
        out = self.session.run([OUT], self.feeds)[0]
        if not self.guided:
            return out
        return cfg_combine(out[:b], out[b:], self.guidance, rescale=self.rescale)


def pipeline_feeds(pipe, loras, loop: str = "host"):
    """Pipeline.lora_feeds: checked before any model runs; None without LoRAs. `loras` may also be feeds
    build_feeds made already for this folder's manifest (serve converts each adapter set once)."""
    from ..errors import UserError
    from .feeds import AdapterFeeds, LoraCache, build_feeds

    if not loras:
        return None
    info = pipe.manifest["components"].get(f"sampler_{loop}", {})
    if loop != "host" and not info.get("lora"):
        raise UserError(f"this folder's '{loop}' graph has no LoRA inputs (compile it from a folder with insertion "
                        f"points: `lora points`, then `compile-loop`), or use the host loop")
    if isinstance(loras, AdapterFeeds):
        adapter = loras
    else:
        if getattr(pipe, "_lora_cache", None) is None:
            pipe._lora_cache = LoraCache()
        adapter = build_feeds(pipe.manifest, loras, pipe._lora_cache)
    return adapter


def graph_feeds(pipe, graph, adapter) -> dict | None:
    """The LoRA tensors of the components the sampling graph computes, under its input names (adapters/graph.py)."""
    if not adapter:
        return None
    from .graph import graph_feeds as named

    return named(pipe.manifest["components"][f"sampler_{graph.form}"], adapter.feeds, pipe.family.backbone)


def sampling_graph_inputs(pipe, loras, component: str = "sampler_loop_whole") -> dict[str, np.ndarray]:
    """The inputs that run `loras` ([(path, scale), ...] or lora_feeds' AdapterFeeds) in the folder's compiled
    sampling graph `component`, for a caller running it with onnxruntime alone (a --whole graph: token ids in,
    image out, the text encoders' layers included). Empty for no LoRA."""
    from ..errors import UserError
    from .graph import graph_feeds as named, graph_prefixes

    info = pipe.manifest["components"].get(component)
    if info is None or info.get("kind") != "sampling_graph":
        raise UserError(f"{pipe.folder} has no sampling graph {component!r} (run `onnxdiffusion compile-loop`)")
    adapter = pipeline_feeds(pipe, loras)
    if not adapter:
        return {}
    if not info.get("lora"):
        raise UserError(f"this folder's {component!r} graph has no LoRA inputs (compile it from a folder with "
                        f"insertion points: `lora points`, then `compile-loop`)")
    inside = graph_prefixes(info, pipe.family.backbone)
    if missing := sorted(c for c, f in adapter.feeds.items() if f and c not in inside):
        raise UserError(f"this folder's {component!r} graph does not run the LoRA's {', '.join(missing)} layers "
                        f"(a graph without --whole, or compiled before text-encoder inputs: recompile it with "
                        f"`onnxdiffusion compile-loop --whole`)")
    return named(info, adapter.feeds, pipe.family.backbone)
