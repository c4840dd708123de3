"""The per-step techniques: the order they compose in, and the one table of which cannot combine (with why).

``generate`` (runtime/run_loop.py, and the CLI before it loads a model), ``compile-loop`` (loopgraph/compile.py) and the
docs (docs/techniques.md, checked against this table by tests/techniques/test_techniques.py) all read ``CONFLICTS``;
``serve`` runs generate's check before it queues a job (serve/edits.refuse_conflicts).

Names: ``lora`` (run-time LoRA), ``controlnet``, ``cache`` (step caching), ``correction`` (output correction),
``precision_schedule``, ``stop`` (adaptive stopping), ``inpaint`` (inpainting's blend after each step with a
regular backbone), ``inpaint_backbone`` (inpainting with an inpainting backbone: the picture and mask as the
backbone's extra input channels, fed beside the sample; no hooks of its own). A technique counts as active when its
spec would change the image (``cache first_block:0`` or ``stop-early 0`` is not active). A row may key on one
property of its first technique's spec (``only``: ``lora (backbone)`` is a LoRA with backbone layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

# the composition order, host loop and Loop graph alike: LoRA on the guided backbone, an inpainting backbone's extra
# channels beside its sample; ControlNet replacing it;
# step caching around it; output correction; the precision schedule; the stopping test inside the loop;
# inpainting's blend after each step
ORDER = ("lora", "inpaint_backbone", "controlnet", "cache", "correction", "precision_schedule", "stop", "inpaint")

# the loop forms each technique runs in (generate --loop); a technique not listed runs in every form
FORMS = {"cache": ("host", "loop"), "stop": ("host", "loop")}
FORM_ERRORS = {
    "cache": "cache {cache} runs in the host loop and the Loop graph (--loop host | loop)",
    "stop": "stop-early {stop}: an unrolled graph runs all its steps; use --loop loop or host",
}


@dataclass(frozen=True)
class Conflict:
    first: str
    second: str
    forms: tuple[str, ...]  # the loop forms where the pair is refused (host, loop, unrolled)
    compiled: bool  # True: not even built into one sampling graph (compile-loop refuses); False: refused per run
    reason: str  # why, for the docs
    message: str  # the one-line error; {first} / {second} (and {cache}, {stop}, ...) the active specs
    # the attribute of the first technique's spec the row keys on: refused only where it is true ("": every spec;
    # a spec without it, such as True, counts as true); read only when the rest of the row matches
    only: str = ""

    def applies(self, values: dict) -> bool:
        return not self.only or bool(getattr(values[self.first], self.only, True))


ALL = ("host", "loop", "unrolled")
CONFLICTS = (
    Conflict("cache", "stop", ALL, False,
             # measured (experiments/adaptive_stop): shapes-mmdit first_block:0.1 + stop 0.05: 6 of 20 steps,
             # 27.7 dB, -6.2 strict points; stop 0.05 alone: 11.8 steps, 40.5 dB, no loss
             "a cached step reuses features, so its denoised estimate barely moves and the test fires right after it",
             "stop-early {stop} with cache {cache}: a cached step's denoised estimate looks settled because its "
             "features are reused; use one or the other"),
    Conflict("stop", "inpaint", ALL, False,
             "the kept region is blended into x, not into the denoised estimate an early stop returns",
             "stop-early {stop}: not with inpainting (the kept region is blended into x, not into the denoised "
             "estimate an early stop returns)"),
    Conflict("cache", "controlnet", ALL, True,
             "the ControlNet residuals enter the blocks a cached step skips; not built yet",
             "step caching with ControlNet is not supported yet (drop --cache)"),
    Conflict("lora", "controlnet", ALL, True,
             "the ControlNet path runs the backbone cut to take residuals, which has no LoRA inputs yet",
             "run-time LoRAs with ControlNet are not supported yet (merge the LoRA at export: export --lora)"),
    Conflict("controlnet", "precision_schedule", ALL, True,
             "the high-precision backbone takes no ControlNet residuals yet",
             "a backbone with a precision schedule does not take ControlNet residuals yet"),
    Conflict("cache", "precision_schedule", ("loop", "unrolled"), True,
             "the Loop graph's cache If and the schedule's If both replace the backbone call; not built yet",
             "--cache {cache_method}: step caching in the Loop graph does not support a precision schedule yet "
             "(use --loop host)"),
    Conflict("cache", "lora", ("loop", "unrolled"), True,
             "the cut backbone pieces in the Loop graph take no run-time LoRA tensors yet",
             "--cache {cache_method}: step caching in the Loop graph does not support run-time LoRA yet "
             "(use --loop host)"),
    Conflict("correction", "precision_schedule", ("loop", "unrolled"), True,
             "compile-loop builds one of the two backbone remedies into a graph, not both",
             "a backbone with both a correction and a precision schedule is not supported"),
    # keyed on a LoRA with backbone layers: a text-encoder-only one runs (its tensors never reach the backbone)
    Conflict("lora", "inpaint_backbone", ("host",), False,
             "the host loop's LoRA backbone (runtime/backbone.FedBackbone) binds no extra input channels yet; a "
             "text-encoder-only LoRA runs",
             "a run-time LoRA on an inpainting backbone (extra input channels) is not supported yet when it has "
             "backbone layers (a text-encoder-only LoRA runs)", only="backbone"),
)


def conflict(first: str, second: str, form: str, compiled: bool = False) -> Conflict | None:
    """The table's row for this pair in this loop form (`compiled`: only a pair not built into one graph),
    or None: they combine."""
    for c in CONFLICTS:
        if {c.first, c.second} == {first, second} and form in c.forms and (c.compiled or not compiled):
            return c
    return None


def check_combination(active: dict[str, object], form: str, compiled: bool = False) -> None:
    """Refuses, in one line, the first pair of `active` techniques (name -> its spec, or True) the table names
    for this loop form, then a technique that does not run in the form. Order: the table's. `compiled`: only
    what cannot be built into one sampling graph (compile-loop: each technique there is a run-time choice)."""
    names = {n for n, v in active.items() if v is not None and v is not False}
    values = {n: active[n] for n in names}
    if "cache" in values:
        values["cache_method"] = getattr(values["cache"], "method", values["cache"])
    for c in CONFLICTS:
        if c.first in names and c.second in names and form in c.forms and (c.compiled or not compiled) \
                and c.applies(values):
            raise UserError(c.message.format(**values))
    if compiled:
        return
    for name in ORDER:
        if name in names and form not in FORMS.get(name, ALL):
            raise UserError(FORM_ERRORS[name].format(**values))


def docs_table() -> str:
    """The Markdown table docs/techniques.md carries (tests/techniques/test_techniques.py checks it is this)."""
    rows = ["| technique | with | refused in | compile-loop refuses | why |", "| --- | --- | --- | --- | --- |"]
    for c in CONFLICTS:
        first = f"{c.first} ({c.only})" if c.only else c.first
        rows.append(f"| {first} | {c.second} | {', '.join(c.forms)} | {'yes' if c.compiled else 'no'} | {c.reason} |")
    return "\n".join(rows)
