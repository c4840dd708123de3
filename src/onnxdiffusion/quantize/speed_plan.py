"""Whether `quantize` opens sessions of the backbone to measure it (`--latency auto | on | off`): the latency pair
(the fp32 and the new backbone side by side: the report's ratio and `--require-speedup`'s gate), ORT's fused-op
count and the resident-memory figure. Each holds the backbone's weights in some form; at release size the fp32
one alone is what the machine cannot hold (FLUX.2 [klein]'s backbone is 15.5 GB of fp32 weights, Z-Image's 24.6
GB), while the build itself streams its weights (quantize/streamed.py). Off, the report says "not measured" and
why; it never claims a verdict it did not measure."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..runtime.guards import physical_memory

SETTINGS = ("auto", "on", "off")
# auto measures while the fp32 backbone's weights are at most this share of the machine's memory: the pair holds
# the fp32 session beside the new one (and the build's own working set), so half is what leaves room for both
AUTO_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class SpeedPlan:
    setting: str  # what was asked: auto | on | off
    measure: bool
    why: str | None = None  # the sentence the report gives when nothing is measured

    def to_dict(self) -> dict:
        return {"setting": self.setting, "measured": self.measure, **({"why": self.why} if self.why else {})}


def check_setting(setting: str) -> str:
    if setting not in SETTINGS:
        raise UserError(f"--latency must be one of {', '.join(SETTINGS)}, got {setting!r}")
    return setting


def speed_plan(setting: str, fp32_bytes: int, memory: int | None = None) -> SpeedPlan:
    """The plan for a backbone of `fp32_bytes` stored weights on a machine of `memory` bytes (default: this one)."""
    check_setting(setting)
    if setting == "on":
        return SpeedPlan(setting, True)
    if setting == "off":
        return SpeedPlan(setting, False, "--latency off: no session of the backbone was opened to time it")
    memory = physical_memory() if memory is None else memory
    if fp32_bytes <= AUTO_MEMORY_SHARE * memory:
        return SpeedPlan(setting, True)
    return SpeedPlan(setting, False, f"the fp32 backbone ({fp32_bytes / 1e9:.1f} GB of weights) is over "
                                     f"{AUTO_MEMORY_SHARE:.0%} of this machine's {memory / 1e9:.1f} GB, too large to "
                                     f"time beside the quantized one (--latency on measures it anyway)")
