"""`bench`: every variant of a model side by side (speed, memory, size, fidelity, adherence) as a report.

    from onnxdiffusion.bench import BenchOptions, run_bench
    results = run_bench(BenchOptions(steps=20, repeats=5, out=Path("bench-out")))

See core.py for the order of work, variants.py for what a variant is, report.py for the outputs.
"""

__all__ = ["BenchOptions", "run_bench"]


def __getattr__(name: str):
    # loaded on first use: a measuring child that only reads bench.rss does not carry the bench's imports
    # (~6 MB resident) into the peak it reports
    if name in __all__:
        from . import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
