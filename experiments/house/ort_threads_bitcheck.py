"""Are ONNX Runtime's CPU results the same bytes at one intra-op thread and at its default (one per physical core)?
tests/conftest.py gives xdist workers one thread, so a test comparing a CLI subprocess's image (ORT default) with
an in-process one (one thread) byte for byte relies on it (experiments/house/test_time.md, "Threads").

    PYTHONPATH=src python experiments/house/ort_threads_bitcheck.py [MORE_FOLDERS...]
"""

import sys

import onnxruntime as ort

from onnxdiffusion.runtime import Pipeline

THREADS = {"n": 0}
_init = ort.InferenceSession.__init__


def _session_init(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
    if sess_options is None:
        sess_options = ort.SessionOptions()
    if THREADS["n"] and sess_options.intra_op_num_threads == 0:
        sess_options.intra_op_num_threads = THREADS["n"]
    _init(self, path_or_bytes, sess_options, providers, provider_options, **kwargs)


def main(extra: list[str]) -> int:
    ort.InferenceSession.__init__ = _session_init
    cases = [("models/shapes-sd-onnx", dict(steps=8, seed=1)),
             ("models/shapes-sd-onnx", dict(steps=6, seed=2, sampler="euler_a", batch=2)),
             ("models/shapes-mmdit-onnx", dict(steps=6, seed=3))] + [(f, dict(steps=4, seed=5)) for f in extra]
    same = True
    for folder, kw in cases:
        got = {}
        for n in (1, 0):  # 0: ORT's default
            THREADS["n"] = n
            r = Pipeline.from_folder(folder)("a red circle above a blue square", **kw)
            got[n] = (r.latents.tobytes(), r.images.tobytes())
        print(f"{folder} {kw}: latents equal {got[1][0] == got[0][0]}, images equal {got[1][1] == got[0][1]}")
        same &= got[1] == got[0]
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
