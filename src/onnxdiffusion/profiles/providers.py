"""A profile as ONNX Runtime's provider list: provider options, CUDA graph, TensorRT engine cache
and the backbone's shape profiles (min/opt/max) from the resolution buckets."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UserError
from ..folder.manifest import Component, PipelineInfo
from ..runtime.session import PROVIDERS as ORT_NAMES
from . import Profile


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onnxdiffusion"


def buckets(profile: Profile, info: PipelineInfo) -> list[tuple[int, int]]:
    if profile.shapes.buckets == "model":
        return [(info.default_height, info.default_width)]
    return list(profile.shapes.buckets)  # type: ignore[arg-type]


def shape_profiles(profile: Profile, component: Component, info: PipelineInfo) -> dict[str, str]:
    """TensorRT's trt_profile_{min,opt,max}_shapes for the backbone: "name:AxBxC,..." strings.

    Rows are twice the images (guidance batches [uncond; cond]); latent sizes come from the
    smallest / first / largest bucket. Symbolic dims are read by their export names.
    """
    f = info.vae_scale_factor
    sizes = buckets(profile, info)
    areas = sorted(sizes, key=lambda hw: hw[0] * hw[1])
    picks = {"min": areas[0], "opt": sizes[0], "max": areas[-1]}
    out = {}
    for (kind, (h, w)), images in zip(picks.items(), profile.shapes.batch):
        dims = {"batch_size": 2 * images, "height_latent": h // f, "width_latent": w // f,
                "sequence_length": info.model_max_length}
        parts = []
        for spec in component.inputs:
            shape = []
            for d in spec.shape:
                if isinstance(d, int):
                    shape.append(d)
                elif dims.get(d) is not None:
                    shape.append(int(dims[d]))
                else:
                    raise UserError(f"profile {profile.name}: cannot derive a TensorRT shape for {spec.name} dim {d!r}")
            parts.append(f"{spec.name}:{'x'.join(str(s) for s in shape)}")
        out[f"trt_profile_{kind}_shapes"] = ",".join(parts)
    return out


def bf16_wanted(profile: Profile, flags: frozenset[str] | None = None) -> bool:
    """Whether the profile's float parts run in bf16 here: `bf16`, or `auto` on a CPU with bf16 instructions."""
    if profile.float_math == "auto":
        from ..cpu.features import cpu_flags

        return bool({"avx512_bf16", "amx_bf16"} & (cpu_flags() if flags is None else flags))
    return profile.float_math == "bf16"


def providers(profile: Profile, component: Component | None = None, info: PipelineInfo | None = None,
              backbone: bool = False, threads: int | None = None) -> list:
    """ONNX Runtime's `providers` argument for one session under this profile (CPU always last). `threads`: the
    run's thread count, which OpenVINO takes as its own option (ORT's intra-op setting does not reach it)."""
    options = dict(profile.provider_options)
    if profile.provider == "cpu":
        return ["CPUExecutionProvider"]
    if profile.provider == "openvino" and threads and "num_of_threads" not in options:
        options["num_of_threads"] = str(threads)
    if profile.provider == "openvino" and bf16_wanted(profile) and "load_config" not in options \
            and options.get("device_type", "CPU").startswith("CPU"):
        options["load_config"] = json.dumps({"CPU": {"INFERENCE_PRECISION_HINT": "bf16"}})
    if profile.provider == "cuda" and backbone and profile.cuda_graph:
        options["enable_cuda_graph"] = "1"
    chain = [(ORT_NAMES[profile.provider], options)]
    if profile.provider == "tensorrt":
        if profile.engine_cache:
            cache = Path(profile.engine_cache).expanduser()
            cache = cache if cache.is_absolute() else cache_root() / cache
            options.setdefault("trt_engine_cache_enable", "1")
            options.setdefault("trt_engine_cache_path", str(cache))
            options.setdefault("trt_timing_cache_path", str(cache))
        if backbone and component is not None and info is not None:
            options.update(shape_profiles(profile, component, info))
        chain.append(("CUDAExecutionProvider", {}))  # nodes TensorRT rejects run on CUDA, then CPU
    return [*chain, "CPUExecutionProvider"]
