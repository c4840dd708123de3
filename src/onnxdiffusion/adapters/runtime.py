"""The run-time side of LoRA: adapter tensors as extra feeds of the text encoders' and backbone's sessions.

The insertion points are graph inputs with rank-0 default initializers. On the host loop's backbone a
folder with points runs the graph derived from them (adapters/fused.py): without an adapter the plain graph,
with one the merged weights of the set, bound once as OrtValues beside the sample on the same IO binding as a
plain step (FedBackbone): ORT 1.32 accepts `bind_ortvalue_input` for an input that has an initializer, while
`bind_cpu_input` refuses it ("Failed to find NodeArg ... in the def list"), and ORT's own `LoraAdapter` is
silently ignored by `run_with_iobinding` (runtime/backbone.py's FedBackbone binds them). A caller's own
backbone session (a precision schedule's second backbone) and the compiled sampling graphs take the insertion
points' A/B feeds. Nothing here imports the run time: the pipeline calls in (Pipeline.lora), never the reverse.
"""

from __future__ import annotations

import numpy as np


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


class RuntimeLora:
    """One pipeline's run-time LoRA state (Pipeline.lora): the backbone with its points' branches taken out and
    the set's merged weights (adapters/fused.py; None: the points graph runs as it is), and the LoRA files read
    so far (LRU). The pipeline calls into it with what it needs; nothing here reads the pipeline."""

    def __init__(self, manifest: dict, backbone: str, fused=None):
        self.manifest, self.backbone, self.fused = manifest, backbone, fused
        self.files = None  # a LoraCache, made with the first LoRA (its module loads onnx)

    def feeds(self, loras, loop: str = "host"):
        """Pipeline.lora_feeds: checked before any model runs; None without LoRAs. `loras` may also be feeds
        build_feeds made already for this folder's manifest (serve converts each adapter set once)."""
        from ..errors import UserError
        from .feeds import AdapterFeeds, LoraCache, build_feeds

        if not loras:
            return None
        graph = self.manifest.components.get(f"sampler_{loop}")
        if loop != "host" and not (graph is not None and graph.lora):
            raise UserError(f"this folder's '{loop}' graph has no LoRA inputs (compile it from a folder with "
                            f"insertion points: `lora points`, then `compile-loop`), or use the host loop")
        if isinstance(loras, AdapterFeeds):
            return loras
        if self.files is None:
            self.files = LoraCache()
        return build_feeds(self.manifest, loras, self.files)

    def step_inputs(self, session, adapter) -> tuple:
        """(the fused session or None: run `session` or the pipeline's backbone, arrays to bind) for the
        backbone's step with `adapter`: the set's merged weights when there is a fused backbone and no caller's
        session (a precision schedule's second backbone), else the insertion points' A/B."""
        if session is not None or self.fused is None:
            return None, adapter.for_component(self.backbone)
        return self.fused.fused(), self.fused.feeds(adapter)


def sampling_graph_inputs(pipe, loras, component: str = "sampler_loop_whole") -> dict[str, np.ndarray]:
    """The inputs that run `loras` ([(path, scale), ...] or lora_feeds' AdapterFeeds) in the folder's compiled
    sampling graph `component`, for a caller running it with onnxruntime alone (a --whole graph: token ids in,
    image out, the text encoders' layers included). Empty for no LoRA."""
    from ..errors import UserError
    from ..techniques.lora import graph_feeds as named, graph_prefixes

    graph = pipe.manifest.components.get(component)
    if graph is None or graph.kind != "sampling_graph":
        raise UserError(f"{pipe.folder} has no sampling graph {component!r} (run `onnxdiffusion compile-loop`)")
    adapter = pipe.lora_feeds(loras)
    if not adapter:
        return {}
    if not graph.lora:
        raise UserError(f"this folder's {component!r} graph has no LoRA inputs (compile it from a folder with "
                        f"insertion points: `lora points`, then `compile-loop`)")
    inside = graph_prefixes(graph, pipe.family.backbone)
    if missing := sorted(c for c, f in adapter.feeds.items() if f and c not in inside):
        raise UserError(f"this folder's {component!r} graph does not run the LoRA's {', '.join(missing)} layers "
                        f"(a graph without --whole, or compiled before text-encoder inputs: recompile it with "
                        f"`onnxdiffusion compile-loop --whole`)")
    return named(graph, adapter.feeds, pipe.family.backbone)
