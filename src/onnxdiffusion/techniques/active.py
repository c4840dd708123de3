"""A generation's techniques: the specs parsed once from its options (``Specs``), the registry's check of what
is on, and the host techniques in the registry's order."""

from __future__ import annotations

from dataclasses import dataclass

from .cache_base import CacheSpec
from .caching import CacheHost, parse_cache
from .controlnet import ControlHost
from .correction import CorrectionHost
from .inpaint import BlendHost
from .lora import LoraHost
from .precision import ScheduleHost
from .registry import ORDER, check_combination
from .stop import StopHost, StopSpec, parse_stop


@dataclass(frozen=True)
class Specs:
    """The options' technique specs, typed (as given: ``cache_on`` / ``stop_on`` leave out one that changes nothing,
    cache first_block:0 or stop-early 0)."""

    cache: CacheSpec | None = None
    stop: StopSpec | None = None

    @property
    def cache_on(self) -> CacheSpec | None:
        return None if self.cache is None or self.cache.noop else self.cache

    @property
    def stop_on(self) -> StopSpec | None:
        return None if self.stop is None or self.stop.noop else self.stop

    def check_graph(self, form: str, graph) -> None:
        """Each active spec's own answer (from its record of the compiled graph) to whether this loop form
        runs it; `graph()` opens the folder's SamplingGraph for --loop loop, only when a spec asks."""
        for spec in (self.cache_on, self.stop_on):  # the registry's order
            if spec is not None:
                spec.check_graph(form, graph)


def parse_specs(options) -> Specs:
    """The one place GenerateOptions' technique strings (or objects) are parsed."""
    return Specs(cache=parse_cache(options.cache), stop=parse_stop(options.stop_early))


def check(specs: Specs, form: str, *, lora=False, controlnet=False, schedule=False, inpaint=False,
          inpaint_backbone=False) -> None:
    """The registry's refusals for this generation (one line, before any model runs)."""
    check_combination({"cache": specs.cache_on, "stop": specs.stop_on, "lora": lora, "controlnet": controlnet,
                       "precision_schedule": schedule, "inpaint": inpaint, "inpaint_backbone": inpaint_backbone},
                      form)


def host_techniques(pipe, specs: Specs, form: str, adapter=None, controls=None, start=None, noise0=None) -> list:
    """The generation's techniques, in the registry's order. A compiled graph's run also feeds the ControlNets
    built into it when this run uses none (scale 0)."""
    on = {
        "lora": LoraHost(adapter) if adapter else None,
        "controlnet": ControlHost(controls or []) if controls or form != "host" else None,
        "cache": CacheHost(specs.cache_on) if specs.cache_on is not None else None,
        "correction": CorrectionHost(pipe.correction) if pipe.correction is not None and form == "host" else None,
        "precision_schedule": (ScheduleHost(pipe.precision_schedule, pipe.backbone_high)
                               if pipe.precision_schedule is not None and form == "host" else None),
        "stop": StopHost(specs.stop_on) if specs.stop_on is not None else None,
        "inpaint": BlendHost(start, noise0) if start is not None and start.keep is not None and form == "host" else None,
    }
    return [on[name] for name in ORDER if on.get(name) is not None]  # (inpaint_backbone: no hooks)
