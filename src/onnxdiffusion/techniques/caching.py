"""Training-free step caching, the shared part: the spec behind ``cache=SPEC`` / ``--cache SPEC`` (parsed here
once, into the method's typed spec: cache_methods.METHODS), the backbone cut into first / rest / tail graphs
(runtime/backbone_split; the family names the span by node-name prefixes), and the host loop's model function
that runs first -> (rest | the method's stand-in) -> tail. The Loop-graph twin is caching_graph.py.

SPEC is ``METHOD:ARG[:ARG]`` (each method's module says its own), or in Python the spec object or a dict
``{"method": METHOD, setting: value, ...}``. A spec that never skips (``first_block:0``, ``taylorseer:1``,
``deepcache:1``, ``residual:1``) runs the uncut backbone: bit-identical to no cache.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..families.base import SAMPLE, TIMESTEP
from ..samplers import cfg_combine
from .cache_base import CacheSpec
from .cache_methods import METHODS
from .host_base import HostTechnique

NAME = "cache"


def _usage() -> str:
    return ", ".join(m.usage for m in METHODS.values())


def parse_cache(spec) -> CacheSpec | None:
    """A method's typed spec from ``method:arg[:arg]``, a dict or a spec (None / "" / "none": no caching);
    bad specs: one-line UserError."""
    if spec is None or isinstance(spec, CacheSpec):
        return spec
    if isinstance(spec, dict):
        method = spec.get("method")
        if method not in METHODS:
            raise UserError(f"unknown cache method {method!r} in {spec!r}; expected one of {_usage()}")
        return METHODS[method].from_dict(spec)
    if not isinstance(spec, str):
        raise UserError(f"cache must be a string like 'first_block:0.2', got {type(spec).__name__}")
    text = spec.strip()
    if text in ("", "none"):
        return None
    method, *args = text.split(":")
    if method not in METHODS:
        raise UserError(f"unknown cache method {method!r} in {spec!r}; expected one of {_usage()}")
    kind = METHODS[method]
    if not 1 <= len(args) <= kind.max_args:
        raise UserError(f"cache spec {spec!r}: expected {kind.usage}")
    return kind.parse_args(spec, args)


def parse_compiled_cache(spec) -> CacheSpec | None:
    """compile-loop's --cache: a SPEC as above or a bare method (its defaults); only the method and its
    structure (deepcache's BRANCH, taylorseer's ORDER) are compiled in, the rest is chosen per run."""
    text = spec.strip() if isinstance(spec, str) else spec
    return METHODS[text].compiled_default() if isinstance(text, str) and text in METHODS else parse_cache(spec)


def compiled_record(spec: CacheSpec) -> dict:
    """What a sampling graph's manifest entry records of the cache it was compiled with."""
    return spec.record()


def loop_feeds(record: dict | None, spec: CacheSpec | None) -> dict[str, np.ndarray]:
    """The Loop graph's cache inputs for `spec` (none: its defaults cache nothing); a graph compiled
    without this method (or with another BRANCH / ORDER) refuses the spec in one line."""
    if spec is None or spec.noop:
        return {}
    spec.check_compiled(record)
    return spec.loop_feeds()


class CachedBackbone:
    """model_fn(x, t) like GuidedBackbone's, running first -> (rest | cache) -> tail; one per generation."""

    def __init__(self, guided, sessions, sg, spec: CacheSpec):
        self.g, (self.first, self.rest, self.tail), self.sg = guided, sessions[:3], sg
        self.policy = spec.policy()
        self.step, self.computed, self.full_steps = 0, 0, []
        # (session, its inputs, its outputs): the first piece, and (prunes_first) the first piece cut down to what a
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
    from ..runtime.backbone_split import pruned
    from ..runtime.dead_queries import without_dead_queries

    sg = cut(fp16_storage.expand(onnx.load(str(path)), str(path)), family, spec, f"cache {spec}")
    pieces = [sg.first, sg.rest, sg.tail]
    if spec.prunes_first:  # a cached step reads the first block's image stream, not its text one
        made = {o.name for o in sg.first.graph.output}
        reads = [*sg.hidden_in, *(t for t in sg.tail_from_first if t in made)]
        piece = pruned(sg.first, reads, "cache_first_cached")
        without_dead_queries(piece)  # with the text stream's output gone, so are its query rows in the first block
        pieces.append(piece)
    return tuple(piece_session(m, make) for m in pieces), sg


def cut(model, family, spec: CacheSpec, label: str):
    """The backbone cut for `spec` (host loop and Loop graph alike): SplitGraphs, or a one-line UserError."""
    import onnx

    from ..runtime.backbone_groups import split_groups, switches
    from ..runtime.backbone_split import split
    from ..runtime.dead_queries import without_dead_queries

    without_dead_queries(model)  # as the uncached backbone's session has it (runtime.loading)
    try:
        if switches(model):  # int8-timestep: each group's graph cut alike, each piece switching as the backbone did
            sg = split_groups(model, lambda names: family.cache_span(spec.method, names, **spec.span_args()),
                              sample=SAMPLE)
        else:
            names = [n.name for n in model.graph.node]
            span, probe = family.cache_span(spec.method, names, **spec.span_args())
            sg = split(model, span, probe, sample=SAMPLE)
    except ValueError as e:
        raise UserError(f"{label}: {e}") from None
    if len(sg.span_outputs) != 1:
        raise UserError(f"{label}: the cached span gives {len(sg.span_outputs)} sample-dependent outputs, "
                        "expected one hidden state")
    if spec.float_span and sg.rest.graph.output[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise UserError(f"{label}: the cached span's output is quantized in this backbone; {spec.method} "
                        "needs a float hidden state (deepcache reuses it as it is)")
    return sg


INLINE_LIMIT = 2**31 - 2**24  # bytes: a piece this big or bigger goes through a file (protobuf's 2 GiB limit)


def piece_session(model, make):
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
    """The pipeline's backbone cut for `spec` (cut once per pipeline and split key, kept in the pipeline's
    technique state), around this generation's GuidedBackbone buffers and conditioning."""
    from ..runtime.backbone import GuidedBackbone

    if not isinstance(guided, GuidedBackbone):
        raise UserError(f"cache {spec} runs with host buffers; this profile binds device buffers (io_binding=device)")
    splits = pipe.technique_state.get(NAME, dict)
    key = spec.split_key()
    if key not in splits:
        splits[key] = split_sessions(pipe.backbone_path, pipe.family, spec, pipe.backbone_session_maker())
    sessions, sg = splits[key]
    return CachedBackbone(guided, sessions, sg, spec)


class CacheHost(HostTechnique):
    """Step caching in a generation: the backbone cut around the guided backbone (host loop), or the compiled
    Loop graph's interval / threshold inputs."""

    name = NAME

    def __init__(self, spec: CacheSpec):
        self.spec = spec

    def wrap(self, model_fn, ctx):
        # first -> (rest | cached) -> tail
        return cached_backbone(ctx.pipe, ctx.backbone, self.spec.bind(ctx.pipe, ctx.steps))

    def graph_feeds(self, graph, ctx) -> dict:
        return loop_feeds(graph.cache, self.spec.bind(ctx.pipe, ctx.steps)) if graph.form == "loop" else {}
