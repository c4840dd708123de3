"""Run-time remedies for a quantized backbone, each a per-step wrapper of the model function
(`wrap(model_fn) -> model_fn`): the output correction (correction.py) and the precision schedule
(schedule.py). numpy only; what quantize fits or selects for them lives in quantize/."""
