"""What compile-loop takes besides the folders: `compile_loop(model, out, **asdict(LoopOptions(...)))`; each field's
help is also the compile-loop verb's option (cli/options.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import option

CACHE_HELP = (
    "--form loop: build in step caching with this method, first_block | taylorseer[:INTERVAL[:ORDER]] | "
    "residual[:INTERVAL[:ORDER]] | magcache | deepcache[:INTERVAL[:BRANCH]] (BRANCH: block pairs or L<N> skip "
    "layers; ORDER, BRANCH compiled in; generate --cache picks the interval or threshold per run)")


@dataclass(frozen=True)
class LoopOptions:
    form: str = option("loop", "loop (step count at run time) | unrolled (fixed --steps)")
    steps: int | None = option(None, "--form unrolled: the fixed step count it unrolls")
    whole: bool = option(False, "token ids in, uint8 image out: text encoder + loop + VAE decoder")
    # None: tuned for a float backbone, else what the host loop runs (compile.py)
    cpu_tuned: bool | None = option(None, "inline ORT's fully optimized CPU graph (default for a float backbone: as "
                                          "fast as the host loop, checked against the CPU at load) or a portable one",
                                    flags=("--cpu-tuned/--portable",))
    cache: str | None = option(None, CACHE_HELP)
    controlnets: tuple[str, ...] = option((), "NAME: build this ControlNet of the folder into the graph beside the "
                                              "backbone (repeatable; generate --controlnet NAME then runs in it)",
                                          flags=("--controlnet",))
    stop_early: bool = option(False, "--form loop: build in adaptive stopping (the Loop's cond output tests the "
                                     "denoised estimate's change; generate --stop-early picks THRESHOLD[:MIN_STEPS] "
                                     "per run)")
    overwrite: bool = option(False, "replace an existing output folder written by this tool")
