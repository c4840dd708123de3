"""ONNX Runtime sessions: provider choice and clear errors for unusable models."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from ..errors import UserError

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
}


def resolve_provider(name: str) -> list[str]:
    """Provider list for ORT: the requested one, then CPU as the fallback for unsupported ops."""
    key = name.lower()
    if key not in PROVIDERS:
        raise UserError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")
    wanted = PROVIDERS[key]
    available = ort.get_available_providers()
    if wanted not in available:
        names = ", ".join(k for k, v in PROVIDERS.items() if v in available)
        raise UserError(f"provider {name!r} is not available in this onnxruntime install (available: {names})")
    return [wanted] if wanted == "CPUExecutionProvider" else [wanted, "CPUExecutionProvider"]


def _tensors(graph):
    """Every TensorProto a graph can carry, subgraphs and sparse tensors included (any may be external)."""
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield sp.values
        yield sp.indices
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for sp in ([a.sparse_tensor] if a.HasField("sparse_tensor") else []) + list(a.sparse_tensors):
                yield sp.values
                yield sp.indices
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _tensors(g)


class GraphIO:
    """A component's inputs and outputs (name, shape) as a session lists them, read from its graph alone:
    for checks that need no weights, before (or without) a session."""

    def __init__(self, graph):
        inits = {t.name for t in graph.initializer}
        self._inputs = [_arg(v) for v in graph.input if v.name not in inits]
        self._outputs = [_arg(v) for v in graph.output]

    def get_inputs(self):
        return self._inputs

    def get_outputs(self):
        return self._outputs


def _arg(value_info):
    from types import SimpleNamespace

    dims = value_info.type.tensor_type.shape.dim
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]
    return SimpleNamespace(name=value_info.name, shape=shape)


def check_external_data(path: Path) -> GraphIO:
    """Untrusted folders: every external-data file must resolve inside the model's own folder.
    Returns the graph's inputs and outputs (read on the way)."""
    import onnx

    from ..manifest import confined

    path = Path(path)
    if not path.is_file():
        raise UserError(f"model file missing: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf decode errors have no common public type
        raise UserError(f"cannot load {path}: not a valid ONNX file ({type(e).__name__})") from None
    for tensor in _tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), None)
            confined(path.parent, location, f"{path.name}: external data of tensor {tensor.name!r}")
    return GraphIO(model.graph)


def session_options(threads: int | None = None, memory=None, level: str | None = None) -> ort.SessionOptions:
    """The one place the runtime's ORT session options (and their config strings) are set.

    `memory`: a runtime.memory.MemoryOptions; `prepacking=False` keeps ORT from making a packed copy of
    each constant weight for its kernels (they pack per call instead), `arena=False` gives activations
    back to the allocator after each call instead of ORT's growing CPU arena, `mem_pattern=False` keeps
    ORT from planning a second block for a run's activations beside what its arena already holds.
    `level="extended"`: ORT's graph optimizations stop below the layout rewrites (NCHWc, NHWC).
    """
    opts = ort.SessionOptions()
    if level == "extended":
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if memory is not None:
        if not memory.prepacking:
            opts.add_session_config_entry("session.disable_prepacking", "1")
        if not memory.arena:
            opts.enable_cpu_mem_arena = False
        if not memory.mem_pattern:
            opts.enable_mem_pattern = False
    return opts


def make_session(path: Path, provider: str = "cpu", threads: int | None = None,
                 disabled_optimizers: list[str] | None = None, providers: list | None = None,
                 memory=None, checked: bool = False, level: str | None = None) -> ort.InferenceSession:
    """`providers`: ONNX Runtime's provider list with options (a profile's); default: `provider`, then CPU.
    `memory`: runtime.memory.MemoryOptions (None: ORT's defaults). `checked`: the caller already ran
    check_external_data on this file (the graph is not parsed a second time)."""
    if not checked:
        check_external_data(path)
    opts = session_options(threads, memory, level)
    try:
        extra = {"disabled_optimizers": disabled_optimizers} if disabled_optimizers else {}
        chain = providers if providers is not None else resolve_provider(provider)
        return ort.InferenceSession(str(path), sess_options=opts, providers=chain, **extra)
    except UserError:
        raise
    except Exception as e:  # ORT raises several private exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load {path}: {first[:300]}") from None
