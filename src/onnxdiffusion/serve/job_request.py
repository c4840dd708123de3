"""A validated request as the queue holds it: what renders it, what it may be batched with, what is echoed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class JobRequest:
    """A validated request, its size already snapped to a bucket and its model already routed."""

    prompt: str
    negative_prompt: str
    n: int
    width: int
    height: int
    steps: int
    sampler: str
    guidance: float
    seed: int
    model: str  # the model that renders it
    model_requested: str
    fallback: bool  # True when `model` differs from `model_requested` (degraded optimized model)
    requested_size: str
    preview: bool = False
    edit: object = None  # /v1/images/edits: its EditInput (serve/edits.py); such a job renders alone
    notices: tuple[str, ...] = ()  # what the service changed about the request (a resized upload)
    lora: object = None  # its LoraSet (serve/loras.py): names, scales and the converted feeds; None: no adapter

    def batch_key(self) -> tuple:
        alone = None if self.edit is None else id(self.edit)
        base = (self.model, self.width, self.height, self.steps, self.sampler, self.guidance, alone)
        # adapters change the weights: only requests with the same adapter set (files and scales) share a batch
        return base if self.lora is None else (*base, self.lora.key)

    def settings(self) -> dict:
        d = asdict(replace(self, edit=None, lora=None))  # asdict would deep-copy the adapter's arrays
        d["bucket"] = f"{self.width}x{self.height}"
        d["size"] = d["bucket"]
        for name in ("preview", "edit", "notices", "lora"):
            d.pop(name)
        if self.edit is not None:
            d.update(self.edit.settings())
        if self.lora is not None:
            d["lora"] = self.lora.settings()
        return d
