"""quantize/runner.py's timings: the clock that choices of what is built are timed with."""

import time
from types import SimpleNamespace

from onnxdiffusion.quantize import _ort, runner, static_plan


class _Waits:
    """A session whose call waits (as a call on a loaded machine waits for a core) and computes nothing."""

    def run(self, outputs, feed):
        time.sleep(0.02)


def test_cpu_clock_does_not_count_waiting_for_a_core():
    wall = runner.time_sessions({"a": _Waits()}, {}, runs=3, warmup=0)
    cpu = runner.time_sessions({"a": _Waits()}, {}, runs=3, warmup=0, clock="cpu")
    assert wall["a"]["median_ms"] >= 19
    assert cpu["a"]["median_ms"] < 5


def test_choices_are_timed_on_cpu_time_when_one_thread_runs_the_call():
    assert runner.decision_clock(1) == "cpu"
    assert runner.decision_clock(4) == "wall" and runner.decision_clock(None) == "wall"


def test_the_weightless_groups_choice_uses_the_decision_clock(monkeypatch):
    seen = {}

    def fake_times(sessions, feed, runs, warmup=3, clock="wall"):
        seen["clock"] = clock
        return {k: {"median_ms": 1.0} for k in sessions}

    monkeypatch.setattr(runner, "time_sessions", fake_times)
    monkeypatch.setattr(runner, "session", lambda model, threads: object())
    monkeypatch.setattr(_ort, "qdq_quantize", lambda *a: None)
    calib = SimpleNamespace(num_steps=2, rows=2, feed=lambda step, rows: {})
    stats = SimpleNamespace(aggregate=lambda steps, how: {})
    recipe = SimpleNamespace(activation_type="uint8", float_outputs=())
    for threads, clock in ((1, "cpu"), (2, "wall")):
        ctx = SimpleNamespace(threads=threads)
        static_plan._time_choices(ctx, recipe, calib, stats, [], {}, (), {"with": (None, []), "without": (None, [])})
        assert seen["clock"] == clock
