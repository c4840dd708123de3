"""Count ONNX Runtime sessions (experiments/house/test_time.md, session of 8 Dec): each InferenceSession made, with a hash
of its graph bytes, its options, its CPU and the onnxdiffusion frames that made it; a second session of the same bytes,
options and disabled optimizers is counted as "again".

    PYTHONPATH=src python experiments/house/count_sessions.py quantize models/shapes-sd-onnx OUT --recipe int8-static
    SESS_OUT=x.jsonl PYTHONPATH=src:experiments/house python -m pytest -p count_sessions -n 0 FILES...  # per test"""

import collections
import hashlib
import json
import os
import sys
import time
import traceback

import onnxruntime as ort

RECORDS: list[dict] = []
_CURRENT = ["collect"]  # the node id running (as a pytest plugin)
_REAL_INIT = ort.InferenceSession.__init__


def _key_of(src) -> tuple[str, int]:
    if isinstance(src, (bytes, bytearray)):
        return "bytes:" + hashlib.sha1(src).hexdigest()[:12], len(src)
    try:
        data = open(str(src), "rb").read()
    except OSError:
        return f"path:{src}", 0
    return "file:" + hashlib.sha1(data).hexdigest()[:12], len(data)


def _options(o) -> str:
    if o is None:
        return "none"
    return (f"lvl={int(o.graph_optimization_level)} intra={o.intra_op_num_threads} inter={o.inter_op_num_threads} "
            f"order={o.execution_order} opt_path={bool(o.optimized_model_filepath)} arena={o.enable_cpu_mem_arena} "
            f"memp={o.enable_mem_pattern}")


def _init(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kw):
    key, size = _key_of(path_or_bytes)
    frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
              if "onnxdiffusion" in f.filename][-4:]
    t, c = time.perf_counter(), time.process_time()
    _REAL_INIT(self, path_or_bytes, sess_options, providers, provider_options, **kw)
    record = dict(key=key, size=size, opts=_options(sess_options), disabled=list(kw.get("disabled_optimizers") or ()),
                  wall=time.perf_counter() - t, cpu=time.process_time() - c, stack=" < ".join(reversed(frames)),
                  test=_CURRENT[0])
    RECORDS.append(record)
    if "SESS_OUT" in os.environ:
        with open(os.environ["SESS_OUT"], "a") as f:
            f.write(json.dumps(record) + "\n")


ort.InferenceSession.__init__ = _init


def report(out=sys.stderr) -> None:
    groups = collections.defaultdict(list)
    for r in RECORDS:
        groups[(r["key"], r["opts"], tuple(r["disabled"]))].append(r)
    again = sum(len(v) - 1 for v in groups.values())
    again_cpu = sum(x["cpu"] for v in groups.values() for x in v[1:])
    print(f"\n== {len(RECORDS)} sessions, {sum(r['cpu'] for r in RECORDS):.2f} CPU s, "
          f"{sum(r['wall'] for r in RECORDS):.2f} wall s", file=out)
    print(f"== distinct (bytes, options, disabled): {len(groups)}; repeat sessions {again}, {again_cpu:.2f} CPU s",
          file=out)
    print(f"== distinct bytes: {len({r['key'] for r in RECORDS})}", file=out)
    for r in RECORDS:
        n = len(groups[(r["key"], r["opts"], tuple(r["disabled"]))])
        print(f"{r['cpu'] * 1000:7.1f}ms {r['size'] / 1e6:7.2f}MB {r['key'][:18]} x{n} {r['opts'][:40]} "
              f"dis={len(r['disabled'])} | {r['stack'][:230]}", file=out)


def pytest_runtest_protocol(item, nextitem):  # as a pytest plugin: which test made each session
    _CURRENT[0] = item.nodeid


if __name__ == "__main__":
    import atexit

    from onnxdiffusion import cli

    atexit.register(report)
    try:
        cli.run(sys.argv[1:])
    except SystemExit:
        pass
