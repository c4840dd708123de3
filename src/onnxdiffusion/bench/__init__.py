"""`bench`: every variant of a model side by side (speed, memory, size, fidelity, adherence) as a report.

    from onnxdiffusion.bench import BenchOptions, run_bench
    results = run_bench(BenchOptions(steps=20, repeats=5, out=Path("bench-out")))

See core.py for the order of work, variants.py for what a variant is, report.py for the outputs.
"""

from .core import BenchOptions, run_bench

__all__ = ["BenchOptions", "run_bench"]
