"""ONNX Runtime sessions, the one factory: provider choice, clear errors for unusable models.

`make_session` opens a model folder's file for the run time (its options: `session_options`);
`session` opens a file or an in-memory ModelProto (a > 2 GB backbone's skeleton included) for the
tools (quantize, compile-loop, bench; options: `tool_options`). Run-time code imports this module:
onnx is imported only inside the functions the tools use."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from ..errors import UserError
from . import heap

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
        from collections import Counter

        import onnx

        from .attention import plain_attention

        inits = {t.name for t in graph.initializer}
        self._inputs = [_arg(v) for v in graph.input if v.name not in inits]
        self._outputs = [_arg(v) for v in graph.output]
        # ONNX Runtime's own operators (com.microsoft): other providers cannot run them (runtime/profiled.py)
        self.contrib_ops = Counter(n.op_type for n in graph.node if n.domain == "com.microsoft")
        # ... except the plain fused attention of a graph whose weights are inside it: written out for them
        inline = not any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer)
        self.written_out = sum(map(plain_attention, graph.node)) if inline else 0

    @property
    def foreign_ops(self):
        """The com.microsoft op counts a provider other than ORT's CPU/CUDA sees (onnxio.attention.openvino_form)."""
        from .attention import MHA

        left = self.contrib_ops.copy()
        left.subtract({MHA: self.written_out})
        return +left

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

    from ..folder.manifest import confined

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
    back to the allocator after each call instead of ORT's growing CPU arena (for a full-size model make_session
    also has malloc hand large blocks back to the system: onnxio/heap.py), `mem_pattern=False` keeps
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
                 memory=None, checked: bool = False, level: str | None = None,
                 model: bytes | None = None, external_files: dict | None = None) -> ort.InferenceSession:
    """`providers`: ONNX Runtime's provider list with options (a profile's); default: `provider`, then CPU.
    `memory`: runtime.memory.MemoryOptions (None: ORT's defaults). `checked`: the caller already ran
    check_external_data on this file (the graph is not parsed a second time). `model`: the file's graph as
    rewritten in memory by the caller (its weights inline), loaded instead of the file. `external_files`: the
    graph's external-data files by the name it gives them, as buffers (a graph derived in a temporary folder
    reading its source's weights: ORT refuses a link out of the model's folder)."""
    if not checked:
        check_external_data(path)
    opts = session_options(threads, memory, level)
    if memory is not None and not memory.arena and heap.full_size(path):
        heap.hand_back_large_blocks()  # else its freed activations stay in malloc's heap
    if external_files:
        names = list(external_files)
        opts.add_external_initializers_from_files_in_memory(names, [external_files[n] for n in names],
                                                            [len(external_files[n]) for n in names])
    try:
        extra = {"disabled_optimizers": disabled_optimizers} if disabled_optimizers else {}
        chain = providers if providers is not None else resolve_provider(provider)
        return ort.InferenceSession(model if model is not None else str(path), sess_options=opts, providers=chain,
                                    **extra)
    except UserError:
        raise
    except Exception as e:  # ORT raises several private exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load {path}: {first[:300]}") from None


# --- sessions for the tools: in-memory models and skeletons ------------------------------------

def tool_options(threads: int, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, optimized_path: str | None = None):
    """Options for the tools' sessions (quantize, compile-loop): `threads` intra-op, one inter-op, quiet."""
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    o.log_severity_level = 3
    o.graph_optimization_level = level
    if optimized_path:
        o.optimized_model_filepath = optimized_path
    return o


# ORT optimizers an int8 backbone runs without (recorded in its manifest entry; the pipeline
# honours it): NhwcTransformer wraps each QLinearConv in transposes (~5% slower on this UNet);
# NchwcTransformer changes float convolutions' rounding, so a mixed-precision backbone would
# differ between the host loop and the Loop form, where ORT does not apply it.
INT8_DISABLED_OPTIMIZERS = ("NchwcTransformer", "NhwcTransformer")
FLOAT8_TYPES = {17, 18, 19, 20}  # onnx.TensorProto.FLOAT8E4M3FN, ..E4M3FNUZ, ..E5M2, ..E5M2FNUZ (onnx imported lazily)


def disabled_for(model: onnx.ModelProto | str | Path) -> tuple[str, ...]:
    """The optimizers to disable for this backbone: the int8 set when it holds Q/DQ or QLinear ops."""
    import onnx

    from .files import op_counts

    if isinstance(model, (str, Path)):
        model = onnx.load(str(model), load_external_data=False)  # op types only, no weights
    counts = op_counts(model)
    int8 = any(counts.get(op) for op in ("QuantizeLinear", "QLinearConv", "QLinearMatMul"))
    if int8 and any(t.data_type in FLOAT8_TYPES for t in model.graph.initializer):
        # ORT 1.31's QDQ selector turns an FP8 DQ -> MatMul into MatMulIntegerToFloat, which rejects
        # float8 inputs (the session fails to build); ORT has no FP8 CPU kernel for it to gain anyway.
        return (*INT8_DISABLED_OPTIMIZERS, "QDQSelectorActionTransformer")
    return INT8_DISABLED_OPTIMIZERS if int8 else ()


def session(model: onnx.ModelProto | str | Path, threads: int = 1, provider: str = "cpu",
            level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, disabled: tuple[str, ...] | None = None,
            stats: bool = False) -> ort.InferenceSession:
    """`disabled` None: what the pipeline would disable for this backbone (see INT8_DISABLED_OPTIMIZERS).
    `stats`: a calibration-statistics graph (stats.py): nodes run in priority order, which follows the
    graph's node order, so each statistic runs right after its tensor is made."""
    opts = tool_options(threads, level)
    if stats:
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    providers = resolve_provider(provider)
    disabled = list(disabled_for(model) if disabled is None else disabled)
    if isinstance(model, (str, Path)):
        return ort.InferenceSession(str(model), opts, providers=providers, disabled_optimizers=disabled)
    from . import files

    source = files.session_source(model, opts)  # a skeleton reads its weights from its folder
    if source is not None:
        return ort.InferenceSession(source, opts, providers=providers, disabled_optimizers=disabled)
    with files.as_file(model) as path:  # large and in memory: through external data
        return ort.InferenceSession(str(path), opts, providers=providers, disabled_optimizers=disabled)


def ort_optimized(model: onnx.ModelProto, threads: int = 1,
                  level=ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, skeleton: bool = False) -> onnx.ModelProto:
    """The graph ONNX Runtime's CPU provider actually runs after its fusions (QDQ -> QLinearConv, ...).

    Level EXTENDED: every fusion, no NCHWc layout rewrite, so the result is still a portable
    CPU graph that can be saved, inspected and inlined (e.g. into a Loop body).
    skeleton: a skeleton in gives a skeleton out (its weights left in a tracked temporary folder, not loaded:
    a streamed quantize's output stays out of memory); otherwise the graph with its weights.
    """
    import tempfile

    from . import files

    if skeleton and files.data_dir(model) is not None:
        from ..folder import tempfiles

        folder = tempfiles.mkdtemp(files.SPILL_PREFIX + "opt-")
        _optimize(model, threads, level, folder)
        return files.skeleton_of(folder / "optimized.onnx")
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-opt-") as tmp:
        return _optimize(model, threads, level, Path(tmp), load=True)


def _optimize(model: onnx.ModelProto, threads: int, level, tmp: Path, load: bool = False):
    import onnx

    from . import files

    path = str(Path(tmp) / "optimized.onnx")
    opts = tool_options(threads, level, path)
    if files.is_large(model):  # the optimized graph is written with its weights in external data
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx_data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    disabled = [d for d in disabled_for(model) if d == "QDQSelectorActionTransformer"]
    source = files.session_source(model, opts)
    if source is not None:
        ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    else:
        with files.as_file(model) as src:
            ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    return onnx.load(path) if load else None
