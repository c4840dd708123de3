"""Issue 44, acceptance 2: which 4-bit weight rounding lifts rotated W4A8 on an embedded model, by backbone SQNR.

    PYTHONPATH=src python experiments/rotation/w4_weight_probe.py mmdit sym,asym,symclip,symclipH,asymclipH,gptq,gptqa,gptqaclip,awq0.5a,w8
    BS=16 PYTHONPATH=src python experiments/rotation/w4_weight_probe.py mmdit gptqaclip,gptqa

The backbone as w4a8 sees it (Gemms as MatMuls, every MatMul's input group-Hadamard rotated, 64), its 4-bit
weights replaced by their dequantized values (fake quantization in float: the weights' share of the error alone;
MatMulNBits' int8 activations add little, 23.57 -> 23.4 dB for gptqaclip), output SQNR vs fp32 on 10 of the
20 steps of 32 calibration prompts' trajectories (cached in SCRATCH). `layer_db`: the mean over linears of
tr(E H E^T) / tr(W H W^T), H the input Hessian from 6 steps. Variants: sym / asym (ONNX Runtime's min/max
rounding, symmetric with the largest magnitude at -8), *clip (per block, the clip ratio(s) of least weight
error, *H: weighted by diag H), gptq* (GPTQ over the input axis, each block's grid fixed at its first row;
a: asymmetric, clip: grid by clip search: what quantize/gptq.py does), awqALPHA[a] (channels scaled by
mean|x|^ALPHA before rounding, then clip search), w8 (8-bit asymmetric: the weights' floor).

Mixed precision (issue 44's second W4A8 session): `... mmdit rank` measures every linear's 4-bit error alone
(gptqaclip, the rest float, backbone SQNR on RANK_STEPS steps), ranks them by that error per byte its 8-bit form
costs, then gives the top k 8-bit asymmetric weights (the rest gptqaclip 4-bit) for each k in KS and prints the
backbone SQNR with the 4-bit share of the linears' weight bytes (MatMulNBits' layout: 4- or 8-bit codes, a float
scale and a packed zero point per block). `... mmdit groups`: each group of linears (adaln: the timestep / text
embedders and every norm's modulation linear; attn; ff; embed_out: the context embedder and the final projection)
8-bit, the rest 4-bit; `... mmdit cumul`: those groups made 8-bit one after another (embed_out, the MLPs' down
projections, the rest of the MLPs, attn, adaln); `SETS="embed_out+attn;..." ... mmdit sets`: each set 8-bit.
HSTEPS (6): calibration steps the Hessians come from; `gptqaclipact`: GPTQ in descending
diag-H order (act-order, each block's grid fixed before, static groups).
"""

import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = Path(os.environ.get("SCRATCH", "/tmp/w4_weight_probe"))
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.families import get_family  # noqa: E402
from onnxdiffusion.folder.artifacts import component_path, read_manifest  # noqa: E402
from onnxdiffusion.quantize import files  # noqa: E402
from onnxdiffusion.quantize.calibration import capture, load_prompts  # noqa: E402
from onnxdiffusion.quantize.configs_base import CalibrationConfig  # noqa: E402
from onnxdiffusion.quantize.graphs import prepare_unet, quantizable_nodes  # noqa: E402
from onnxdiffusion.quantize.opgroups import gemms_as_matmuls  # noqa: E402
from onnxdiffusion.quantize.rotation import rotate_linears  # noqa: E402
from onnxdiffusion.quantize.runner import backbone_outputs, session, sqnr_db  # noqa: E402
from onnxdiffusion.quantize.static_plan import _infer  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import npz_cache  # noqa: E402

MODELS = {"mmdit": ("models/shapes-mmdit-onnx", "flow_euler", 20, 3.0), "sd": ("models/shapes-sd-onnx", "ddim", 20, 4.0)}


def load(tag: str, count: int = 32, rotate: int = 64):
    folder, sampler, steps, guidance = MODELS[tag]
    folder = ROOT / folder
    SCRATCH.mkdir(parents=True, exist_ok=True)
    cfg = CalibrationConfig(count=count, sampler=sampler, steps=steps, guidance=guidance)
    calib = npz_cache.calibration(SCRATCH / f"calib_{tag}.npz", lambda: capture(
        Pipeline.from_folder(folder, provider="cpu", verify=False, threads=1), load_prompts(cfg)[0], cfg))
    manifest = read_manifest(folder)
    base = prepare_unet(files.load_backbone(component_path(folder, manifest, get_family(manifest.family).backbone)))
    base, _ = gemms_as_matmuls(base, [q.name for q in quantizable_nodes(base, ("Gemm",))])
    base = _infer(base)
    if rotate:
        base, _ = rotate_linears(base, [q.name for q in quantizable_nodes(base, ("MatMul",))], rotate)
        base = _infer(base)
    return calib, base, [q for q in quantizable_nodes(base, ("MatMul",)) if q.weight_size >= 32]


# --- 4-bit block rounding (fake quantization); W is (K, N), blocks of bs along K per column ----------------


def _blocks(W, bs):
    K, N = W.shape
    nb = -(-K // bs)
    P = np.zeros((nb * bs, N), np.float64); P[:K] = W
    return P.reshape(nb, bs, N), K

def _unblocks(B, K):
    return B.reshape(-1, B.shape[-1])[:K]

def q_sym(B, ratio=1.0):
    # ORT: the signed value of largest magnitude maps to -8
    idx = np.abs(B).argmax(axis=1)[:, None, :]
    vmax = np.take_along_axis(B, idx, axis=1) * ratio
    scale = vmax / -8.0
    scale = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.round(B / scale) + 8, 0, 15)
    return (q - 8) * scale

def q_asym(B, r_lo=1.0, r_hi=1.0, bits=4):
    top = 2 ** bits - 1
    mn = np.minimum(B.min(axis=1, keepdims=True), 0) * r_lo
    mx = np.maximum(B.max(axis=1, keepdims=True), 0) * r_hi
    scale = (mx - mn) / top
    scale = np.where(scale == 0, 1.0, scale)
    zp = np.clip(np.round(-mn / scale), 0, top)
    q = np.clip(np.round(B / scale) + zp, 0, top)
    return (q - zp) * scale

def rtn(W, bs, sym=True):
    B, K = _blocks(W, bs)
    return _unblocks(q_sym(B) if sym else q_asym(B), K)

def clip_search(W, bs, sym=True, d=None, grid=None):
    """per block, the clip ratio(s) minimizing sum_k d_k (w - q)^2 (d: E[x_k^2], the diag Hessian)."""
    B, K = _blocks(W, bs)
    dd = np.ones(B.shape[0] * bs) if d is None else np.concatenate([d, np.zeros(B.shape[0] * bs - K)])
    dd = dd.reshape(B.shape[0], bs, 1)
    grid = grid if grid is not None else np.linspace(1.0, 0.5, 21)
    best = None; berr = None
    if sym:
        cands = [(r,) for r in grid]
        f = lambda c: q_sym(B, c[0])
    else:
        cands = [(a, b) for a in grid for b in grid]
        f = lambda c: q_asym(B, c[0], c[1])
    for c in cands:
        Q = f(c)
        err = (dd * (B - Q) ** 2).sum(axis=1, keepdims=True)
        if best is None:
            best, berr = Q, err
        else:
            m = err < berr
            best = np.where(m, Q, best); berr = np.where(m, err, berr)
    return _unblocks(best, K)

def gptq_act(W, bs, H, sym=False, damp=0.01):
    """GPTQ in descending diag-H order (act-order) with static groups: every block's grid (clip search on the
    original weights, diag-H weighted) fixed first, then channels rounded in act order."""
    W = W.astype(np.float64).copy(); K, N = W.shape
    d = np.diag(H).astype(np.float64)
    params = [_grid_params(W[k0:k0 + bs][None], sym, d[k0:k0 + bs], np.linspace(1.0, 0.5, 11)) for k0 in range(0, K, bs)]
    perm = np.argsort(-d, kind="stable")
    Wp, Hp = W[perm], H.astype(np.float64)[np.ix_(perm, perm)].copy()
    dead = np.diag(Hp) == 0
    Hp[dead, dead] = 1; Wp[dead] = 0
    Hp += damp * np.mean(np.diag(Hp)) * np.eye(K)
    Hinv = np.linalg.cholesky(np.linalg.inv(Hp)).T
    Q = np.zeros_like(Wp)
    for i in range(K):
        q = _apply(Wp[i], params[perm[i] // bs], sym)
        Q[i] = q
        Wp[i + 1:] -= np.outer(Hinv[i, i + 1:], (Wp[i] - q) / Hinv[i, i])
    out = np.zeros_like(Q); out[perm] = Q
    return out

def gptq(W, bs, H, sym=True, damp=0.01, clip=False, d=None):
    """GPTQ over the K (input) axis; each block's scale fixed from the (partly updated) weights at its first row."""
    W = W.astype(np.float64).copy(); K, N = W.shape
    H = H.astype(np.float64).copy()
    dead = np.diag(H) == 0
    H[dead, dead] = 1; W[dead] = 0
    H += damp * np.mean(np.diag(H)) * np.eye(K)
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T  # upper
    Q = np.zeros_like(W)
    for k0 in range(0, K, bs):
        k1 = min(k0 + bs, K)
        blk = W[k0:k1]
        # fix the block's quantization grid now
        Bq = blk[None]
        if clip:
            dd = np.diag(H)[k0:k1] if d is None else d[k0:k1]
            grid = np.linspace(1.0, 0.5, 11)
            params = _grid_params(Bq, sym, dd, grid)
        else:
            params = _grid_params(Bq, sym, None, [1.0])
        for k in range(k0, k1):
            w = W[k]
            q = _apply(w, params, sym)
            Q[k] = q
            e = (w - q) / Hinv[k, k]
            W[k + 1:] -= np.outer(Hinv[k, k + 1:], e)
    return Q

def _grid_params(Bq, sym, dd, grid):
    # returns per-column (scale, zp) for the block
    B = Bq[0]  # (bs, N)
    best = None
    for r in grid:
        for r2 in ([r] if sym else grid):
            if sym:
                idx = np.abs(B).argmax(axis=0)[None]
                vmax = np.take_along_axis(B, idx, axis=0)[0] * r
                scale = vmax / -8.0; scale = np.where(scale == 0, 1.0, scale); zp = np.full_like(scale, 8.0)
            else:
                mn = np.minimum(B.min(axis=0), 0) * r; mx = np.maximum(B.max(axis=0), 0) * r2
                scale = (mx - mn) / 15; scale = np.where(scale == 0, 1.0, scale); zp = np.clip(np.round(-mn / scale), 0, 15)
            Q = (np.clip(np.round(B / scale) + zp, 0, 15) - zp) * scale
            err = ((B - Q) ** 2 * (1 if dd is None else dd[:, None])).sum(axis=0)
            if best is None:
                best = [scale, zp, err]
            else:
                m = err < best[2]
                best = [np.where(m, scale, best[0]), np.where(m, zp, best[1]), np.where(m, err, best[2])]
    return best[0], best[1]

def _apply(w, params, sym):
    scale, zp = params
    return (np.clip(np.round(w / scale) + zp, 0, 15) - zp) * scale


# --- the probe ------------------------------------------------------------------------------------------

def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "mmdit"
    variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["sym", "asym"]
    bs = int(os.environ.get("BS", "32"))
    calib, base, chosen = load(tag)
    inits = {t.name: t for t in base.graph.initializer}
    nodes = {n.name: n for n in base.graph.node}
    W = {q.name: numpy_helper.to_array(inits[nodes[q.name].input[1]]).astype(np.float64) for q in chosen}
    print(len(W), "linears", sum(w.size for w in W.values()), "weights", flush=True)
    xs = sorted({nodes[n].input[0] for n in W})
    m = onnx.ModelProto()
    m.CopyFrom(base)
    del m.graph.output[:]
    m.graph.output.extend([helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None) for x in xs])
    sess = session(m, 1)
    H, cnt, absm = dict.fromkeys(xs, 0), dict.fromkeys(xs, 0), dict.fromkeys(xs, 0)
    for _, feed in calib.feeds(calib.spread_steps(int(os.environ.get("HSTEPS", "6")))):
        for x, v in zip(xs, sess.run(xs, feed)):
            v = v.reshape(-1, v.shape[-1]).astype(np.float64)
            H[x] = H[x] + v.T @ v
            cnt[x] += len(v)
            absm[x] = absm[x] + np.abs(v).sum(0)
    for x in xs:
        H[x] /= cnt[x]
        absm[x] /= cnt[x]
    del sess
    eval_steps = calib.spread_steps(10)
    ref = calib.outputs[eval_steps]
    if variants[0] in ("rank", "groups", "cumul", "sets"):
        return mixed(variants[0], base, calib, W, H, nodes, bs, eval_steps)
    # EIGHT=sub1,sub2: the linears whose names hold one of these get 8-bit asymmetric weights in every variant
    eight = [n for n in W if any(p and p in n for p in os.environ.get("EIGHT", "").split(","))]
    if eight:
        print("8-bit:", len(eight), "of", len(W), "linears,", sum(W[n].size for n in eight), "weights:", eight, flush=True)
    for v in variants:
        t0 = time.time()
        deq = {}
        for n, w in W.items():
            h = H[nodes[n].input[0]]
            d = np.diag(h)
            if n in eight:
                deq[n] = _unblocks(q_asym(_blocks(w, bs)[0], bits=8), w.shape[0])
            elif v == "sym":
                deq[n] = rtn(w, bs, True)
            elif v == "asym":
                deq[n] = rtn(w, bs, False)
            elif v == "symclip":
                deq[n] = clip_search(w, bs, True)
            elif v == "asymclip":
                deq[n] = clip_search(w, bs, False, grid=np.linspace(1, 0.6, 9))
            elif v == "symclipH":
                deq[n] = clip_search(w, bs, True, d=d)
            elif v == "asymclipH":
                deq[n] = clip_search(w, bs, False, d=d, grid=np.linspace(1, 0.6, 9))
            elif v == "gptqaclipact":
                deq[n] = gptq_act(w, bs, h)
            elif v in ("gptq", "gptqa", "gptqclip", "gptqaclip"):
                deq[n] = gptq(w, bs, h, v.startswith("gptq") and "a" not in v[4:], clip=v.endswith("clip"))
            elif v.startswith("awq"):
                alpha = float(v[3:].rstrip("a"))
                s = absm[nodes[n].input[0]] ** alpha
                s = s / np.sqrt(s.max() * s.min())
                q = clip_search(w * s[:, None], bs, not v.endswith("a"), d=d / s ** 2, grid=np.linspace(1, 0.6, 9))
                deq[n] = q / s[:, None]
            elif v == "w8":
                deq[n] = _unblocks(q_asym(_blocks(w, bs)[0], bits=8), w.shape[0])
            else:
                raise SystemExit(f"unknown variant {v}")
        mm = onnx.ModelProto()
        mm.CopyFrom(base)
        by_init = {nodes[n].input[1]: deq[n] for n in deq}
        for i, t in enumerate(mm.graph.initializer):
            if t.name in by_init:
                mm.graph.initializer[i].CopyFrom(numpy_helper.from_array(by_init[t.name].astype(np.float32), t.name))
        got = backbone_outputs(mm, calib, eval_steps, 1)
        rel = np.mean([np.trace((W[n] - deq[n]).T @ H[nodes[n].input[0]] @ (W[n] - deq[n]))
                       / np.trace(W[n].T @ H[nodes[n].input[0]] @ W[n]) for n in deq])
        print(json.dumps({"label": f"{v} b{bs}", "sqnr": round(sqnr_db(ref, got), 2), "layer_db": round(-10 * math.log10(rel), 2),
                          "s": round(time.time() - t0, 1)}), flush=True)


def nbits_bytes(w, bs, bits):
    """MatMulNBits' bytes for a (K, N) weight: codes, a float32 scale and a packed zero point per block."""
    nb = -(-w.shape[0] // bs)
    return nb * w.shape[1] * (bs * bits / 8 + 4 + bits / 8)


GROUPS = {"adaln": ("time_text_embed", "norm1/linear", "norm1_context/linear", "norm_out/linear"),
          "attn": ("/attn/",), "ff": ("/ff/", "/ff_context/"), "embed_out": ("context_embedder", "proj_out")}


CUMUL = ("embed_out", "net.2/MatMul", "ff", "attn", "adaln")  # net.2: the MLPs' down projections


def mixed(mode, base, calib, W, H, nodes, bs, eval_steps) -> None:
    deq4 = npz_cache.arrays(SCRATCH / f"deq_gptqaclip_b{bs}_h{os.environ.get('HSTEPS', '6')}.npz",
                            lambda: {n: gptq(w, bs, H[nodes[n].input[0]], False, clip=True) for n, w in W.items()})
    deq8 = {n: _unblocks(q_asym(_blocks(w, bs)[0], bits=8), w.shape[0]) for n, w in W.items()}
    b4 = {n: nbits_bytes(w, bs, 4) for n, w in W.items()}
    b8 = {n: nbits_bytes(w, bs, 8) for n, w in W.items()}
    ref = calib.outputs[eval_steps]

    def sqnr(eight, four, steps=eval_steps):
        mm = onnx.ModelProto()
        mm.CopyFrom(base)
        by_init = {nodes[n].input[1]: (deq8[n] if n in eight else deq4[n]) for n in set(eight) | set(four)}
        for i, t in enumerate(mm.graph.initializer):
            if t.name in by_init:
                mm.graph.initializer[i].CopyFrom(numpy_helper.from_array(by_init[t.name].astype(np.float32), t.name))
        return sqnr_db(calib.outputs[steps], backbone_outputs(mm, calib, steps, 1))

    def row(label, eight):
        four = [n for n in W if n not in set(eight)]
        t0 = time.time()
        db = sqnr(eight, four)
        frac = sum(b4[n] for n in four) / (sum(b4[n] for n in four) + sum(b8[n] for n in eight))
        print(json.dumps({"label": label, "bs": bs, "n8": len(eight), "sqnr": round(db, 2), "frac4_bytes": round(frac, 4),
                          "frac8_weights": round(sum(W[n].size for n in eight) / sum(w.size for w in W.values()), 4),
                          "s": round(time.time() - t0, 1), "eight": eight}), flush=True)

    if mode == "groups":
        row("all 4-bit", [])
        for g, subs in GROUPS.items():
            row(f"{g} 8-bit", [n for n in W if any(x in n for x in subs)])
        return
    if mode == "sets":  # SETS="g1+g2;g3": each set of groups (or name substrings) 8-bit, the rest 4-bit
        for spec in os.environ["SETS"].split(";"):
            subs = [x for g in spec.split("+") for x in (GROUPS.get(g) or (g,))]
            row(spec, [n for n in W if any(x in n for x in subs)])
        return
    if mode == "cumul":  # groups made 8-bit one after another, in the order of the groups run's gain per byte
        eight: list[str] = []
        for g in CUMUL:
            eight += [n for n in W if n not in eight and any(x in n for x in (GROUPS.get(g) or (g,)))]
            row(f"+ {g} 8-bit", list(eight))
        return
    steps = calib.spread_steps(int(os.environ.get("RANK_STEPS", "4")))
    err = {}
    for n in W:
        err[n] = 10 ** (-sqnr([], [n], steps) / 10)
    ranked = sorted(W, key=lambda n: -err[n] / (b8[n] - b4[n]))
    print(json.dumps({"ranking": [{"node": n, "alone_sqnr_db": round(-10 * math.log10(err[n]), 2),
                                   "err_per_kb": err[n] / (b8[n] - b4[n]) * 1024} for n in ranked]}), flush=True)
    for k in [int(x) for x in os.environ.get("KS", "0,1,2,3,4,6,8,12,16,24,32").split(",")]:
        row(f"top {k} 8-bit", ranked[:k])


if __name__ == "__main__":
    main()
