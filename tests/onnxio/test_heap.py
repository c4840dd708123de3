"""onnxio/heap.py: malloc hands large blocks back once a full-size model runs without ORT's arena."""

import ctypes
import platform
import types
from pathlib import Path

import pytest

from onnxdiffusion.onnxio import heap, session
from onnxdiffusion.runtime.memory import memory_options

MODEL = Path(__file__).resolve().parents[2] / "models" / "shapes-sd-onnx"


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(heap, "hand_back_large_blocks", lambda: seen.append(1) or True)
    return seen


def test_only_a_full_size_model_without_the_arena_sets_it(calls, monkeypatch):
    backbone = MODEL / "unet" / "model.onnx"
    session.make_session(backbone, memory=memory_options("bounded"))
    assert calls == []  # a tiny model: malloc left alone
    monkeypatch.setattr(heap, "FULL_SIZE", 1)
    session.make_session(backbone, memory=memory_options("lean"))
    assert calls == []  # the arena is on
    session.make_session(backbone, memory=memory_options("bounded"))
    assert calls == [1]


def test_mallopt_gets_the_threshold_unless_the_user_set_one(monkeypatch):
    seen = []

    class Mallopt:
        def __call__(self, *args):
            seen.append(args)
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: types.SimpleNamespace(mallopt=Mallopt()))
    monkeypatch.setenv(heap.ENV, "65536")
    assert heap._set() is False and seen == []
    monkeypatch.delenv(heap.ENV)
    assert heap._set() is True and seen == [(heap.M_MMAP_THRESHOLD, heap.THRESHOLD)]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_this_libc_has_mallopt():
    assert hasattr(ctypes.CDLL(None), "mallopt")
