"""`onnxdiffusion tune`: the fastest configuration of a model that keeps its picture, found on this machine.

space.py the levers and a candidate; measure.py quality vs the fp32 reference (PSNR, the judge) and latency;
store.py the journal and the content-hashed store; search.py the staged search; select.py timing and the choice;
finish.py and output.py the held-out check and OUT; report.py report.md and pareto.png; run.py `tune()`.
"""

from .run import TuneOptions, tune

__all__ = ["TuneOptions", "tune"]
