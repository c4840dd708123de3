"""Put an int8 backbone's convolutions on the integer-GEMM kernels that are fastest on this CPU.

ONNX Runtime's CPU QLinearConv has two kernels (onnxruntime/core/providers/cpu/quantization/qlinearconv.cc):
  sym   when the input zero point is a constant initializer and every weight zero point is 0, PrePack
        takes MLAS's symmetric convolution (MlasConvSym*: an indirection-buffer kernel on AVX2/AVX-512
        VNNI, NO AMX version)
  gemm  otherwise: im2col + MlasGemm (QGEMM), which MLAS dispatches to QgemmU8S8KernelAmx on CPUs with
        AMX. Measured at SD1.5 shapes, 1 thread (experiments/amx/README.md): 3x3 convs 470-630 -> 1300-1470
        GOP/s, 1x1 490-600 -> 615-1190 GOP/s.
The lowering keeps the node and its arithmetic (same int32 accumulation, same per-channel requantize scale
x_scale * w_scale / y_scale) and only makes the input zero point a run-time value: Cast(Shape(x)[:1] * 0 +
zp), where x is a graph input with a symbolic (dynamic) dimension so ORT's constant folding cannot turn it
back into an initializer. Any CPU runs the lowered graph (it is plain ONNX); a CPU without AMX just runs the
gemm kernel on its VNNI/AVX2 QGEMM. Where a graph has no dynamic input dimension, ORT folds the chain and
the node runs `sym` again: correct, only not faster (lower() reports it so).

The choice per node (`plan_kernels`): `portable` and `vnni` keep `sym` (today's graph); `amx` lowers every
eligible node when the CPU has AMX (refused without); `auto` on an AMX CPU measures each node in the
built graph both ways (ORT's profiler, real shapes) and lowers the ones the gemm kernel runs >10% faster
here (convs under 0.2 ms are kept: too short to time against the noise, so tiny models keep their bytes),
and without AMX keeps today's graph. The CPU flags come from
onnxdiffusion.cpu.features.cpu_flags (tests fake them).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.cpu import features
from onnxdiffusion.cpu.features import int8_family, isa_summary

KERNEL_CHOICES = ("auto", "amx", "vnni", "portable")
ZP_PREFIX = "amx_rt_zp"  # names of the added tensors (compact names are short: no clash)
AUTO_MARGIN = 0.9  # auto lowers a node when its gemm kernel time is under 90% of the symmetric kernel's
AUTO_MIN_S = 2e-4  # ... and the symmetric kernel takes at least 0.2 ms (SD1.5's convs: 0.3-18 ms, 2.2x apart)


def _inits(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def _small_array(t: onnx.TensorProto) -> np.ndarray | None:
    """A zero-point/scale initializer's values (they are tiny and always inline); None when external."""
    if t.data_location == TensorProto.EXTERNAL:
        return None
    return numpy_helper.to_array(t)


def eligible_convs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """QLinearConv nodes ORT would run on its symmetric kernel: constant scalar u8 input zero point,
    s8 weights whose zero points are all 0, one group (depthwise convs have their own kernel)."""
    inits, out = _inits(model), []
    for node in model.graph.node:
        if node.op_type != "QLinearConv" or node.domain not in ("", "ai.onnx"):
            continue
        xzp, w, wzp = (inits.get(node.input[i]) for i in (2, 3, 5))
        if xzp is None or w is None or wzp is None or xzp.data_type != TensorProto.UINT8 or w.data_type != TensorProto.INT8:
            continue
        xzp_v, wzp_v = _small_array(xzp), _small_array(wzp)
        if xzp_v is None or wzp_v is None or xzp_v.size != 1 or np.any(wzp_v != 0):
            continue
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if group != 1:
            continue
        out.append(node)
    return out


def dynamic_source(model: onnx.ModelProto) -> tuple[str, int] | None:
    """A graph input and the axis of a symbolic dimension (ORT cannot fold its Shape)."""
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_param") or not d.HasField("dim_value"):
                return vi.name, axis
    return None


def lower(model: onnx.ModelProto, names: set[str] | None = None) -> dict:
    """Make the input zero point of the eligible QLinearConv nodes (all, or those in `names`) a run-time
    value, in place. Returns {"lowered": n, "kept": m, "foldable": bool}."""
    convs = [n for n in eligible_convs(model) if names is None or n.name in names]
    kept = len(eligible_convs(model)) - len(convs)
    if not convs:
        return {"lowered": 0, "kept": kept, "foldable": False}
    source = dynamic_source(model)
    inits = _inits(model)
    src_name, axis = source if source else (convs[0].input[0], 0)
    g = model.graph
    zero = f"{ZP_PREFIX}_zero"
    head = [helper.make_node("Shape", [src_name], [f"{ZP_PREFIX}_shape"], start=axis, end=axis + 1, name=f"{ZP_PREFIX}_shape"),
            helper.make_node("Mul", [f"{ZP_PREFIX}_shape", f"{ZP_PREFIX}_c0"], [zero], name=f"{ZP_PREFIX}_mul")]
    g.initializer.append(numpy_helper.from_array(np.array([0], np.int64), f"{ZP_PREFIX}_c0"))
    made: dict[int, str] = {}
    for node in convs:
        zp = int(_small_array(inits[node.input[2]]).reshape(-1)[0])
        if zp not in made:
            made[zp] = f"{ZP_PREFIX}_{zp}"
            g.initializer.append(numpy_helper.from_array(np.array([zp], np.int64), f"{made[zp]}_i64"))
            head += [helper.make_node("Add", [zero, f"{made[zp]}_i64"], [f"{made[zp]}_sum"], name=f"{made[zp]}_add"),
                     helper.make_node("Cast", [f"{made[zp]}_sum"], [made[zp]], to=TensorProto.UINT8, name=f"{made[zp]}_cast")]
        node.input[2] = made[zp]
    # the chain reads only a graph input: put it first so the node order stays topological
    nodes = head + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    return {"lowered": len(convs), "kept": kept, "foldable": source is None}


def plan_kernels(kernels: str, model: onnx.ModelProto, measure=None, flags: frozenset[str] | None = None) -> tuple[set[str], dict]:
    """Which eligible nodes to lower for `kernels`, and the manifest record of the choice.

    `measure(model, names) -> {node name: (sym seconds, gemm seconds)}` is called for `auto` on AMX only."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
    family = int8_family(flags)
    names = {n.name for n in eligible_convs(model)}
    # features.cpu_flags, not a name bound at import: the tests fake the module's
    record = {"requested": kernels, "cpu": isa_summary(flags if flags is not None else features.cpu_flags()),
              "eligible": len(names)}
    if kernels in ("portable", "vnni"):
        chosen, record["by"] = set(), "rule: keep ORT's symmetric conv kernel"
    elif kernels == "amx":
        if family != "amx":
            from onnxdiffusion.errors import UserError

            raise UserError(f"-O kernels=amx: this CPU has no AMX (int8 kernels: {family}); use kernels=auto or vnni")
        chosen, record["by"] = names, "rule: every eligible conv on QGEMM (AMX)"
    elif family != "amx" or not names:
        # without AMX, MLAS's QGEMM is the same VNNI/AVX2 arithmetic the symmetric conv kernel was written to
        # beat: keep today's graph (and its bytes) rather than time two equal kernels on every build
        chosen, record["by"] = set(), f"rule: no AMX ({family} kernels), ORT's symmetric conv kernel kept"
    else:
        if measure is None:
            raise ValueError("kernels=auto needs a measure function")
        timings = measure(model, names)
        # lower only where the gemm kernel measured clearly faster, on convs long enough to time: near-ties and
        # tiny convs (profiler noise; little to gain) keep today's graph, so the bytes do not follow the noise
        chosen = {n for n, (sym, gemm) in timings.items()
                  if n in names and sym >= AUTO_MIN_S and gemm < AUTO_MARGIN * sym}
        record["too_short_to_time"] = sum(1 for sym, _ in timings.values() if sym < AUTO_MIN_S)
        record["by"] = "measured here (ORT profiler, per node)"
        record["sym_ms"] = round(sum(s for s, _ in timings.values()) * 1e3, 2)
        record["gemm_ms"] = round(sum(g for _, g in timings.values()) * 1e3, 2)
    record["target"] = family if chosen else "any"
    record["lowered"] = len(chosen)
    return chosen, record

