"""export/llm_text_encoder.py: the hidden layers a pipeline reads, from one KV-free pass that runs only the
layers it needs, equal to transformers' own `output_hidden_states` on the tokens the mask keeps (and, with
`positions="arange"`, on the padding too); and the ONNX export of it agrees with torch."""

from __future__ import annotations

import pytest
import torch

from onnxdiffusion.export.llm_text_encoder import DecoderHiddenStates, decoder_stack, hidden_index


def _qwen3(layers: int = 4):
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=24, intermediate_size=40, num_hidden_layers=layers,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=8, max_position_embeddings=128)
    return Qwen3Model(cfg).eval()


def _feeds():
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.int64)
    mask[1, 7:] = 0  # right padding, as the Qwen tokenizers pad
    return ids, mask


def test_hidden_index_numbers_as_output_hidden_states():
    assert [hidden_index(k, 4) for k in (-1, -2, 0, 3, 4, -5)] == [4, 3, 0, 3, 4, 0]
    for bad in (5, -6):
        with pytest.raises(ValueError, match="outside"):
            hidden_index(bad, 4)


@pytest.mark.parametrize("layers", [(-1,), (-2,), (1, 3), (2, -1)])
@pytest.mark.parametrize("positions", ["mask", "arange"])
def test_layers_match_transformers_output_hidden_states(layers, positions):
    ids, mask = _feeds()
    with torch.no_grad():
        ref = _qwen3()(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        want = torch.cat([ref[k] for k in layers], dim=-1)
        got = DecoderHiddenStates(_qwen3(), layers=layers, positions=positions).eval()(ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    if positions == "arange":  # transformers' own numbering: the padding tokens agree too
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_after_the_deepest_read_are_dropped():
    wrapped = DecoderHiddenStates(_qwen3(), layers=(-2,))
    assert len(wrapped.model.layers) == 3 and isinstance(wrapped.model.norm, torch.nn.Identity)
    assert len(DecoderHiddenStates(_qwen3(), layers=(2, 1)).model.layers) == 2
    assert len(DecoderHiddenStates(_qwen3(), layers=(-1,)).model.layers) == 4


def test_decoder_stack_finds_the_decoder_of_a_causal_lm():
    from transformers import Qwen3ForCausalLM

    model = _qwen3()
    lm = Qwen3ForCausalLM(model.config)
    assert decoder_stack(model) is model and decoder_stack(lm) is lm.model


def test_onnx_export_agrees_with_torch(tmp_path):
    import numpy as np
    import onnxruntime as ort

    ids, mask = _feeds()
    wrapped = DecoderHiddenStates(_qwen3(), layers=(-2,), positions="arange").eval()
    path = tmp_path / "te.onnx"
    with torch.no_grad():
        want = wrapped(ids, mask).numpy()
        torch.onnx.export(wrapped, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["hidden"], opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}})
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    short = sess.run(None, {"input_ids": ids[:1, :5].numpy(), "attention_mask": mask[:1, :5].numpy()})[0]
    np.testing.assert_allclose(short, want[:1, :5], rtol=1e-4, atol=1e-4)  # dynamic axes, KV-free prefix
