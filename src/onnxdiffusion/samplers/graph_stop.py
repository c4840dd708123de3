"""Adaptive stopping in the Loop graph: the body's ``cond`` output is runtime/stop.py's test, so ONNX
Runtime ends the Loop after the step whose denoised estimate barely moved.

The test is the host's op for op: sum|D_i - D_{i-1}| / sum|D_{i-1}| in float32 summed in cache_math's
fold order (graph_cache.fold_sum), cast to double and compared with ``stop_threshold``; a stop needs
i >= 1, i + 1 >= ``stop_min_steps`` and i + 1 < steps. On the stopping step the carried x becomes D_i
(a ``Where``), so the Loop's final latents are the x0 estimate the host returns; on every other step
x passes through unchanged, so threshold 0 (the input's default) is the plain Loop's image bit for bit.

Graph inputs (with defaults): ``stop_threshold`` (double, 0), ``stop_min_steps`` (int64, 1).
Graph output ``steps_run`` (int64 scalar): how many steps the Loop ran.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .graph_cache import fold_constants, fold_sum

F64, I64, BOOL = TensorProto.DOUBLE, TensorProto.INT64, TensorProto.BOOL


def stop_inputs() -> list:
    return [helper.make_tensor_value_info("stop_threshold", F64, []),
            helper.make_tensor_value_info("stop_min_steps", I64, [])]


def stop_prologue(b, pre: dict) -> None:
    b.const("stop_threshold", np.array(0.0, np.float64))
    b.const("stop_min_steps", np.array(1, np.int64))
    b.const("stop_zero_i64", np.array(0, np.int64))
    fold_constants(b)
    pre["stop"] = True


def stop_state(pre: dict) -> dict[str, list]:
    """The step counter the Loop carries (body in/out, Loop in/out, graph output), or nothing without stopping."""
    if not pre.get("stop"):
        return {k: [] for k in ("body_in", "body_out", "loop_in", "loop_out", "graph_out")}
    return {"body_in": [helper.make_tensor_value_info("stop_count_in", I64, [])],
            "body_out": [helper.make_tensor_value_info("stop_count_out", I64, [])],
            "loop_in": ["stop_zero_i64"], "loop_out": ["steps_run"],
            "graph_out": [helper.make_tensor_value_info("steps_run", I64, [])]}


def stop_test(b, i: str, x_new: str, den: str, d_prev: str) -> tuple[str, str]:
    """Appends the test to a Loop body; returns (cond_out, the x to carry). Also writes stop_count_out."""
    moved = fold_sum(b, b.op("Abs", [b.op("Sub", [den, d_prev], "stop_dd")], "stop_abs_dd"), "stop_fold_dd")
    size = fold_sum(b, b.op("Abs", [d_prev], "stop_abs_prev"), "stop_fold_prev")
    ratio = b.op("Cast", [b.op("Div", [moved, size], "stop_ratio_f")], "stop_ratio", to=F64)
    below = b.op("Less", [ratio, "stop_threshold"], "stop_below")  # NaN (0 / 0): no stop, as on the host
    ran = b.op("Add", [i, "cache_one_i64"], "stop_count_out")
    enough = b.op("Not", [b.op("Less", [ran, "stop_min_steps"], "stop_too_few")], "stop_enough")
    inner = b.op("And", [b.op("Greater", [i, "stop_zero_i64"], "stop_has_prev"),
                         b.op("Less", [ran, "steps"], "stop_before_last")], "stop_in_range")
    stop = b.op("And", [b.op("And", [below, enough], "stop_due"), inner], "stop_now")
    cond = b.op("Not", [stop], "stop_cond")
    return cond, b.op("Where", [stop, den, x_new], "stop_x")
