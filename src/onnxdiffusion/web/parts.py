"""The whole-pipeline graph cut in three, so the page can step the sampling loop itself (progress per step).

    prologue.onnx  the whole graph's nodes before its Loop: token ids -> conditioning (text encoders, combine),
                   the starting latents and the other values the Loop body reads from outside
    step.onnx      the Loop body as a graph of its own: one sampler step (backbone call, guidance, update),
                   the body's outer-scope reads as inputs (or initializers, for the whole graph's constants)
    epilogue.onnx  the nodes after the Loop: final latents -> uint8 image (the VAE decoder)

No node is changed, only where its inputs come from, so running the three in turn (prologue once, step once
per table row, epilogue once) computes what the whole graph computes. `run_parts` is that loop in Python on
ONNX Runtime CPU: the twin of pipeline.js's, and the tests' proof that the cut changes nothing.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..errors import UserError

PARTS = ("prologue", "step", "epilogue")
LOOP = "sampler_loop"
# the Loop body's own inputs/outputs (iteration count, condition, carried latents, carried D)
ITER, COND_IN, X_IN, D_IN = "iter", "cond_in", "x_carried", "d_carried"
COND_OUT, X_OUT, D_OUT = "cond_out", "x_out", "d_out"


def _subgraphs(node: onnx.NodeProto):
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        for g in a.graphs:
            yield g


def free_names(graph: onnx.GraphProto) -> set[str]:
    """Names `graph` (and its subgraphs) read but do not define: its outer-scope references."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    used: set[str] = set()
    for n in graph.node:
        used |= {x for x in n.input if x}
        for g in _subgraphs(n):
            used |= free_names(g)
        defined |= set(n.output)
    return used - defined


def _slice(nodes: list[onnx.NodeProto], targets: set[str], stop: set[str]) -> list[onnx.NodeProto]:
    """The nodes needed to compute `targets`, walking back no further than the names in `stop`; in graph order."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output}
    keep, todo = set(), [t for t in targets if t not in stop]
    while todo:
        name = todo.pop()
        k = producer.get(name)
        if k is None or k in keep:
            continue
        keep.add(k)
        n = nodes[k]
        reads = {x for x in n.input if x}
        for g in _subgraphs(n):
            reads |= free_names(g)
        todo += [x for x in reads if x not in stop]
    return [nodes[k] for k in sorted(keep)]


def _needs(nodes: list[onnx.NodeProto]) -> set[str]:
    made: set[str] = set()
    used: set[str] = set()
    for n in nodes:
        used |= {x for x in n.input if x}
        for g in _subgraphs(n):
            used |= free_names(g)
        made |= set(n.output)
    return used - made


def _typed(name: str, types: dict[str, onnx.ValueInfoProto]) -> onnx.ValueInfoProto:
    if name not in types:
        raise UserError(f"the page cannot step this graph: no type known for {name!r} (it crosses a part boundary)")
    vi = onnx.ValueInfoProto()
    vi.CopyFrom(types[name])
    vi.name = name
    return vi


def split_whole_graph(model: onnx.ModelProto) -> tuple[dict[str, onnx.ModelProto], dict]:
    """({part: model}, the wiring: each part's inputs and where they come from) for a whole graph with one Loop."""
    g = model.graph
    loops = [n for n in g.node if n.op_type == "Loop"]
    if len(loops) != 1 or loops[0].name != LOOP:
        raise UserError("the page steps the whole graph's sampling Loop; this graph has no single sampler Loop")
    loop = loops[0]
    body = next(_subgraphs(loop))
    if [i.name for i in body.input] != [ITER, COND_IN, X_IN, D_IN] or [o.name for o in body.output] != [COND_OUT, X_OUT, D_OUT]:
        raise UserError("the sampler Loop's body is not (iter, cond, x, D) -> (cond, x, D)")
    steps, _, x0, d0 = loop.input
    final, _ = loop.output
    k = list(g.node).index(loop)
    before, after = list(g.node[:k]), list(g.node[k + 1:])
    inits = {t.name: t for t in g.initializer}
    graph_inputs = {i.name: i for i in g.input}
    outer = free_names(body)
    epi = _slice(after, {o.name for o in g.output}, stop={final} | set(graph_inputs))
    epi_needs = _needs(epi) - {final} - set(inits)
    computed = {o for n in before for o in n.output}
    pro_out = sorted(((outer | epi_needs) & computed) | {x0, d0})
    pro = _slice(before, set(pro_out), stop=set(graph_inputs))
    types = _value_types(model)
    types.update({i.name: i for i in g.input})
    types[final] = types[X_IN] = types[X_OUT] = types[x0]
    types[D_IN] = types[D_OUT] = types[d0]
    types[ITER] = helper.make_tensor_value_info(ITER, onnx.TensorProto.INT64, [])

    def make(name, nodes, inputs, outputs) -> onnx.ModelProto:
        reads = _needs(nodes)
        initializers = [inits[x] for x in sorted(reads) if x in inits]
        ins = [_typed(x, types) for x in inputs]
        graph = helper.make_graph(nodes, name, ins, outputs, initializer=initializers)
        m = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="onnxdiffusion")
        m.ir_version = model.ir_version
        used_functions = {(n.domain, n.op_type) for n in _all_nodes(graph)}
        m.functions.extend(f for f in model.functions if (f.domain, f.name) in used_functions)
        return m

    pro_inputs = sorted(x for x in _needs(pro) if x in graph_inputs or x not in inits)
    prologue = make("prologue", pro, pro_inputs, [_typed(x, types) for x in pro_out])
    step_nodes = [n for n in body.node if COND_OUT not in n.output]
    step_reads = sorted(x for x in _needs(step_nodes) if x not in {ITER, X_IN, D_IN} and (x in graph_inputs or x not in inits))
    step = make("step", step_nodes, [ITER, X_IN, D_IN, *step_reads], [_typed(X_OUT, types), _typed(D_OUT, types)])
    epi_inputs = sorted(x for x in _needs(epi) if x in graph_inputs or x not in inits)
    epilogue = make("epilogue", epi, epi_inputs, list(g.output))
    wiring = {"steps_input": steps, "start": {X_IN: x0, D_IN: d0}, "carry": {X_IN: X_OUT, D_IN: D_OUT},
              "final": final, "inputs": {p.graph.name: [i.name for i in p.graph.input if i.name not in
                                                       {t.name for t in p.graph.initializer}]
                                         for p in (prologue, step, epilogue)},
              "prologue_outputs": pro_out}
    return {"prologue": prologue, "step": step, "epilogue": epilogue}, wiring


def _all_nodes(graph: onnx.GraphProto):
    for n in graph.node:
        yield n
        for s in _subgraphs(n):
            yield from _all_nodes(s)


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Types of the main graph's values (ONNX shape inference; shapes are kept only where fully static)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=False)
    out = {}
    for vi in inferred.graph.value_info:
        if vi.type.tensor_type.elem_type:
            t = onnx.ValueInfoProto()
            t.name = vi.name
            t.type.tensor_type.elem_type = vi.type.tensor_type.elem_type
            out[vi.name] = t
    return out


def run_parts(sessions: dict, feeds: dict[str, np.ndarray], wiring: dict, on_step=lambda i, n: None) -> dict:
    """Prologue once, step once per row, epilogue once, on ONNX Runtime sessions ({part: session}): the page's
    loop (pipeline.js) in Python. `feeds`: the whole graph's feeds. Returns the epilogue's outputs."""
    values = dict(feeds)
    names = [o.name for o in sessions["prologue"].get_outputs()]
    values.update(zip(names, sessions["prologue"].run(names, {k: values[k] for k in wiring["inputs"]["prologue"]})))
    x, d = values[wiring["start"][X_IN]], values[wiring["start"][D_IN]]
    n = int(values[wiring["steps_input"]])
    for i in range(n):
        step_feeds = {k: values[k] for k in wiring["inputs"]["step"] if k not in (ITER, X_IN, D_IN)}
        x, d = sessions["step"].run([X_OUT, D_OUT], {ITER: np.array(i, np.int64), X_IN: x, D_IN: d, **step_feeds})
        on_step(i, n)
    values[wiring["final"]] = x
    names = [o.name for o in sessions["epilogue"].get_outputs()]
    return dict(zip(names, sessions["epilogue"].run(names, {k: values[k] for k in wiring["inputs"]["epilogue"]})))


def page_feeds(pipe, prompt: str, seed: int, steps: int, sampler: str | None = None, negative: str = "") -> dict:
    """The whole graph's feeds as pipeline.js makes them (ids, numpy's draws for this seed, the table rows)."""
    from ..runtime.generation import GenerateOptions
    from .settings import guidance_scale

    opts = pipe.resolve(GenerateOptions(steps=steps, sampler=sampler))
    t = pipe.table(opts)
    rng = np.random.default_rng(seed)
    shape = tuple(pipe.latent_shape(opts))
    latents = rng.standard_normal(shape, dtype=np.float32)
    rows = np.asarray(t.rows, np.float32)
    noise = (rng.standard_normal((rows.shape[0], *shape), dtype=np.float32) if t.needs_noise
             else np.zeros((1, *shape), np.float32))
    feeds = {"latents": latents, "table": rows, "init_scale": np.array(t.init_scale, np.float32),
             "guidance": np.array(max(np.polyval(guidance_scale(pipe), opts.guidance), 1), np.float32), "noise": noise,
             "steps": np.array(rows.shape[0], np.int64)}
    embedded = pipe.family.guidance_input_for(pipe.info)
    if embedded is not None:  # a guidance-distilled backbone's own input (the CFG scale above is then 1)
        feeds[f"cond_{embedded}"] = np.array([opts.guidance], np.float32)
    for slot in pipe.slots:
        suffix = slot.name[len("text_encoder"):]
        for head, text in (("", prompt), ("uncond_", negative)):
            out = pipe.tokenizers[slot.name]([text])
            if isinstance(out, tuple):  # an LLM encoder's (ids, attention mask), int64 as its graph takes them
                feeds[f"{head}input_ids{suffix}"], feeds[f"{head}attention_mask{suffix}"] = out
            else:
                feeds[f"{head}input_ids{suffix}"] = out.astype(np.int32)
    return feeds


def cpu_sessions(page, threads: int = 1) -> tuple[dict, dict]:
    """({part: ONNX Runtime CPU session}, wiring) for a page folder's three graphs."""
    import json
    from pathlib import Path

    import onnxruntime

    settings = json.loads((Path(page) / "settings.json").read_text())
    so = onnxruntime.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    g = settings["graph"]
    sessions = {p: onnxruntime.InferenceSession(str(Path(page) / g["parts"][p]["file"]), so,
                                                providers=["CPUExecutionProvider"]) for p in PARTS}
    return sessions, g["wiring"] | {"inputs": {p: v["inputs"] for p, v in g["parts"].items()}}
