"""guards.probe_text / checked_encoding: the text side's check runs once, and where the text encoders are let go
after each encoding (memory lean/bounded) it rides on the first real encoding instead of a second one at load."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

SETTINGS = dict(steps=2, seed=3, guidance=1.0)


def counting(monkeypatch, family):
    calls = []
    real = family.encode_text

    def encode_text(slot, tokenizer, session, prompts, info, **kw):
        calls.append(list(prompts))
        return real(slot, tokenizer, session, prompts, info, **kw)

    monkeypatch.setattr(family, "encode_text", encode_text)
    return calls


def test_bounded_generation_encodes_once_and_images_stay(monkeypatch):
    default = Pipeline.from_folder(None, threads=1)
    expected = default("a red circle", **SETTINGS).images
    calls = counting(monkeypatch, default.family)
    bounded = Pipeline.from_folder(None, threads=1, memory="bounded")
    assert calls == []  # nothing encoded at load: the check waits for the first prompt
    holder = bounded.text_sessions["text_encoder"]
    assert holder.loads == 1
    got = bounded("a red circle", **SETTINGS).images
    assert calls == [["a red circle"]]  # one encoding of the prompt, no probe of "" beside it
    assert holder.loads == 1 and not holder.loaded  # the load-time session served it, then let go
    assert np.array_equal(expected, got)
    bounded("a blue star", **SETTINGS)
    assert calls == [["a red circle"], ["a blue star"]] and holder.loads == 2


def test_default_memory_still_probes_at_load(monkeypatch):
    calls = counting(monkeypatch, Pipeline.from_folder(None, threads=1).family)
    Pipeline.from_folder(None, threads=1)
    assert calls == [[""]]


def failing(monkeypatch, family):
    def encode_text(*a, **kw):
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : indices element out of data bounds")

    monkeypatch.setattr(family, "encode_text", encode_text)


def test_bad_text_encoder_refused_in_one_line(monkeypatch):
    family = Pipeline.from_folder(None, threads=1).family
    failing(monkeypatch, family)
    with pytest.raises(UserError, match="text encoders fail on an empty prompt"):
        Pipeline.from_folder(None, threads=1)
    bounded = Pipeline.from_folder(None, threads=1, memory="bounded")  # deferred, not skipped
    with pytest.raises(UserError, match="text encoders fail on the first prompt") as e:
        bounded("a red circle", **SETTINGS)
    assert "\n" not in str(e.value)


def test_width_mismatch_refused_on_first_bounded_encoding(monkeypatch):
    family = Pipeline.from_folder(None, threads=1).family
    bounded = Pipeline.from_folder(None, threads=1, memory="bounded")
    real = family.combine

    def combine(ops, encoded, info):
        return {k: np.concatenate([v, v], axis=-1) for k, v in real(ops, encoded, info).items()}

    monkeypatch.setattr(family, "combine", combine)
    with pytest.raises(UserError, match="manifest and graphs disagree"):
        bounded("a red circle", **SETTINGS)
