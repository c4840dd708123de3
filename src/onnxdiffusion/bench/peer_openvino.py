"""The OpenVINO peer's conversion and loading (optimum-intel), for peer_worker.py in the peer's own venv.

optimum-intel's OVStableDiffusionPipeline, or OVLatentConsistencyModelPipeline for an LCM folder (what FastSD CPU
runs), converted once to IR under --cache; with --tiny-vae the AutoencoderTiny's decoder (TAESD) is converted
beside it and swapped in for the VAE decoder, as FastSD CPU does with its OpenVINO TAESD. Imported by the worker
as a sibling module (it never imports onnxdiffusion).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def fp32_ir_candidates(cache: Path) -> list[Path]:
    """Where an fp32 IR of the same source may already be: this cache, or the openvino-fp32 variant's beside it."""
    return [cache / "ir-fp32", cache.parent / "openvino-fp32" / "ir-fp32"]


def ov_pipeline_class(folder):
    """OVLatentConsistencyModelPipeline for an LCM folder (its scheduler; FastSD CPU's pipeline), else SD's."""
    import optimum.intel as oi

    try:
        sched = json.loads((Path(folder) / "scheduler" / "scheduler_config.json").read_text())["_class_name"]
    except (OSError, ValueError, KeyError):
        sched = None
    return oi.OVLatentConsistencyModelPipeline if sched == "LCMScheduler" else oi.OVStableDiffusionPipeline


TAESD_PART = "vae_decoder_taesd"  # inside the IR folder: the tiny decoder's IR and config


def convert_taesd(args, ir: Path) -> bool:
    """--tiny-vae: the AutoencoderTiny's decoder -> IR beside the pipeline's (FastSD's OpenVINO TAESD); False if
    it was there already. Dynamic spatial shape; input latent_sample, output sample in [-1, 1], as the VAE's."""
    part = ir / TAESD_PART
    if (part / "openvino_model.xml").is_file():
        return False
    import openvino as ov
    import torch
    from diffusers import AutoencoderTiny

    taesd = AutoencoderTiny.from_pretrained(args.tiny_vae, local_files_only=True).eval()

    class Decoder(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, latent_sample):
            return self.m.decode(latent_sample).sample

    shape = (1, int(taesd.config.latent_channels), args.height // 8, args.width // 8)
    with torch.no_grad():
        model = ov.convert_model(Decoder(taesd), example_input=torch.zeros(shape),
                                 input=[ov.PartialShape([-1, shape[1], -1, -1])])
    model.inputs[0].get_tensor().set_names({"latent_sample"})
    model.outputs[0].get_tensor().set_names({"sample"})
    tmp = part.with_name(part.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, tmp / "openvino_model.xml", compress_to_fp16=False)
    (tmp / "config.json").write_text(json.dumps({"_class_name": "AutoencoderTiny",
                                                 "scaling_factor": float(taesd.config.scaling_factor),
                                                 "latent_channels": shape[1]}))
    os.replace(tmp, part)
    return True


def use_taesd(pipe, ir: Path) -> None:
    """The pipeline's VAE decoder swapped for the TAESD IR (what FastSD CPU does with its OpenVINO TAESD)."""
    import openvino as ov
    from optimum.intel.openvino.modeling_diffusion import OVModelVae, OVModelVaeDecoder

    pipe.vae_decoder = OVModelVaeDecoder(ov.Core().read_model(ir / TAESD_PART / "openvino_model.xml"), pipe,
                                         TAESD_PART)
    pipe.vae = OVModelVae(decoder=pipe.vae_decoder, encoder=pipe.vae_encoder)
    pipe.vae_decoder.compile()


def convert_openvino(args) -> dict | None:
    """The diffusers folder -> OpenVINO IR under --cache (None: already there)."""
    ir = Path(args.cache) / f"ir-{args.mode}"
    info: dict = {}
    OVPipeline = ov_pipeline_class(args.folder)
    if (ir / "model_index.json").is_file():
        t0 = time.perf_counter()
        if args.tiny_vae and convert_taesd(args, ir):
            return {"convert_s": time.perf_counter() - t0, "converted": "the TAESD decoder"}
        return None
    kw = {}
    source, export = args.folder, True
    if args.mode == "int8-hybrid":
        from optimum.intel import OVWeightQuantizationConfig

        prompts = json.loads(Path(args.calib_prompts).read_text()) if args.calib_prompts else []
        if len(prompts) < 2:
            raise RuntimeError("int8-hybrid needs calibration prompts")
        kw["quantization_config"] = OVWeightQuantizationConfig(bits=8, quant_method="hybrid", dataset=prompts,
                                                               num_samples=len(prompts))
        # quantize the fp32 IR when the openvino-fp32 variant already converted it: the PyTorch export
        # of a full-size UNet is the memory peak, and it would be the same IR
        fp32 = next((d for d in fp32_ir_candidates(Path(args.cache)) if (d / "model_index.json").is_file()), None)
        if fp32 is not None:
            source, export = str(fp32), False
            info["quantized_from"] = "fp32 IR"
    t0 = time.perf_counter()
    pipe = OVPipeline.from_pretrained(source, export=export, compile=False, local_files_only=True, **kw)
    tmp = ir.with_name(ir.name + ".part")
    pipe.save_pretrained(tmp)
    if ir.exists():
        import shutil

        shutil.rmtree(ir)
    os.replace(tmp, ir)
    del pipe
    if args.tiny_vae:
        convert_taesd(args, ir)
    info["convert_s"] = time.perf_counter() - t0
    return info


def load_openvino(args, scheduler_of):
    """The IR (converted first where absent) compiled for CPU, the bench's sampler set, TAESD swapped in with
    --tiny-vae; scheduler_of: peer_worker's (this module never imports it: the worker runs as a script)."""
    ir = Path(args.cache) / f"ir-{args.mode}"
    info = convert_openvino(args) or {}
    ov_config = {"PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": ""}
    if args.mode == "fp32":  # OpenVINO's CPU default is bf16 math where the CPU has AVX512_BF16/AMX
        ov_config["INFERENCE_PRECISION_HINT"] = "f32"
    if args.threads:
        ov_config["INFERENCE_NUM_THREADS"] = str(args.threads)
    t0 = time.perf_counter()
    pipe = ov_pipeline_class(ir).from_pretrained(ir, compile=False, ov_config=ov_config, local_files_only=True)
    pipe.compile()
    if args.tiny_vae:
        use_taesd(pipe, ir)
        info["decoder"] = "TAESD (OpenVINO IR)"
    info["pipeline"] = type(pipe).__name__
    info["load_s"] = time.perf_counter() - t0
    info["ir_bytes"] = sum(p.stat().st_size for p in ir.rglob("*") if p.is_file())
    info["ir_folder"] = str(ir)
    try:
        info["inference_precision"] = str(pipe.unet.request.get_property("INFERENCE_PRECISION_HINT"))
    except Exception:  # noqa: BLE001 - informational only
        pass
    pipe.scheduler = scheduler_of(args.sampler, pipe.scheduler.config)
    import openvino

    from importlib.metadata import version

    versions = {"openvino": openvino.__version__ if hasattr(openvino, "__version__") else version("openvino"),
                "optimum-intel": version("optimum-intel"), "nncf": version("nncf")}
    return pipe, info, versions, (pipe.text_encoder, pipe.unet, pipe.vae_decoder)
