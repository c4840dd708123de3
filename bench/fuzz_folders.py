"""Structure-aware fuzzing of model folders through every loader (issue 27, acceptance 4).

Each case is one of the embedded model folders (hard links: cheap) with one crafted change: an ONNX
component's protobuf fields (nodes, attributes, initializers, external-data references, opsets, IR
version, graph I/O, metadata, subgraphs, local functions, or raw bytes), the manifest (any leaf, paths,
the hash table), a tokenizer file, the scheduler config or a component's config.json. Most changes are
rehashed (a hostile folder's author can recompute its manifest), so they reach the parsers behind the
hash check. The case runs in a worker subprocess through the loaders: `read_manifest` + `verify_folder`,
`Pipeline.from_folder` + a one-step `generate`, and (every `--quantize-every`-th case) quantize's open
stage (the CLI verb to its first refusal or a 4-prompt, 2-step int8-dynamic build). Outcomes:

  clean     every loader succeeded or refused with a UserError (one line)
  traceback a loader raised anything else (the CLI would print "internal error")
  signal    the worker died of a signal (a native crash in ONNX Runtime, say)
  hang      no answer within --timeout seconds (the worker is killed)

A worker that dies or hangs is replaced; the case is recorded with its seed so it can be replayed
(`--replay SEED`).

    PYTHONPATH=src python bench/fuzz_folders.py --cases 2000 --out bench/results/fuzz_folders
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASES = {"sd": ROOT / "models" / "shapes-sd-onnx", "mmdit": ROOT / "models" / "shapes-mmdit-onnx"}
ONNX_KINDS = ("node-op", "node-domain", "node-drop", "node-dup", "node-input-dangle", "node-input-empty", "node-attr",
              "init-dims", "init-dtype", "init-raw-trunc", "init-drop", "init-external", "opset", "ir",
              "graph-input", "graph-output", "metadata", "subgraph", "function", "bytes-flip", "bytes-trunc",
              "bytes-random")
CLASSES = {"onnx": 0.45, "manifest": 0.2, "tokenizer": 0.15, "scheduler": 0.1, "config": 0.1}
ODD_VALUES = (None, -1, 0, 1, 2**63, -2**63, 1e308, -1e-308, float("inf"), "nan", "", "x" * 5000, [], {}, [1, "a"],
              {"a": {"b": [None]}}, True, False, "../../../etc/passwd", "/etc/passwd", "unet/../../x", "\u0000",
              "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), 3.5, "16", [[[[]]]])


# -- crafting --------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def link_tree(src: Path, dst: Path) -> None:
    for p in src.rglob("*"):
        q = dst / p.relative_to(src)
        if p.is_dir():
            q.mkdir(parents=True, exist_ok=True)
        else:
            q.parent.mkdir(parents=True, exist_ok=True)
            os.link(p, q)


def replace_file(path: Path, data: bytes) -> None:
    """Never write through a hard link (it would change the embedded model): a new inode."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def mutate_json(obj, rng: random.Random, depth: int = 0):
    """One random leaf (or key) of a JSON value changed, deleted or added."""
    if isinstance(obj, dict) and obj and (depth < 6 and rng.random() < 0.7):
        key = rng.choice(sorted(obj, key=str))
        r = rng.random()
        if r < 0.15:
            del obj[key]
        elif r < 0.25:
            obj[rng.choice(["extra", "__proto__", "path", "../x", key + "_"])] = rng.choice(ODD_VALUES)
        else:
            obj[key] = mutate_json(obj[key], rng, depth + 1)
        return obj
    if isinstance(obj, list) and obj and depth < 6 and rng.random() < 0.7:
        i = rng.randrange(len(obj))
        if rng.random() < 0.2:
            obj.pop(i)
        else:
            obj[i] = mutate_json(obj[i], rng, depth + 1)
        return obj
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and rng.random() < 0.5:
        return rng.choice([obj * -1, obj * 1000, obj + 1, 0, obj * 1e30 if obj else 1e30])
    if isinstance(obj, str) and rng.random() < 0.4:
        return rng.choice([obj[: len(obj) // 2], obj + "/../..", "/" + obj, obj * 50, obj.upper()])
    return rng.choice(ODD_VALUES)


def json_bytes(obj, rng: random.Random) -> bytes:
    text = json.dumps(obj, allow_nan=True)
    if rng.random() < 0.1:
        text = text[: rng.randrange(len(text) + 1)]  # truncated
    return text.encode("utf-8", "surrogatepass")


def mutate_onnx(path: Path, rng: random.Random) -> str:
    import onnx
    from onnx import TensorProto, helper

    kind = rng.choice(ONNX_KINDS)
    raw = path.read_bytes()
    if kind.startswith("bytes-"):
        b = bytearray(raw)
        if kind == "bytes-flip":
            for _ in range(rng.randint(1, 32)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == "bytes-trunc":
            b = b[: rng.randrange(len(b))]
        else:
            b = bytearray(rng.randbytes(rng.choice([0, 1, 16, 4096, len(b)])))
        replace_file(path, bytes(b))
        return kind
    m = onnx.load_from_string(raw)
    g = m.graph
    nodes = list(g.node)
    node = rng.choice(nodes) if nodes else None
    if kind == "node-op" and node is not None:
        node.op_type = rng.choice(["Foo", "", "Loop", "If", "Scan", "Conv", "MatMul", "Gather", "Reshape", "Softmax",
                                   "QLinearConv", "MultiHeadAttention", "Attention", "Einsum", "Upsample"])
    elif kind == "node-domain" and node is not None:
        node.domain = rng.choice(["com.evil", "com.microsoft", "ai.onnx.ml", "ai.onnx.preview.training", "x" * 300])
    elif kind == "node-drop" and node is not None:
        g.node.remove(node)
    elif kind == "node-dup" and node is not None:
        g.node.insert(rng.randrange(len(g.node) + 1), node)
    elif kind == "node-input-dangle" and node is not None and node.input:
        node.input[rng.randrange(len(node.input))] = rng.choice(["nope", node.output[0] if node.output else "o", "sample"])
    elif kind == "node-input-empty" and node is not None and node.input:
        node.input[rng.randrange(len(node.input))] = ""
    elif kind == "node-attr" and node is not None:
        if node.attribute and rng.random() < 0.7:
            a = rng.choice(list(node.attribute))
            r = rng.random()
            if r < 0.3:
                node.attribute.remove(a)
            elif a.type == onnx.AttributeProto.INT:
                a.i = rng.choice([-1, 0, 2**62, -2**62, 10**6])
            elif a.type == onnx.AttributeProto.INTS:
                del a.ints[:]
                a.ints.extend(rng.choice([[], [-1], [0, 0, 0, 0, 0, 0, 0, 0], [2**40] * 4]))
            elif a.type == onnx.AttributeProto.FLOAT:
                a.f = rng.choice([float("nan"), float("inf"), -1e30])
            else:
                a.type = rng.choice([onnx.AttributeProto.INT, onnx.AttributeProto.GRAPH, onnx.AttributeProto.UNDEFINED])
        else:
            node.attribute.append(helper.make_attribute(rng.choice(["axis", "perm", "junk", "to"]), rng.choice([-99, 7, [5, -5], "s"])))
    elif kind.startswith("init-") and g.initializer:
        t = rng.choice(list(g.initializer))
        if kind == "init-dims":
            if t.dims and rng.random() < 0.8:
                t.dims[rng.randrange(len(t.dims))] = rng.choice([-1, 0, 2**40, 3, 2**31])
            else:
                t.dims.append(rng.choice([2, 0, 2**33]))
        elif kind == "init-dtype":
            t.data_type = rng.choice([0, 99, TensorProto.STRING, TensorProto.BFLOAT16, TensorProto.INT4,
                                      TensorProto.FLOAT8E4M3FN, TensorProto.COMPLEX64])
        elif kind == "init-raw-trunc":
            if t.raw_data:
                t.raw_data = t.raw_data[: rng.randrange(len(t.raw_data))]
            else:
                t.dims.append(7)
        elif kind == "init-drop":
            g.initializer.remove(t)
        else:  # init-external: a reference the folder must confine or refuse
            t.ClearField("raw_data")
            t.ClearField("float_data")
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            loc = rng.choice(["../manifest.json", "/etc/passwd", "nope.bin", "", "a/../../x", ".", "model.onnx",
                              "../../../../../../dev/zero", "\u0000x", "../unet/model.onnx", "config.json"])
            for k, v in (("location", loc), ("offset", rng.choice(["0", "-1", "99999999999", "x", "0"])),
                         ("length", rng.choice(["4", "-4", str(2**40), "", "16"]))):
                e = t.external_data.add()
                e.key, e.value = k, v
    elif kind == "opset":
        if m.opset_import and rng.random() < 0.8:
            m.opset_import[0].version = rng.choice([0, 1, 6, 999, -1])
        else:
            del m.opset_import[:]
    elif kind == "ir":
        m.ir_version = rng.choice([0, 1, 2, 99, -1])
    elif kind == "graph-input" and g.input:
        vi = rng.choice(list(g.input))
        tt = vi.type.tensor_type
        if tt.shape.dim and rng.random() < 0.6:
            d = tt.shape.dim[rng.randrange(len(tt.shape.dim))]
            d.dim_value = rng.choice([-5, 0, 10**12, 3])
        elif rng.random() < 0.5:
            tt.elem_type = rng.choice([0, 99, TensorProto.STRING, TensorProto.INT8])
        else:
            vi.name = rng.choice(["", "sample", "x" * 1000, "input_ids"])
    elif kind == "graph-output" and g.output:
        o = rng.choice(list(g.output))
        if rng.random() < 0.5:
            g.output.remove(o)
        else:
            o.name = rng.choice(["out_sample", "sample", "", "nope"])
    elif kind == "metadata":
        p = m.metadata_props.add()
        p.key = rng.choice(["onnxdiffusion.external_data_dir", "onnx.infer", "x" * 10000])
        p.value = rng.choice(["/", "..", "/etc", "x" * 100000])
    elif kind == "subgraph":
        cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
        bad = helper.make_graph([helper.make_node(rng.choice(["Foo", "Add", "Loop"]), ["nope"], ["y"])], "b", [],
                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        g.node.append(helper.make_node("If", [g.input[0].name if g.input else "c"], ["if_out"],
                                       then_branch=bad, else_branch=bad))
        g.input.append(cond) if rng.random() < 0.3 else None
    elif kind == "function":
        f = onnx.FunctionProto(name="Rec", domain="local.fuzz", input=["x"], output=["y"])
        f.node.append(helper.make_node("Rec", ["x"], ["y"], domain="local.fuzz"))  # calls itself
        f.opset_import.append(helper.make_opsetid("local.fuzz", 1))
        m.functions.append(f)
        m.opset_import.append(helper.make_opsetid("local.fuzz", 1))
        if g.node:
            n = g.node[0]
            g.node.insert(0, helper.make_node("Rec", [n.input[0] if n.input else "x"], ["rec_out"], domain="local.fuzz"))
    replace_file(path, m.SerializeToString())
    return kind


def craft(base: Path, case: Path, seed: int) -> dict:
    """Build case `seed` under `case`; returns what was changed."""
    rng = random.Random(seed)
    link_tree(base, case)
    manifest = json.loads((case / "manifest.json").read_text())
    cls = rng.choices(list(CLASSES), list(CLASSES.values()))[0]
    rehash = rng.random() < 0.85
    changed: list[str] = []
    what = cls
    if cls == "onnx":
        comps = [c["path"] for c in manifest["components"].values() if c.get("path", "").endswith(".onnx")]
        big = [p for p in comps if (case / p).stat().st_size > 8 << 20]
        rel = rng.choice([p for p in comps if p not in big] if big and rng.random() < 0.8 else comps)
        what = f"onnx {rel}: {mutate_onnx(case / rel, rng)}"
        changed.append(rel)
    elif cls == "manifest":
        r = rng.random()
        if r < 0.2:  # a component path that leaves the folder or names something else
            comp = rng.choice(sorted(manifest["components"]))
            manifest["components"][comp]["path"] = rng.choice(["../../etc/passwd", "/etc/passwd", "unet/../../x",
                                                               "tokenizer/vocab.json", "", ".", "manifest.json"])
            what = f"manifest component path {comp}"
        elif r < 0.3:
            manifest["files"][rng.choice(["../x", "/abs", "nope.onnx", "tokenizer"])] = "0" * 64
            what = "manifest files entry"
        else:
            manifest = mutate_json(manifest, rng)
            what = "manifest leaf"
        replace_file(case / "manifest.json", json_bytes(manifest, rng))
        return {"seed": seed, "class": cls, "what": what, "rehash": False}
    elif cls in ("tokenizer", "scheduler", "config"):
        if cls == "tokenizer":
            files = sorted(p.relative_to(case).as_posix() for p in case.glob("tokenizer*/*"))
        elif cls == "scheduler":
            files = ["scheduler/scheduler_config.json"]
        else:
            files = sorted(p.relative_to(case).as_posix() for p in case.glob("*/config.json"))
        rel = rng.choice(files)
        path = case / rel
        if rel.endswith(".json") and rng.random() < 0.85:
            try:
                data = json_bytes(mutate_json(json.loads(path.read_text()), rng), rng)
            except ValueError:
                data = rng.randbytes(64)
        else:
            b = bytearray(path.read_bytes())
            for _ in range(rng.randint(1, 16)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            data = bytes(b[: rng.randrange(len(b) + 1)] if rng.random() < 0.3 else b)
        replace_file(path, data)
        what = f"{cls} {rel}"
        changed.append(rel)
    if rehash:
        for rel in changed:
            if rel in manifest.get("files", {}):
                manifest["files"][rel] = sha256(case / rel)
        replace_file(case / "manifest.json", json.dumps(manifest, indent=2).encode())
    return {"seed": seed, "class": cls, "what": what, "rehash": rehash}


# -- the worker ------------------------------------------------------------------------------------
def _outcome(fn) -> str:
    from onnxdiffusion.errors import UserError

    try:
        fn()
        return "ok"
    except UserError:
        return "refused"
    except MemoryError:
        return "refused"  # the CLI answers one line for this too
    except Exception as e:  # noqa: BLE001 - this is what the fuzzer looks for
        return f"traceback {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def worker() -> None:
    import resource
    import warnings

    warnings.simplefilter("ignore")
    # a crafted shape asking for terabytes fails as an allocation error, not by the OOM killer
    limit = 4 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.path.insert(0, str(ROOT / "src"))
    from onnxdiffusion.folder.artifacts import read_manifest, verify_folder
    from onnxdiffusion.runtime import Pipeline

    # answers go out on a copy of stdout; fd 1 itself goes to stderr, so a native library printing there
    # (ONNX Runtime, onnx's C++ checks) cannot break the one-JSON-line-per-case protocol
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    pipes: dict = {}  # adapter cases: the insertion-point folder is loaded once
    for line in sys.stdin:
        job = json.loads(line)
        folder = Path(job["folder"])
        if "lora" in job:
            def with_lora():
                if job["folder"] not in pipes:
                    pipes[job["folder"]] = Pipeline.from_folder(folder, threads=1)
                pipes[job["folder"]]("a red circle", steps=1, seed=0, loras=[(job["lora"], job["scale"])])

            print(json.dumps({"lora": _outcome(with_lora)}), file=answers, flush=True)
            continue
        res = {"verify": _outcome(lambda: verify_folder(folder, read_manifest(folder)))}

        def generate():
            pipe = Pipeline.from_folder(folder, threads=1)
            pipe("a red circle", steps=1, seed=0)

        res["generate"] = _outcome(generate)
        if job.get("quantize"):
            res["quantize"] = _quantize_outcome(folder)
        print(json.dumps(res), file=answers, flush=True)


def _quantize_outcome(folder: Path) -> str:
    """quantize's open stage through the CLI verb: 0 or 2 is clean, 1 is an internal error (a traceback file)."""
    import contextlib
    import io

    from onnxdiffusion.cli import run

    out = Path(tempfile.mkdtemp(prefix="fuzz-q-")) / "q"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = run(["quantize", str(folder), str(out), "--recipe", "int8-dynamic", "--calib-count", "4",
                      "--calib-steps", "2", "--latency-runs", "1", "--no-quality"])
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    if rc in (0, 2):
        return "ok" if rc == 0 else "refused"
    return f"traceback rc {rc}: {err.getvalue().strip().splitlines()[-1][:200] if err.getvalue().strip() else ''}"


class Worker:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def ask(self, job: dict, timeout: float) -> dict:
        import select

        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            return {"hang": True}
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            return {"signal": -rc if rc < 0 else None, "exit": rc}
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def classify(res: dict) -> str:
    if res.get("hang"):
        return "hang"
    if "exit" in res:
        return "signal" if res.get("signal") else "traceback"  # a worker that exited without answering
    return "traceback" if any(str(v).startswith("traceback") for v in res.values()) else "clean"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0, help="case i uses seed SEED + i")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--quantize-every", type=int, default=10, help="also run quantize on every N-th case (0: never)")
    ap.add_argument("--replay", type=int, default=None, help="build case SEED, run it, print the outcome, keep the folder")
    ap.add_argument("--minutes", type=float, default=0, help="stop starting cases after this long (0: no limit)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes run side by side")
    ap.add_argument("--out", type=Path, default=None, help="results file stem (.json + .md)")
    ap.add_argument("--kind", choices=("folders", "adapters"), default="folders",
                    help="folders: crafted model folders; adapters: crafted LoRA files (bench/fuzz_adapters.py)")
    args = ap.parse_args()
    if args.worker:
        return worker()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fuzz_adapters

    work = Path(tempfile.mkdtemp(prefix="fuzz-folders-"))
    seeds = [args.replay] if args.replay is not None else [args.seed + i for i in range(args.cases)]
    counts: dict = {}
    by_class: dict = {}
    findings: list = []
    lock = threading.Lock()
    t0 = time.time()
    done = [0]

    points = fuzz_adapters.points_folders(BASES, work) if args.kind == "adapters" else {}

    def run_case(seed: int, w: Worker) -> Worker:
        base = sorted(BASES)[seed % len(BASES)]
        case = work / f"case-{seed}"
        try:
            if args.kind == "adapters":
                case = case.with_suffix(".safetensors")
                info = fuzz_adapters.craft(points[base], case, seed)
                job = {"folder": str(points[base]), "lora": str(case), "scale": info.pop("_scale")}
            else:
                info = craft(BASES[base], case, seed)
        except Exception as e:  # a bug of the fuzzer, not a finding: counted apart, the lane goes on
            with lock:
                counts["craft_error"] = counts.get("craft_error", 0) + 1
                print(f"[fuzz] case {seed}: could not craft ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            shutil.rmtree(case, ignore_errors=True)
            return w
        if args.kind != "adapters":
            job = {"folder": str(case), "quantize": bool(args.quantize_every) and seed % args.quantize_every == 0}
        res = w.ask(job, args.timeout)
        outcome = classify(res)
        if outcome in ("hang", "signal") or "exit" in res:
            w = Worker()
        with lock:
            counts[outcome] = counts.get(outcome, 0) + 1
            key = f"{base}/{info['class']}"
            by_class.setdefault(key, {}).setdefault(outcome, 0)
            by_class[key][outcome] += 1
            for loader, v in res.items():
                k = f"{loader}:{str(v).split(' ')[0]}"
                counts[k] = counts.get(k, 0) + 1
            if outcome != "clean":
                findings.append({"base": base, **info, "result": res, "outcome": outcome})
                print(f"[fuzz] case {seed} ({base}, {info['what']}): {outcome} {res}", file=sys.stderr, flush=True)
            done[0] += 1
            if done[0] % 50 == 0:
                rate = done[0] / (time.time() - t0)
                print(f"[fuzz] {done[0]}/{len(seeds)} cases, {rate:.2f}/s, {counts}", file=sys.stderr, flush=True)
        if args.replay is None:
            shutil.rmtree(case, ignore_errors=True) if case.is_dir() else case.unlink(missing_ok=True)
        return w

    def lane(lane_seeds: list[int]) -> None:
        w = Worker()
        try:
            for seed in lane_seeds:
                if args.minutes and time.time() - t0 > args.minutes * 60:
                    break  # out of time: the summary counts the cases that ran
                w = run_case(seed, w)
        finally:
            w.close()

    lanes = [seeds[i::args.jobs] for i in range(args.jobs)]
    threads = [threading.Thread(target=lane, args=(ls,)) for ls in lanes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if args.replay is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"case folder kept: {work / f'case-{seeds[0]}'}", file=sys.stderr)
    findings.sort(key=lambda f: f["seed"])
    ran = sum(counts.get(k, 0) for k in ("clean", "traceback", "signal", "hang"))
    result = {"kind": args.kind, "cases": ran, "craft_errors": counts.get("craft_error", 0), "seed": args.seed, "jobs": args.jobs, "timeout_s": args.timeout, "quantize_every": args.quantize_every,
              "seconds": round(time.time() - t0, 1), "outcomes": {k: counts.get(k, 0) for k in ("clean", "traceback",
                                                                                               "signal", "hang")},
              "loader_outcomes": {k: v for k, v in sorted(counts.items()) if ":" in k}, "by_class": by_class,
              "findings": findings[:200]}
    from onnxdiffusion.bench.setup import machine_info

    result["machine"] = machine_info()
    print(json.dumps({k: result[k] for k in ("cases", "outcomes", "loader_outcomes", "seconds")}, indent=1))
    if args.out is not None:
        from onnxdiffusion.folder.artifacts import write_json

        write_json(args.out.with_suffix(".json"), result)
        write_md(args.out.with_suffix(".md"), result)


def write_md(path: Path, r: dict) -> None:
    o = r["outcomes"]
    title = ("Fuzzed LoRA files: {} crafted adapters through the run-time LoRA loader" if r.get("kind") == "adapters"
             else "Fuzzed model folders: {} crafted inputs through every loader").format(r["cases"])
    lines = [f"# {title}", "",
             f"CPU: {r['machine'].get('cpu')} ({r['machine'].get('cpus')} cores, shared; load "
             f"{' '.join(r['machine'].get('loadavg') or [])}); {r['seconds']:.0f} s; seeds {r['seed']}..{r['seed'] + r['cases'] - 1}; "
             f"per-case timeout {r['timeout_s']:g} s" + (f"; quantize on every {r['quantize_every']}th case." if r.get("kind") != "adapters" else "."), "",
             "| outcome | cases |", "|---|---|", *[f"| {k} | {v} |" for k, v in o.items()], "",
             "| base / class | " + " | ".join(o) + " |", "|---|" + "---|" * len(o),
             *[f"| {k} | " + " | ".join(str(v.get(x, 0)) for x in o) + " |" for k, v in sorted(r["by_class"].items())], "",
             "Per loader (ok = loaded and ran, refused = one-line UserError):", "",
             *[f"- {k}: {v}" for k, v in r["loader_outcomes"].items()]]
    if r["findings"]:
        lines += ["", "Findings (replay with `--replay SEED`):", "",
                  *[f"- seed {f['seed']} ({f['base']}, {f['what']}): {f['outcome']} {f['result']}" for f in r["findings"]]]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
