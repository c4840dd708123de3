"""Training-free step caching in the host loop: a typed spec behind ``cache=SPEC`` / ``--cache SPEC``,
and the model function that skips part of the backbone on some steps.

SPEC is one of
  ``first_block:THRESHOLD``      first-block cache (transformers): run the first block; if its residual
                                 changed by less than THRESHOLD (mean |r - r_prev| / mean |r_prev|, as
                                 diffusers' FirstBlockCacheConfig) reuse the other blocks' residual
  ``taylorseer:INTERVAL[:ORDER]`` (transformers) the other blocks' output predicted by a Taylor series
                                 in the step index (finite differences over full steps), a full step
                                 every INTERVAL steps after 3 warm-up steps, ORDER 1 by default: what
                                 diffusers' TaylorSeerCacheConfig does with those blocks as cache_identifiers
                                 (factors kept in float32 here)
  ``deepcache:INTERVAL[:BRANCH]`` (UNets) the deep path's feature reused; a full step every INTERVAL
                                 steps; BRANCH shallow down/up block pairs always run (default 1), or
                                 BRANCH ``L<N>`` at DeepCache's layer granularity: conv_in, the next
                                 N - 1 down layers and the last N up resnets always run (L1 the cheapest)
  ``residual:INTERVAL[:ORDER]``  (transformers) the other blocks' residual (their output minus their
                                 input) cached and added to the first block's fresh output, extrapolated
                                 by a Taylor series of ORDER (1 by default) in the step index; full steps
                                 at gaps that ramp 1, 2, 3, ... up to INTERVAL (steps 0, 1, 3, 6, 10, 15,
                                 ...): the early steps, where the layout forms, run more often

The backbone is cut at load time into first / rest / tail graphs (``backbone_split``); the family
names the span by node-name prefixes.  ``first_block:0``, ``taylorseer:1``, ``deepcache:1``, ``residual:1`` never
skip anything, so they run the uncut backbone (bit-identical to no cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..families.base import SAMPLE, TIMESTEP
from ..samplers import cfg_combine
from ..samplers.cache_math import relative_change, taylor_coefficient

METHODS = ("first_block", "taylorseer", "deepcache", "residual")


@dataclass(frozen=True)
class CacheSpec:
    method: str
    threshold: float = 0.0  # first_block
    interval: int = 1  # taylorseer, deepcache, residual (its largest gap)
    order: int = 1  # taylorseer, residual
    branch: int = 1  # deepcache: shallow down/up block pairs
    layers: int = 0  # deepcache: > 0, the shallow part in skip layers instead (BRANCH "L<layers>")
    warmup: int = 3  # taylorseer: full steps before the first prediction (diffusers' default)

    @property
    def noop(self) -> bool:
        """Never skips: the uncut backbone runs."""
        return self.threshold == 0.0 if self.method == "first_block" else self.interval == 1

    def __str__(self) -> str:
        if self.method == "first_block":
            return f"first_block:{self.threshold:g}"
        if self.method in ("taylorseer", "residual"):
            return f"{self.method}:{self.interval}:{self.order}"
        return f"deepcache:{self.interval}:{self.branch_text}"

    @property
    def branch_text(self) -> str:
        return f"L{self.layers}" if self.layers else str(self.branch)


def parse_cache(spec) -> CacheSpec | None:
    """A CacheSpec from ``method:arg[:arg]`` (None / "" / "none": no caching); bad specs: one-line UserError."""
    if spec is None or isinstance(spec, CacheSpec):
        return spec
    if not isinstance(spec, str):
        raise UserError(f"cache must be a string like 'first_block:0.2', got {type(spec).__name__}")
    text = spec.strip()
    if text in ("", "none"):
        return None
    method, *args = text.split(":")
    usage = {"first_block": "first_block:THRESHOLD", "taylorseer": "taylorseer:INTERVAL[:ORDER]",
             "deepcache": "deepcache:INTERVAL[:BRANCH|L<N>]", "residual": "residual:INTERVAL[:ORDER]"}
    if method not in usage:
        raise UserError(f"unknown cache method {method!r} in {spec!r}; expected one of {', '.join(usage.values())}")
    want = 1 if method == "first_block" else 2
    if not 1 <= len(args) <= want:
        raise UserError(f"cache spec {spec!r}: expected {usage[method]}")
    layers = 0
    if method == "deepcache" and len(args) == 2 and args[1][:1] in ("L", "l"):
        args, layers = args[:1], _layer_count(spec, args[1][1:])
    try:
        if method == "first_block":
            threshold = float(args[0])
            if not math.isfinite(threshold) or threshold < 0:
                raise ValueError
            return CacheSpec(method, threshold=threshold)
        nums = [int(a) for a in args]
    except ValueError:
        raise UserError(f"cache spec {spec!r}: expected {usage[method]} with "
                        f"{'a threshold >= 0' if method == 'first_block' else 'integers'}") from None
    if nums[0] < 1:
        raise UserError(f"cache spec {spec!r}: INTERVAL must be >= 1")
    if method in ("taylorseer", "residual"):
        order = nums[1] if len(nums) > 1 else 1
        if not 0 <= order <= 4:
            raise UserError(f"cache spec {spec!r}: ORDER must be in [0, 4]")
        return CacheSpec(method, interval=nums[0], order=order)
    branch = nums[1] if len(nums) > 1 else 1
    if branch < 1:
        raise UserError(f"cache spec {spec!r}: BRANCH must be >= 1")
    return CacheSpec(method, interval=nums[0], branch=branch, layers=layers)


def _layer_count(spec: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"cache spec {spec!r}: a layer branch is L<N> with N >= 1 (e.g. deepcache:4:L1)")
    return int(text)


def parse_compiled_cache(spec) -> CacheSpec | None:
    """compile-loop's --cache: a SPEC as above or a bare method (its defaults); only the method and its
    structure (deepcache's BRANCH, taylorseer's ORDER) are compiled in, the rest is chosen per run."""
    text = spec.strip() if isinstance(spec, str) else spec
    return CacheSpec(text) if text in METHODS else parse_cache(spec)


def compiled_record(spec: CacheSpec) -> dict:
    """What a sampling graph's manifest entry records of the cache it was compiled with."""
    deep = {"layers": spec.layers} if spec.layers else {"branch": spec.branch}
    extra = {"deepcache": deep, "taylorseer": {"order": spec.order}, "residual": {"order": spec.order}}.get(spec.method, {})
    return {"method": spec.method, **extra}


def loop_feeds(record: dict | None, spec: CacheSpec | None) -> dict[str, np.ndarray]:
    """The Loop graph's cache inputs for `spec` (none: its defaults cache nothing); a graph compiled
    without this method (or with another BRANCH / ORDER) refuses the spec in one line."""
    if spec is None or spec.noop:
        return {}
    want = compiled_record(spec)
    if record != want:
        have = "without step caching" if not record else "for " + " ".join(
            v if k == "method" else f"BRANCH L{v}" if k == "layers" else f"{k.upper()} {v}" for k, v in record.items())
        raise UserError(f"cache {spec}: this folder's Loop graph was compiled {have}; recompile it with "
                        f"`onnxdiffusion compile-loop --cache {spec}` or run --loop host")
    if spec.method == "first_block":
        return {"cache_threshold": np.array(spec.threshold, np.float64)}
    return {"cache_interval": np.array(spec.interval, np.int64)}


# --- policies: when to run the span, and what stands in for it ---------------------------------

def _same_shape(names: list[str], f: dict, shape) -> str:
    for n in names:
        if f[n].shape == shape:
            return n
    raise UserError(f"step caching: no hidden-state candidate of shape {shape} in this backbone's cut")


class _Policy:
    """What a cache policy says before the first piece runs: by default, nothing (the whole first piece runs)."""

    prunes_first = False  # True: split_sessions also builds the first piece cut to what a cached step reads

    def skips(self, step: int) -> bool:
        return False


class _FirstBlock(_Policy):
    def __init__(self, spec: CacheSpec):
        self.threshold, self.prev, self.residual = spec.threshold, None, None
        self.hidden = self.probe = None

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        if self.hidden is None:
            return None  # the first call computes; update() settles which tensors are the stream
        r = f[self.hidden] - f[self.probe]
        if self.prev is not None:
            # diffusers' ratio of float32 means, summed in the order the Loop graph sums (cache_math)
            if not float(relative_change(r, self.prev)) > self.threshold:
                return f[self.hidden] + self.residual
        self.prev = r
        return None

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        if self.hidden is None:
            self.hidden = _same_shape(sg.hidden_in, f, out.shape)
            self.probe = _same_shape(sg.probe, f, out.shape)
            self.prev = f[self.hidden] - f[self.probe]
        self.residual = out - f[self.hidden]


class _Taylor(_Policy):
    """TaylorSeer on the span's output: finite differences over full steps, extrapolated in the step index."""

    def __init__(self, spec: CacheSpec):
        self.spec, self.factors, self.last_full = spec, [], None

    def _full(self, step: int) -> bool:
        s = self.spec
        return step < s.warmup or (step - s.warmup - 1) % s.interval == 0 or not self.factors

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        return None if self._full(step) else self.predict(step)

    def predict(self, step: int) -> np.ndarray:
        d = step - self.last_full
        pred = self.factors[0]
        for k, fk in enumerate(self.factors[1:], 1):
            pred = pred + fk * taylor_coefficient(d, k)
        return pred

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        new = [out.astype(np.float32)]
        if self.last_full is not None:
            gap = step - self.last_full
            for k in range(self.spec.order):
                if k >= len(self.factors):
                    break
                new.append((new[k] - self.factors[k]) / np.float32(gap))
        self.factors, self.last_full = new[: self.spec.order + 1], step


class _Residual(_Policy):
    """The span's residual (output - hidden input) on a ramping schedule, Taylor-extrapolated over full steps
    and added to this step's first-block output: a cached step still moves with what the first block sees."""

    prunes_first = True

    def __init__(self, spec: CacheSpec):
        self.spec, self.taylor, self.hidden = spec, _Taylor(spec), None
        self.next_full, self.gap = 0, 1

    def skips(self, step: int) -> bool:
        """Known before the first piece runs: a cached step (so only its image-stream output is needed)."""
        return self.hidden is not None and step < self.next_full

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        return f[self.hidden] + self.taylor.predict(step) if self.skips(step) else None

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        if self.hidden is None:
            self.hidden = _same_shape(sg.hidden_in, f, out.shape)
        self.taylor.update(step, f, out - f[self.hidden], sg)
        # full steps 0, 1, 3, 6, 10, ...: the gap grows by one after each, up to INTERVAL
        self.next_full, self.gap = step + self.gap, min(self.gap + 1, self.spec.interval)


class _Deep(_Policy):
    def __init__(self, spec: CacheSpec):
        self.interval, self.feature = spec.interval, None

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        return None if step % self.interval == 0 or self.feature is None else self.feature

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        self.feature = out


_POLICIES = {"first_block": _FirstBlock, "taylorseer": _Taylor, "deepcache": _Deep, "residual": _Residual}


class CachedBackbone:
    """model_fn(x, t) like GuidedBackbone's, running first -> (rest | cache) -> tail; one per generation."""

    def __init__(self, guided, sessions, sg, spec: CacheSpec):
        self.g, (self.first, self.rest, self.tail), self.sg = guided, sessions[:3], sg
        self.policy = _POLICIES[spec.method](spec)
        self.step, self.computed, self.full_steps = 0, 0, []
        # (session, its inputs, its outputs): the first piece, and (residual) the first piece cut down to what a
        # cached step reads, for the steps the policy knows in advance it skips
        self.pieces = [(s, [i.name for i in s.get_inputs()], [o.name for o in s.get_outputs()])
                       for s in (sessions[0], *sessions[3:])]
        self.tail_in = [i.name for i in self.tail.get_inputs()]

    def __call__(self, x: np.ndarray, t: float) -> np.ndarray:
        g, b = self.g, self.g.batch
        g.sample[:b] = x
        if g.guided:
            g.sample[b:] = x
        g.timestep.fill(t)
        feeds = {SAMPLE: g.sample, TIMESTEP: g.timestep, **g.conditioning}
        first, names_in, names_out = self.pieces[-1 if self.policy.skips(self.step) else 0]
        f = dict(zip(names_out, first.run(None, {n: feeds[n] for n in names_in})))
        out = self.policy.reuse(self.step, f, self.sg)
        if out is None:
            out = self.rest.run(None, {n: f[n] for n in self.sg.span_inputs})[0]
            self.policy.update(self.step, f, out, self.sg)
            self.computed += 1
            self.full_steps.append(self.step)
        self.step += 1
        pool = {**feeds, **f, self.sg.span_outputs[0]: out}
        res = self.tail.run(None, {n: pool[n] for n in self.tail_in})[0]
        if not g.guided:
            return res
        return cfg_combine(res[:b], res[b:], g.guidance, rescale=g.rescale)


def split_sessions(path, family, spec: CacheSpec, make):
    """(first, rest, tail[, first cut to a cached step's reads]) sessions and the SplitGraphs for this backbone file;
    `make(bytes | path)` -> session."""
    import onnx

    from ..onnxio import fp16_storage
    from .backbone_split import pruned
    from .dead_queries import without_dead_queries

    sg = cut(fp16_storage.expand(onnx.load(str(path)), str(path)), family, spec, f"cache {spec}")
    pieces = [sg.first, sg.rest, sg.tail]
    if _POLICIES[spec.method].prunes_first:  # a cached step reads the first block's image stream, not its text one
        made = {o.name for o in sg.first.graph.output}
        reads = [*sg.hidden_in, *(t for t in sg.tail_from_first if t in made)]
        piece = pruned(sg.first, reads, "cache_first_cached")
        without_dead_queries(piece)  # with the text stream's output gone, so are its query rows in the first block
        pieces.append(piece)
    return tuple(_piece_session(m, make) for m in pieces), sg


def cut(model, family, spec: CacheSpec, label: str):
    """The backbone cut for `spec` (host loop and Loop graph alike): SplitGraphs, or a one-line UserError."""
    import onnx

    from .backbone_split import split
    from .dead_queries import without_dead_queries

    without_dead_queries(model)  # as the uncached backbone's session has it (runtime.loading)
    try:
        names = [n.name for n in model.graph.node]
        span, probe = family.cache_span(spec.method, names, spec.branch, **({"layers": spec.layers} if spec.layers else {}))
        sg = split(model, span, probe, sample=SAMPLE)
    except ValueError as e:
        raise UserError(f"{label}: {e}") from None
    if len(sg.span_outputs) != 1:
        raise UserError(f"{label}: the cached span gives {len(sg.span_outputs)} sample-dependent outputs, "
                        "expected one hidden state")
    if spec.method != "deepcache" and sg.rest.graph.output[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise UserError(f"{label}: the cached span's output is quantized in this backbone; {spec.method} "
                        "needs a float hidden state (deepcache reuses it as it is)")
    return sg


INLINE_LIMIT = 2**31 - 2**24  # bytes: a piece this big or bigger goes through a file (protobuf's 2 GiB limit)


def _piece_session(model, make):
    """A session of one piece: from its bytes, or (over protobuf's 2 GiB, a full-size backbone's span) from a
    temporary file with its weights as external data, gone once the session holds them."""
    import tempfile
    from pathlib import Path

    import onnx

    from google.protobuf.message import EncodeError

    if sum(len(t.raw_data) for t in model.graph.initializer) < INLINE_LIMIT:
        try:  # (ByteSize and SerializeToString both refuse a message over 2 GiB)
            return make(model.SerializeToString())
        except EncodeError:
            pass
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-cache-") as tmp:
        path = Path(tmp) / "piece.onnx"
        # moves the weights out of `model` (no second in-memory copy kept): the piece lives on in the session
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="piece.onnx_data", size_threshold=1024)
        return make(str(path))


def cached_backbone(pipe, guided, spec: CacheSpec) -> CachedBackbone:
    """The pipeline's backbone cut for `spec` (cut once per pipeline and method), around this generation's
    GuidedBackbone buffers and conditioning."""
    import onnxruntime as ort

    from ..manifest import confined
    from .backbone import GuidedBackbone
    from .session import resolve_provider, session_options

    if not isinstance(guided, GuidedBackbone):
        raise UserError(f"cache {spec} runs with host buffers; this profile binds device buffers (io_binding=device)")
    splits = pipe.__dict__.setdefault("_cache_splits", {})
    key = (spec.method, spec.branch_text if spec.method == "deepcache" else 0)
    if key not in splits:
        path = confined(pipe.folder, pipe._backbone_info["path"], "backbone")
        opts = session_options(pipe._threads, pipe.memory)
        chain = pipe._chain.get("backbone") or resolve_provider(pipe.provider)
        splits[key] = split_sessions(path, pipe.family, spec,
                                     lambda b: ort.InferenceSession(b, sess_options=opts, providers=chain))
    sessions, sg = splits[key]
    return CachedBackbone(guided, sessions, sg, spec)
