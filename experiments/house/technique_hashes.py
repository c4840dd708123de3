"""Behaviour baseline of the per-step techniques: sha256 of the final latents of each technique, host loop and
Loop graph, on both embedded models, so moving the techniques' code can be checked to draw the same pictures.

    PYTHONPATH=src python experiments/house/technique_hashes.py WORK OUT.json [--only NAME,...] [--compare BASE.json]

WORK holds the derived folders (Loop graphs, LoRA points copies, quantized folders with a correction or a
precision schedule); they are built through the CLI (its names are the stable interface) and reused when present.
Generation goes through the Python API (`Pipeline.from_folder(...)(prompt, **options)`), 1 thread, fixed seeds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
SD, MMDIT = ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx"
LORA = ROOT / "models" / "loras" / "shapes-sd-violet.safetensors"
PROMPT = "a small red circle on the left"
QUANT = ["--recipe", "int8-static", "--calib-count", "4", "--calib-steps", "4", "--latency-runs", "1", "--threads", "1"]


def folders(work: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (folder, the CLI command that builds it from the shipped models)."""
    def loop(src: Path, name: str, *flags: str):
        return work / name, ["compile-loop", str(src), str(work / name), *flags]

    return {
        "sd": (SD, []), "mmdit": (MMDIT, []),
        "sd-loop": loop(SD, "sd-loop"),
        "sd-loop-deep": loop(SD, "sd-loop-deep", "--cache", "deepcache:3:L1"),
        "sd-loop-stop": loop(SD, "sd-loop-stop", "--stop-early"),
        "sd-loop-control": loop(SD, "sd-loop-control", "--controlnet", "position"),
        "mmdit-loop": loop(MMDIT, "mmdit-loop"),
        "mmdit-loop-fb": loop(MMDIT, "mmdit-loop-fb", "--cache", "first_block"),
        "mmdit-loop-taylor": loop(MMDIT, "mmdit-loop-taylor", "--cache", "taylorseer:3:1"),
        "mmdit-loop-residual": loop(MMDIT, "mmdit-loop-residual", "--cache", "residual:5:1"),
        "mmdit-loop-stop": loop(MMDIT, "mmdit-loop-stop", "--stop-early"),
        "sd-points": (work / "sd-points", ["lora", "points", str(SD), str(work / "sd-points")]),
        "sd-points-loop": (work / "sd-points-loop", ["compile-loop", str(work / "sd-points"), str(work / "sd-points-loop")]),
        "sd-int8-correct": (work / "sd-int8-correct", ["quantize", str(SD), str(work / "sd-int8-correct"), *QUANT, "--correct"]),
        "mmdit-int8-schedule": (work / "mmdit-int8-schedule", ["quantize", str(MMDIT), str(work / "mmdit-int8-schedule"),
                                                               *QUANT, "--precision-schedule", "steps=1,prompts=4"]),
    }


def picture(seed: int, h: int = 64, w: int = 64):
    import numpy as np

    rng = np.random.default_rng(seed)
    img = np.zeros((h, w, 3), np.uint8)
    img[:] = rng.integers(0, 255, 3, dtype=np.uint8)
    img[h // 4: h // 2, w // 4: w // 2] = rng.integers(0, 255, 3, dtype=np.uint8)
    return img


def mask(h: int = 64, w: int = 64):
    import numpy as np

    m = np.zeros((h, w), np.uint8)
    m[h // 2:, :] = 255
    return m


def position_condition():
    from onnxdiffusion.evaluate import scenes as S

    return S.render_condition(S.scenes("heldout", 1)[0])


# name, folder, options; every case runs as listed (host cases on the shipped folders, loop ones on compiled ones)
def cases() -> list[tuple[str, str, dict]]:
    sd = dict(steps=10, seed=3, guidance=5.0)
    mm = dict(steps=10, seed=3)
    img = dict(image=("picture", 1), strength=0.7)
    inp = dict(image=("picture", 2), mask=("mask",), strength=1.0)
    ctl = dict(controlnets=("position",))
    return [
        ("sd-host", "sd", sd), ("sd-loop", "sd-loop", {**sd, "loop": "loop"}),
        ("sd-host-dpm", "sd", {**sd, "sampler": "dpmpp_2m"}), ("sd-loop-dpm", "sd-loop", {**sd, "sampler": "dpmpp_2m", "loop": "loop"}),
        ("sd-host-deep", "sd", {**sd, "cache": "deepcache:3:L1"}),
        ("sd-loop-deep", "sd-loop-deep", {**sd, "cache": "deepcache:3:L1", "loop": "loop"}),
        ("sd-host-stop", "sd", {**sd, "steps": 20, "stop_early": "0.02:4"}),
        ("sd-loop-stop", "sd-loop-stop", {**sd, "steps": 20, "stop_early": "0.02:4", "loop": "loop"}),
        ("sd-host-img2img", "sd", {**sd, **img}), ("sd-loop-img2img", "sd-loop", {**sd, **img, "loop": "loop"}),
        ("sd-host-inpaint", "sd", {**sd, **inp}), ("sd-loop-inpaint", "sd-loop", {**sd, **inp, "loop": "loop"}),
        ("sd-host-control", "sd", {**sd, **ctl}),
        ("sd-loop-control", "sd-loop-control", {**sd, **ctl, "loop": "loop"}),
        ("sd-host-lora", "sd-points", {**sd, "loras": (str(LORA), 0.8)}),
        ("sd-loop-lora", "sd-points-loop", {**sd, "loras": (str(LORA), 0.8), "loop": "loop"}),
        ("sd-host-correct", "sd-int8-correct", sd),
        ("sd-host-tiny-decoder", "sd", {**sd, "decoder": "tiny"}),
        ("mmdit-host", "mmdit", mm), ("mmdit-loop", "mmdit-loop", {**mm, "loop": "loop"}),
        ("mmdit-host-fb", "mmdit", {**mm, "cache": "first_block:0.2"}),
        ("mmdit-loop-fb", "mmdit-loop-fb", {**mm, "cache": "first_block:0.2", "loop": "loop"}),
        ("mmdit-host-taylor", "mmdit", {**mm, "cache": "taylorseer:3:1"}),
        ("mmdit-loop-taylor", "mmdit-loop-taylor", {**mm, "cache": "taylorseer:3:1", "loop": "loop"}),
        ("mmdit-host-residual", "mmdit", {**mm, "cache": "residual:5:1"}),
        ("mmdit-loop-residual", "mmdit-loop-residual", {**mm, "cache": "residual:5:1", "loop": "loop"}),
        ("mmdit-host-stop", "mmdit", {**mm, "steps": 20, "stop_early": "0.02:4"}),
        ("mmdit-loop-stop", "mmdit-loop-stop", {**mm, "steps": 20, "stop_early": "0.02:4", "loop": "loop"}),
        ("mmdit-host-schedule", "mmdit-int8-schedule", mm),
    ]


def materialize(opts: dict) -> dict:
    from onnxdiffusion.techniques.controlnet import ControlNetSpec

    out = dict(opts)
    if "image" in out:
        out["image"] = picture(out["image"][1])
    if "mask" in out:
        out["mask"] = mask()
    if "controlnets" in out:
        out["controlnets"] = [ControlNetSpec(out["controlnets"][0], position_condition())]
    if "loras" in out:
        out["loras"] = [out["loras"]]
    return out


def run_case(folder: Path, opts: dict) -> dict:
    import numpy as np

    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(folder, threads=1)
    r = pipe(PROMPT, **materialize(opts))
    lat = np.ascontiguousarray(r.latents, np.float32)
    return {"latents": hashlib.sha256(lat.tobytes()).hexdigest(),
            "image": hashlib.sha256(np.ascontiguousarray(r.images).tobytes()).hexdigest(),
            "steps_run": int(r.settings.get("steps_run", -1))}


def build(work: Path, names: set[str]) -> dict[str, Path]:
    exe = [sys.executable, "-c", "from onnxdiffusion.cli import main; main()"]
    made = {}
    table = folders(work)
    order = ["sd-points", *[n for n in table if n != "sd-points"]]  # points before its Loop copy
    for name in order:
        if name not in names:
            continue
        path, cmd = table[name]
        if cmd and not (path / "manifest.json").exists():
            print(f"building {name}: onnxdiffusion {' '.join(cmd[:1])} ...", flush=True)
            subprocess.run([*exe, *cmd], check=True, stdout=subprocess.DEVNULL)
        made[name] = path
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default="")
    ap.add_argument("--compare", type=Path)
    a = ap.parse_args()
    if a.compare and a.out.exists() and not a.only:
        return compare(json.loads(a.out.read_text()), json.loads(a.compare.read_text()))
    todo = [c for c in cases() if not a.only or c[0] in a.only.split(",")]
    needed = {c[1] for c in todo} | ({"sd-points"} if any(c[1] == "sd-points-loop" for c in todo) else set())
    a.work.mkdir(parents=True, exist_ok=True)
    made = build(a.work, needed)
    results = {}
    for name, folder, opts in todo:
        try:
            results[name] = run_case(made[folder], opts)
        except Exception as e:  # noqa: BLE001 -- a case that fails is recorded, not fatal to the baseline
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, results[name], flush=True)
    a.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if a.compare:
        compare(results, json.loads(a.compare.read_text()))


def compare(new: dict, base: dict) -> None:
    same = [k for k in base if k in new and new[k] == base[k]]
    differ = [k for k in base if k in new and new[k] != base[k]]
    missing = [k for k in base if k not in new]
    print(f"identical {len(same)} of {len(base)}; differ: {differ or 'none'}; missing: {missing or 'none'}")
    for k in differ:
        print(f"  {k}: base {base[k]} new {new[k]}")


if __name__ == "__main__":
    main()
