"""Run-time LoRA: its tensors bound beside the backbone's inputs (adapters/runtime.py builds the fed backbone
the host loop's guided backbone becomes; adapters/graph.py names a sampling graph's LoRA inputs)."""

from __future__ import annotations

from .host_base import HostTechnique

NAME = "lora"


class LoraHost(HostTechnique):
    """The adapter rides in the context (HostContext.adapter), so every guided backbone made carries it."""

    name = NAME

    def __init__(self, adapter):
        self.adapter = adapter

    def graph_feeds(self, graph, ctx) -> dict:
        from ..adapters.runtime import graph_feeds

        return graph_feeds(ctx.pipe, graph, self.adapter) or {}
