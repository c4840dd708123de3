"""Run-time LoRA: its tensors bound beside the backbone's inputs, in the host loop and in the sampling graphs.

Host loop: adapters/runtime.py builds the fed backbone the guided backbone becomes (the adapter rides in the
HostContext). Loop / unrolled graphs (the graph twin, below): the sampling graph inlines the backbone under a
prefix ("unet/..."), its rank-0 A/B defaults among the outer-scope initializers the Loop body reads. Listing
those initializers as graph inputs makes them overridable, so one compiled graph runs with or without adapters
(same defaults: the plain image). A `--whole` graph also inlines the text encoders (under "text_encoder/",
"text_encoder_2/", ...): their points become inputs the same way, so a LoRA with text-encoder layers runs
inside it too. The sampling graph's manifest record (`lora`: the prefixes) is read here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx
from onnx import TensorProto, helper

from ..adapters.points import A_SUFFIX, B_SUFFIX
from ..folder.manifest import Component
from .host_base import HostTechnique

NAME = "lora"


class LoraUse:
    """A generation's run-time LoRAs as the registry's table sees them (truthy: there are some). `backbone`: whether
    any has layers in the backbone, asked of `touches()` (which reads the files) only when a row keyed on it
    matches the rest of the generation (lora x inpaint_backbone), and asked once."""

    def __init__(self, touches: Callable[[], bool]):
        self._touches, self._backbone = touches, None

    def __bool__(self) -> bool:
        return True

    @property
    def backbone(self) -> bool:
        if self._backbone is None:
            self._backbone = bool(self._touches())
        return self._backbone


def backbone_layers(feeds, backbone: str) -> bool:
    """Whether adapter feeds (adapters.feeds.AdapterFeeds) have layers in `backbone`; unknown feeds (None) may."""
    return feeds is None or bool(feeds.for_component(backbone))


class LoraHost(HostTechnique):
    """The adapter rides in the context (HostContext.adapter), so every guided backbone made carries it."""

    name = NAME

    def __init__(self, adapter):
        self.adapter = adapter

    def graph_feeds(self, graph, ctx) -> dict:
        if not self.adapter:
            return {}
        pipe = ctx.pipe
        return graph_feeds(pipe.manifest.components[f"sampler_{graph.form}"], self.adapter.feeds, pipe.family.backbone)


# --- the graph twin: compile-loop exposes the points, a run feeds them ------------------------------------
def _first_module(entry: Component | None) -> str | None:
    targets = (entry.lora_targets if entry is not None else None) or {}
    return next(iter(targets), None)


def expose_lora_inputs(model: onnx.ModelProto, components: Mapping[str, Component], backbone: str,
                       text_encoders: tuple[str, ...] = ()) -> dict | None:
    """Add the inlined components' insertion points as graph inputs; returns the sampling component's `lora`
    record: the backbone's prefix and, per component whose points the graph computes, its prefix."""
    module = _first_module(components.get(backbone))
    if module is None:
        return None
    g = model.graph
    have = {i.name for i in g.input}
    names = [t.name for t in g.initializer if t.name.endswith((A_SUFFIX, B_SUFFIX)) and t.name not in have]
    inlined = {f"{name}/" for name in text_encoders}
    # the backbone's prefix is the graph builder's choice; a text encoder's is "<name>/" (graph_whole.text_prologue)
    prefix = next((n[:-len(module + A_SUFFIX)] for n in names
                   if n.endswith(module + A_SUFFIX) and n[:-len(module + A_SUFFIX)] not in inlined), None)
    if prefix is None:  # the weights live elsewhere (a precision schedule's If branches): no adapter inputs
        return None
    prefixes = {backbone: prefix}
    for name in text_encoders:
        first = _first_module(components.get(name))
        if first is not None and f"{name}/{first}{A_SUFFIX}" in names:
            prefixes[name] = f"{name}/"
    known = tuple(prefixes.values())
    added = 0
    for t in g.initializer:
        if t.name in have or not t.name.endswith((A_SUFFIX, B_SUFFIX)) or not t.name.startswith(known):
            continue
        dims = [d if d else f"lora_rank_{added // 2}" for d in t.dims]
        g.input.append(helper.make_tensor_value_info(t.name, TensorProto.FLOAT, dims))
        added += 1
    return {"prefix": prefix, "inputs": added, "components": prefixes}


def graph_prefixes(graph: Component, backbone: str) -> dict[str, str]:
    """component -> input-name prefix in a sampling graph (graphs compiled before `components`: the backbone's)."""
    lora = graph.lora or {}
    if "components" in lora:
        return dict(lora["components"])
    return {backbone: lora["prefix"]} if lora.get("prefix") is not None else {}


def graph_feeds(graph: Component, feeds: dict[str, dict], backbone: str) -> dict:
    """Adapter feeds (component -> {input: array}) under the sampling graph's input names, for the components
    the graph computes (a text encoder outside it takes its feeds in its own session)."""
    prefixes = graph_prefixes(graph, backbone)
    return {prefixes[comp] + k: v for comp, named in feeds.items() if comp in prefixes for k, v in named.items()}
