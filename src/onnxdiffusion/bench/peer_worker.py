"""Bench worker for a peer pipeline, run by the peer's own venv Python (never imports onnxdiffusion).

  optimum   optimum.onnxruntime.ORTStableDiffusionPipeline on an `onnxdiffusion export` folder
  openvino  optimum.intel.OVStableDiffusionPipeline on the diffusers source folder, converted once to
            OpenVINO IR under --cache (mode fp32, or int8-hybrid: optimum-intel's hybrid quantization,
            8-bit weights everywhere + 8-bit activations in the UNet, calibrated on --calib-prompts)
  sdcpp     stable-diffusion.cpp (GGML) through stable-diffusion-cpp-python: the diffusers source folder
            converted once by sd.cpp's own converter to one GGUF checkpoint under --cache, weights in
            mode f32, q8_0 or q4_0 (GGML's block formats), then loaded and run with --threads threads; Z-Image and
            FLUX.2 [klein] from split files (arch/sdcpp_files.py: the original names), q8_0 or q4_K

Protocol: one JSON object per line. With --convert-only the worker converts the model into --cache (the
one-off OpenVINO IR / GGUF conversion, in a process of its own so that its memory peak is reported apart
from the measured one), writes {"event": "converted", "convert_s", "peak_rss_bytes"} ({"cached": true} when
there was nothing to convert) and exits. Otherwise it loads the pipeline and writes
{"event": "loaded", "load_s": ..., ...} (or {"event": "error", "message": ...}); then it answers
{"cmd": "generate", ...} with {"event": "done", "timings": {...}}, {"cmd": "rss"} with its VmRSS/VmHWM,
{"cmd": "reset_peak"} by resetting VmHWM (the bench's per-phase peaks), and exits on {"cmd": "quit"} or end
of input. Every row runs --sampler (a diffusers scheduler class here, an sd.cpp sample method there) and
reports how many backbone calls it made. Timings are measured here, inside the peer's process.
Everything the libraries print goes to stderr; stdout carries only the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

_PROTO = None


def send(obj: dict) -> None:
    _PROTO.write(json.dumps(obj) + "\n")
    _PROTO.flush()


def status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def reset_peak() -> bool:
    """As onnxdiffusion.bench.rss.reset_peak_rss (this worker never imports onnxdiffusion)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def ddim_from_config(cls, config):
    """As onnxdiffusion.bench.runners.ddim_from_config: never clip x0 unless the config asks for it."""
    extra = {} if "clip_sample" in config else {"clip_sample": False}
    return cls.from_config(config, **extra)


def scheduler_of(name: str, config):
    """The bench's sampler as the diffusers scheduler class `name`, from the folder's scheduler config."""
    import diffusers

    cls = getattr(diffusers, name)
    return ddim_from_config(cls, config) if name == "DDIMScheduler" else cls.from_config(config)


class Sink:
    def __init__(self):
        self.te = 0.0
        self.te_end = 0.0
        self.vae = 0.0
        self.calls = 0  # backbone calls of the current generation


def wrap_forward(obj, sink: Sink, kind: str) -> None:
    """Time a pipeline part by shadowing its `forward` (both optimum's ORT and OV parts call self.forward)."""
    if obj is None or not hasattr(obj, "forward"):
        return
    fn = obj.forward

    def forward(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            now = time.perf_counter()
            if kind == "te":
                sink.te += now - t
                sink.te_end = now
            elif kind == "backbone":
                sink.calls += 1
            else:
                sink.vae += now - t

    obj.forward = forward


def load_optimum(args):
    import onnxruntime as ort
    from optimum.onnxruntime import ORTStableDiffusionPipeline

    so = ort.SessionOptions()
    if args.threads:
        so.intra_op_num_threads = args.threads
        so.inter_op_num_threads = 1
    so.log_severity_level = 3
    t0 = time.perf_counter()
    pipe = ORTStableDiffusionPipeline.from_pretrained(args.folder, export=False, provider="CPUExecutionProvider",
                                                      session_options=so, local_files_only=True)
    load_s = time.perf_counter() - t0
    pipe.scheduler = scheduler_of(args.sampler, pipe.scheduler.config)
    versions = {"optimum": dist_version("optimum"), "optimum-onnx": dist_version("optimum-onnx"),
                "onnxruntime": ort.__version__}
    return pipe, {"load_s": load_s}, versions, (pipe.text_encoder, pipe.unet, pipe.vae_decoder)


# GGML type names as the binding's GGML_TYPE_MAP spells them (lower-case k: its key for Q4_K is "q4_k")
SDCPP_TYPES = {"fp32": "f32", "q8_0": "q8_0", "q4_0": "q4_0", "q4_K": "q4_k"}
SPLIT_PIPELINES = ("ZImagePipeline", "Flux2KleinPipeline")  # sd.cpp reads these from split files


def _split_sources(args) -> dict:
    """Z-Image / FLUX.2 [klein]: the backbone and the LLM rewritten to the names sd.cpp reads (arch/sdcpp_files.py,
    once per source) and the GGUF each converts to under --cache; the VAE as it is."""
    sys.path.insert(0, str(Path(__file__).with_name("arch")))
    import sdcpp_files

    gguf = {part: Path(args.cache) / f"{part}-{args.mode}.gguf" for part in ("diffusion", "llm")}
    if all(g.is_file() for g in gguf.values()):
        # converted: the named copies (16-20 GB at release size) are not read again and may have been deleted;
        # rewriting them here would put minutes of copying into the peer's load time
        return {"src": {"vae": Path(args.folder) / "vae" / "diffusion_pytorch_model.safetensors"}, "gguf": gguf}
    src = sdcpp_files.prepare(Path(args.folder), Path(args.cache).parent / "sdcpp-src")
    return {"src": src, "gguf": gguf}


def _is_split(args) -> bool:
    return json.loads((Path(args.folder) / "model_index.json").read_text()).get("_class_name") in SPLIT_PIPELINES


def convert_sdcpp(args) -> dict | None:
    """The diffusers folder -> GGUF under --cache by sd.cpp's own converter (one checkpoint for SD1.x, the
    backbone and the LLM apart for the split families); None: already there."""
    from stable_diffusion_cpp import stable_diffusion_cpp as low
    from stable_diffusion_cpp.stable_diffusion import GGML_TYPE_MAP

    if _is_split(args):
        t0 = time.perf_counter()
        files = _split_sources(args)
        done = True
        for part, gguf in files["gguf"].items():
            if gguf.is_file():
                continue
            done = False
            gguf.parent.mkdir(parents=True, exist_ok=True)
            tmp = gguf.with_suffix(".part.gguf")
            ok = low.convert(str(files["src"][part]).encode(), b"", str(tmp).encode(),
                             GGML_TYPE_MAP[SDCPP_TYPES[args.mode]], b"", False)
            if not ok or not tmp.is_file():
                raise RuntimeError(f"stable-diffusion.cpp could not convert {files['src'][part].name} to {args.mode}")
            os.replace(tmp, gguf)
        return None if done else {"convert_s": time.perf_counter() - t0}
    gguf = Path(args.cache) / f"sd15-{args.mode}.gguf"
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        tmp = gguf.with_suffix(".part.gguf")
        ok = low.convert(str(Path(args.folder)).encode(), b"", str(tmp).encode(), GGML_TYPE_MAP[SDCPP_TYPES[args.mode]],
                         b"", True)
        if not ok or not tmp.is_file():
            raise RuntimeError(f"stable-diffusion.cpp could not convert {args.folder} to {SDCPP_TYPES[args.mode]}")
        os.replace(tmp, gguf)
        return {"convert_s": time.perf_counter() - t0}
    return None


def load_sdcpp(args):
    import stable_diffusion_cpp as sdc

    info = convert_sdcpp(args) or {}
    threads = args.threads or os.cpu_count() or 1
    t0 = time.perf_counter()
    if _is_split(args):
        files = _split_sources(args)
        sd = sdc.StableDiffusion(diffusion_model_path=str(files["gguf"]["diffusion"]),
                                 llm_path=str(files["gguf"]["llm"]), vae_path=str(files["src"]["vae"]),
                                 n_threads=threads, verbose=False)
        if not getattr(getattr(sd, "_model", None), "model", True):  # 0.4.7 lets a NULL context through as an object
            raise RuntimeError("stable-diffusion.cpp could not load the files (below release size its Z-Image layers "
                               "and Qwen3 heads are constants: it runs these families at release size only)")
        info["ir_bytes"] = sum(g.stat().st_size for g in files["gguf"].values())
    else:
        gguf = Path(args.cache) / f"sd15-{args.mode}.gguf"
        sd = sdc.StableDiffusion(model_path=str(gguf), n_threads=threads, verbose=False)
        info["ir_bytes"] = gguf.stat().st_size
    info["load_s"] = time.perf_counter() - t0
    versions = {"stable-diffusion-cpp-python": dist_version("stable-diffusion-cpp-python"),
                "ggml_type": SDCPP_TYPES[args.mode]}
    return sd, info, versions, (None, None, None)


def generate_sdcpp(sd, msg: dict, sampler: str) -> dict:
    """One image; sd.cpp draws its own noise from the seed, so only speed and memory compare.

    Per-step times come from sd.cpp's progress callback; the first step includes text encoding (sd.cpp
    does not report it apart) and the VAE is the time after the last step.
    """
    import numpy as np

    marks: list[float] = []
    t0 = time.perf_counter()
    c0 = time.process_time()
    images = sd.generate_image(prompt=msg["prompts"][0], negative_prompt="", width=int(msg["width"]),
                               height=int(msg["height"]), cfg_scale=float(msg["guidance"]),
                               sample_method=sampler, sample_steps=int(msg["steps"]), seed=0,
                               progress_callback=lambda step, steps, t: marks.append(time.perf_counter()))
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    marks = marks[-int(msg["steps"]):]
    steps = [b - a for a, b in zip([t0, *marks[:-1]], marks)]
    arr = np.stack([np.asarray(im.convert("RGB"), np.uint8) for im in images[:1]])
    np.save(msg["out"], arr)
    # sd.cpp reports sampling steps, not model calls: its samplers here call the model once a step (the
    # conditional and unconditional halves run unbatched, as one batched call does elsewhere)
    return {"total_s": total, "text_encoder_s": 0.0, "vae_s": total - (marks[-1] - t0) if marks else 0.0,
            "step_s": steps, "cpu_s": cpu, "backbone_calls": len(marks), "calls_counted": "sampling steps"}


def generate(pipe, sink: Sink, msg: dict) -> dict:
    import numpy as np
    import torch

    latents = np.load(msg["latents"]).astype(np.float32)
    prompts = msg["prompts"]
    steps: list[float] = []
    state = {"prev": None, "book": 0.0, "last": None}
    n = int(msg["steps"])

    def on_step(p, i, t, kwargs):
        now = time.perf_counter()
        start = state["prev"] if state["prev"] is not None else sink.te_end
        steps.append(now - start)
        if i == n - 1:
            state["last"] = kwargs["latents"].detach().float().cpu().numpy().copy()
        state["prev"] = time.perf_counter()
        state["book"] += state["prev"] - now
        return {}

    sink.te = sink.vae = 0.0
    sink.calls = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    with torch.inference_mode():
        out = pipe(prompts, latents=torch.from_numpy(latents), num_inference_steps=n, guidance_scale=float(msg["guidance"]),
                   output_type="np", height=int(msg["height"]), width=int(msg["width"]),
                   callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"])
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    images = (np.asarray(out.images) * 255).round().astype(np.uint8)
    np.save(msg["out"], images)
    if state["last"] is not None and msg.get("final_latents"):
        np.save(msg["final_latents"], state["last"])
    return {"total_s": total - state["book"], "text_encoder_s": sink.te, "vae_s": sink.vae, "step_s": steps,
            "cpu_s": cpu, "backbone_calls": sink.calls}


def main(argv=None) -> int:
    global _PROTO
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("optimum", "openvino", "sdcpp"), required=True)
    ap.add_argument("--mode", default="fp32", choices=("fp32", "int8-hybrid", "q8_0", "q4_0", "q4_K"))
    ap.add_argument("--folder", required=True)
    ap.add_argument("--cache", default=".")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--calib-prompts", default=None)
    # the peer's own name of the bench's sampler (variants.peer_sampler): a diffusers class, an sd.cpp method
    ap.add_argument("--sampler", default=None)
    ap.add_argument("--convert-only", action="store_true")
    ap.add_argument("--tiny-vae", default=None)  # a diffusers AutoencoderTiny folder: decode with it (openvino)
    args = ap.parse_args(argv)
    if args.sampler is None:
        args.sampler = "ddim_trailing" if args.backend == "sdcpp" else "DDIMScheduler"
    # the protocol gets the real stdout; anything printed by libraries (Python or C) goes to stderr
    _PROTO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.convert_only:
        return convert_only(args)
    try:
        baseline = None
        if args.backend == "sdcpp":  # no torch in that venv
            baseline = status_bytes("VmRSS")
            pipe, info, versions, _ = load_sdcpp(args)
            sink = None
        else:
            import torch

            if args.threads:
                torch.set_num_threads(args.threads)
            baseline = status_bytes("VmRSS")
            if args.backend == "optimum":
                pipe, info, versions, (te, backbone, vae) = load_optimum(args)
            else:
                from peer_openvino import load_openvino  # a sibling file: the worker runs as a script

                pipe, info, versions, (te, backbone, vae) = load_openvino(args, scheduler_of)
            pipe.set_progress_bar_config(disable=True)
            sink = Sink()
            wrap_forward(te, sink, "te")
            wrap_forward(backbone, sink, "backbone")
            wrap_forward(vae, sink, "vae")
            import diffusers

            versions.update(diffusers=diffusers.__version__, torch=torch.__version__)
        send({"event": "loaded", **info, "versions": versions, "baseline_rss_bytes": baseline,
              "after_load_rss_bytes": status_bytes("VmRSS")})
    except Exception as e:  # noqa: BLE001 - reported as one line to the bench
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        import traceback

        traceback.print_exc()
        send({"event": "error", "message": f"{type(e).__name__}: {first}"})
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.get("cmd")
        try:
            if cmd == "quit":
                break
            if cmd == "rss":
                send({"event": "rss", "rss_bytes": status_bytes("VmRSS"), "peak_rss_bytes": status_bytes("VmHWM")})
            elif cmd == "reset_peak":
                send({"event": "reset", "ok": reset_peak(), "rss_bytes": status_bytes("VmRSS")})
            elif cmd == "generate":
                timings = generate_sdcpp(pipe, msg, args.sampler) if args.backend == "sdcpp" else generate(pipe, sink, msg)
                send({"event": "done", "timings": timings})
            else:
                send({"event": "error", "message": f"unknown command {cmd!r}"})
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            send({"event": "error", "message": f"{type(e).__name__}: {first}"})
    return 0


def convert_only(args) -> int:
    """--convert-only: the one-off conversion in this process, its time and peak RSS on the protocol."""
    try:
        if args.backend == "openvino":
            from peer_openvino import convert_openvino  # a sibling file: the worker runs as a script

            convert = convert_openvino
        else:
            convert = convert_sdcpp if args.backend == "sdcpp" else None
        info = convert(args) if convert is not None else None
        send({"event": "converted", **(info or {"cached": True}), "peak_rss_bytes": status_bytes("VmHWM")})
        return 0
    except Exception as e:  # noqa: BLE001 - reported as one line to the bench
        import traceback

        traceback.print_exc()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        send({"event": "error", "message": f"{type(e).__name__}: {first}"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
