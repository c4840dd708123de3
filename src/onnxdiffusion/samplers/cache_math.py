"""The float arithmetic step caching decides with, written once for the host loop (techniques/) and
twinned op for op by the Loop graph (techniques/graph_fold.py and each method's graph_step), so both decide the same steps.

A reduction's order is the implementation's: numpy sums pairwise in blocks, ONNX Runtime's ReduceSum
in its own vector order, and two orders can round the same tensor's sum to different floats, which can
flip a threshold decision. ``fold_sum`` fixes the order instead: halve the (zero-padded) vector and add
the halves elementwise until one value is left; an elementwise Add rounds the same everywhere.
"""

from __future__ import annotations

import math

import numpy as np


def fold_sum(values: np.ndarray) -> np.float32:
    """Sum in a fixed order: v[:h] + v[h:] (one zero appended to an odd length) until one element."""
    v = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    while v.size > 1:
        half = (v.size + 1) // 2
        if v.size % 2:
            v = np.concatenate([v, np.zeros(1, np.float32)])
        v = v[:half] + v[half:]
    return v[0]


def relative_change(r: np.ndarray, prev: np.ndarray) -> np.float32:
    """sum |r - prev| / sum |prev| in float32 (first-block cache's distance: diffusers' ratio of means)."""
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0 is NaN, a reuse, in the graph too
        return fold_sum(np.abs(r - prev)) / fold_sum(np.abs(prev))


def taylor_coefficient(gap: int, k: int) -> np.float32:
    """gap^k / k!, rounded once from float64 to float32 (TaylorSeer's k-th term factor)."""
    return np.float32(gap ** k / math.factorial(k))
