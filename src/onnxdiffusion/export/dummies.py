"""Export-time dummy inputs from a component's declared I/O: named dims in, torch tensors out."""

from __future__ import annotations

import torch

from ..families.base import TIMESTEP, ComponentSpec


def dummy_feeds(spec: ComponentSpec, dims: dict[str, int], gen: torch.Generator, vocab: int = 0) -> dict:
    feeds = {}
    for t in spec.inputs:
        shape = tuple(dims[d] if isinstance(d, str) else d for d in t.dims)
        if t.dtype.startswith("int"):
            ids = torch.randint(0, max(vocab - 1, 1), shape, generator=gen)
            if vocab:
                ids[..., -1] = vocab - 1  # an end token for CLIP's pooler
            feeds[t.name] = ids.to(getattr(torch, t.dtype))
        elif t.name == TIMESTEP:
            feeds[t.name] = torch.linspace(999, 1, shape[0])
        elif spec.kind == "vae_encoder":
            feeds[t.name] = torch.rand(*shape, generator=gen) * 2 - 1
        else:
            feeds[t.name] = torch.randn(*shape, generator=gen)
    return feeds
