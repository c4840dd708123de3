"""GGUF blocks -> MatMulNBits blocks: Q8_0 and Q4_0 exact (the weight MatMulNBits computes with is, bit for bit,
the `gguf` package's dequantization), other types re-quantized to 8-bit blocks within a stated error, and ONNX
Runtime's kernel computing with them (float path exactly; int8 activations, accuracy_level 4, >= 40 dB)."""

from __future__ import annotations

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.export.gguf_blocks import dequantize, nbits_to_float, to_nbits
from onnxdiffusion.export.gguf_linear import ACCURACY_LEVEL, BLOCK

Q = gguf.GGMLQuantizationType


def _snr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(ref.astype(np.float64) ** 2) / np.mean((ref - got).astype(np.float64) ** 2)))


def _random_q4_k(rng, n: int, k: int) -> np.ndarray:
    """Q4_K blocks (256 weights: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles): the
    package writes no K-quants, so the bytes are drawn, with small finite d / dmin."""
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.full((n, k // 256, 1), 1e-3, np.float16).view(np.uint8)
    blocks[..., 2:4] = np.full((n, k // 256, 1), 5e-4, np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_exact_types_are_bit_exact(qtype):
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q[qtype])
    nb = to_nbits(raw.reshape(-1), int(Q[qtype]), (48, 96))
    assert nb.exact and nb.bits == {"Q8_0": 8, "Q4_0": 4}[qtype]
    assert nb.b.shape == (48, 96 // BLOCK, BLOCK * nb.bits // 8)
    np.testing.assert_array_equal(nbits_to_float(nb, (48, 96)), gguf.quants.dequantize(raw, Q[qtype]))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q5_1", "Q4_K"])
def test_other_types_are_requantized_to_8_bits(qtype):
    rng = np.random.default_rng(1)
    k = 256
    if qtype == "Q4_K":
        raw = _random_q4_k(rng, 16, k)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((16, k)).astype(np.float32), Q[qtype])
    nb = to_nbits(raw.reshape(-1), int(Q[qtype]), (16, k))
    ref = dequantize(raw.reshape(-1), int(Q[qtype]), (16, k))
    assert not nb.exact and nb.bits == 8
    snr = _snr(ref, nbits_to_float(nb, (16, k)))
    assert abs(snr - nb.snr_db) < 1e-3 and snr >= 38.0, (qtype, snr)


def _session(nb, n: int, k: int, accuracy_level: int, prepack: bool) -> ort.InferenceSession:
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=nb.bits,
                            block_size=BLOCK, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])],
                              [numpy_helper.from_array(nb.b, "B"), numpy_helper.from_array(nb.scales, "S")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_matmulnbits_computes_with_the_gguf_weights(qtype):
    rng = np.random.default_rng(2)
    n, k = 64, 256
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), Q[qtype])
    nb = to_nbits(raw.reshape(-1), int(Q[qtype]), (n, k))
    a = rng.standard_normal((8, k)).astype(np.float32)
    ref = a @ gguf.quants.dequantize(raw, Q[qtype]).T
    exact = _session(nb, n, k, 0, prepack=True).run(None, {"A": a})[0]
    assert _snr(ref, exact) >= 100
    int8 = _session(nb, n, k, ACCURACY_LEVEL, prepack=True).run(None, {"A": a})[0]
    assert _snr(ref, int8) >= 40
