"""Hardware profiles: which execution provider (and its options), which backbone precision, how the
loop binds memory, TensorRT shape profiles and engine cache, and what to fall back to.

Shipped profiles are the YAML files beside this module (`onnxdiffusion profiles` lists them); a
profile can also be any YAML file of the same form (`--profile path/to/mine.yaml`):

    version: 1
    name: tensorrt-fp8
    provider: tensorrt            # cpu | cuda | tensorrt | openvino | dml | coreml
    provider_options: {...}       # ONNX Runtime's options for that provider, as strings
    threads: null                 # intra-op threads (null: ONNX Runtime's default)
    precision: fp8                # the backbone the folder must hold: fp32 | fp16 | int8 | fp8 | nvfp4 | any
    recipe: {name: fp8}           # how to make such a folder with `quantize`; the fields besides the name are the
                                  # form of folder it runs: `tune` searches a quantized folder on it only where the
                                  # folder's recipe holds them, and builds that form where it is not the recipe's
                                  # default (tune/builds.py)
    loop: host                    # host (numpy sampler) | loop (the compiled ONNX Loop: latents never leave the device)
    io_binding: device            # host (numpy buffers) | device (OrtValues on the provider's device)
    cuda_graph: false             # capture the backbone call once and replay it (CUDA provider, fixed shapes)
    engine_cache: tensorrt-engines  # TensorRT engine cache folder (relative: under the user cache directory)
    shapes: {batch: [1, 1, 4], buckets: model}  # min/opt/max images; resolution buckets ("model": its default)
    fallback: cpu-fp32            # profile to use, saying so, where this one cannot run
    memory: default               # default | lean | KEY=0|1,... (runtime/memory.py): sessions' memory settings
    float_math: fp32              # fp32 | bf16 | auto (bf16 where the CPU has avx512_bf16 / amx_bf16): the float
                                  # parts' arithmetic on the openvino provider's CPU device (ORT's CPU has no bf16)
    static_shapes: false          # openvino: the backbone compiled per input shape, static (runtime/static_shapes.py)
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import UserError

PROFILE_VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parent
PROVIDERS = ("cpu", "cuda", "tensorrt", "openvino", "dml", "coreml")
PRECISIONS = ("fp32", "fp16", "int8", "fp8", "nvfp4", "any")
FLOAT_MATH = ("fp32", "bf16", "auto")
GPU_PROVIDERS = ("cuda", "tensorrt")


@dataclass(frozen=True)
class Shapes:
    batch: tuple[int, int, int] = (1, 1, 1)  # images (the guided backbone sees twice as many rows)
    buckets: tuple[tuple[int, int], ...] | str = "model"  # (height, width) pairs, or "model"

    @classmethod
    def from_dict(cls, d: dict | None, where: str) -> Shapes:
        d = dict(d or {})
        _no_unknown(d, {"batch", "buckets"}, f"{where}: shapes")
        batch = tuple(d.get("batch", (1, 1, 1)))
        if len(batch) != 3 or not all(isinstance(b, int) and b >= 1 for b in batch) or not batch[0] <= batch[1] <= batch[2]:
            raise UserError(f"{where}: shapes.batch must be [min, opt, max] positive integers in order, got {list(batch)}")
        buckets = d.get("buckets", "model")
        if buckets != "model":
            try:
                buckets = tuple((int(h), int(w)) for h, w in buckets)
            except (TypeError, ValueError):
                raise UserError(f"{where}: shapes.buckets must be 'model' or a list of [height, width]") from None
            if not buckets or any(h <= 0 or w <= 0 for h, w in buckets):
                raise UserError(f"{where}: shapes.buckets must hold positive [height, width] pairs")
        return cls(batch, buckets)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Profile:
    name: str
    provider: str
    precision: str = "fp32"
    description: str = ""
    provider_options: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    recipe: dict[str, Any] | None = None
    loop: str = "host"
    io_binding: str = "host"
    cuda_graph: bool = False
    engine_cache: str | None = None
    shapes: Shapes = field(default_factory=Shapes)
    fallback: str | None = None
    memory: str = "default"
    float_math: str = "fp32"
    static_shapes: bool = False
    source: str = ""  # where it was read from (not a YAML field)

    @classmethod
    def from_dict(cls, d: Any, source: str) -> Profile:
        if not isinstance(d, dict):
            raise UserError(f"{source}: a profile is a YAML mapping")
        d = dict(d)
        version = d.pop("version", None)
        if version != PROFILE_VERSION:
            raise UserError(f"{source}: profile version {version!r} is not supported (this build reads {PROFILE_VERSION})")
        known = {f.name for f in fields(cls)} - {"source"}
        _no_unknown(d, known, source)
        for key in ("name", "provider"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise UserError(f"{source}: '{key}' is required")
        _choice(source, "provider", d["provider"], PROVIDERS)
        _choice(source, "precision", d.get("precision", "fp32"), PRECISIONS)
        _choice(source, "loop", d.get("loop", "host"), ("host", "loop"))
        _choice(source, "io_binding", d.get("io_binding", "host"), ("host", "device"))
        options = d.get("provider_options") or {}
        if not isinstance(options, dict):
            raise UserError(f"{source}: provider_options must be a mapping")
        threads = d.get("threads")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise UserError(f"{source}: threads must be a positive integer or null, got {threads!r}")
        cuda_graph = d.get("cuda_graph", False)
        if not isinstance(cuda_graph, bool):
            raise UserError(f"{source}: cuda_graph must be true or false")
        if cuda_graph and (d["provider"] != "cuda" or d.get("io_binding") != "device"):
            raise UserError(f"{source}: cuda_graph needs provider cuda and io_binding device")
        if d.get("io_binding") == "device" and d["provider"] not in GPU_PROVIDERS:
            raise UserError(f"{source}: io_binding device needs a GPU provider (cuda, tensorrt)")
        float_math = d.get("float_math", "fp32")
        _choice(source, "float_math", float_math, FLOAT_MATH)
        if float_math != "fp32" and d["provider"] != "openvino":
            raise UserError(f"{source}: float_math {float_math} needs provider openvino (ONNX Runtime's own CPU kernels "
                            "have no bf16)")
        static_shapes = d.get("static_shapes", False)
        if not isinstance(static_shapes, bool):
            raise UserError(f"{source}: static_shapes must be true or false")
        if static_shapes and d["provider"] != "openvino":
            raise UserError(f"{source}: static_shapes needs provider openvino (TensorRT takes shapes from `shapes`)")
        from ..runtime.memory import memory_options

        memory = str(d.get("memory", "default"))
        try:
            memory_options(memory)
        except UserError as e:
            raise UserError(f"{source}: {e}") from None
        recipe = d.get("recipe")
        if recipe is not None and not (isinstance(recipe, dict) and isinstance(recipe.get("name"), str)):
            raise UserError(f"{source}: recipe must be a mapping with a name")
        return cls(name=d["name"], provider=d["provider"], precision=d.get("precision", "fp32"),
                   description=str(d.get("description", "")), provider_options={str(k): str(v) for k, v in options.items()},
                   threads=threads, recipe=recipe, loop=d.get("loop", "host"), io_binding=d.get("io_binding", "host"),
                   cuda_graph=cuda_graph, engine_cache=d.get("engine_cache"),
                   shapes=Shapes.from_dict(d.get("shapes"), source), fallback=d.get("fallback"), memory=memory,
                   float_math=float_math, static_shapes=static_shapes, source=source)

    # -- can this machine run it? ------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """None when this machine can run the profile, else one line saying why not."""
        import onnxruntime as ort

        from ..runtime.session import PROVIDERS as ORT_NAMES

        ort_name = ORT_NAMES[self.provider]
        if ort_name not in ort.get_available_providers():
            return f"this onnxruntime ({ort.__version__}) has no {ort_name}"
        if self.provider in GPU_PROVIDERS and not gpu_visible():
            return "no NVIDIA GPU visible (nvidia-smi finds none)"
        return None


def _no_unknown(d: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise UserError(f"{where}: unknown field(s) {', '.join(unknown)}")


def _choice(where: str, key: str, value, choices) -> None:
    if value not in choices:
        raise UserError(f"{where}: {key} must be one of {', '.join(choices)}; got {value!r}")


def gpu_visible() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    import subprocess

    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


# --- loading -----------------------------------------------------------------------------------

def shipped() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(spec: str | Path) -> Profile:
    """A shipped profile by name, or a YAML file by path."""
    import yaml

    spec_s = str(spec)
    path = Path(spec_s)
    if spec_s in shipped():
        path = PROFILES_DIR / f"{spec_s}.yaml"
    elif not (spec_s.endswith((".yaml", ".yml")) or os.sep in spec_s):
        raise UserError(f"unknown profile {spec_s!r}; shipped: {', '.join(shipped())} (or give a .yaml file)")
    if not path.is_file():
        raise UserError(f"profile file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"cannot read profile {path}: {str(e).splitlines()[0]}") from None
    return Profile.from_dict(data, str(path.name if path.parent == PROFILES_DIR else path))


@dataclass(frozen=True)
class Resolved:
    profile: Profile  # the one that runs
    requested: Profile
    note: str | None = None  # set when a fallback was taken

    @property
    def fell_back(self) -> bool:
        return self.profile is not self.requested


def resolve(spec: str | Path | Profile) -> Resolved:
    """The profile to run here: the requested one, or its declared fallback chain, or a one-line error."""
    requested = spec if isinstance(spec, Profile) else load_profile(spec)
    current, seen, reasons = requested, [], []
    while True:
        reason = current.unavailable_reason()
        if reason is None:
            break
        reasons.append(f"{current.name}: {reason}")
        seen.append(current.name)
        if current.fallback is None:
            raise UserError(f"profile {requested.name} cannot run here ({'; '.join(reasons)}) and declares no fallback")
        if current.fallback in seen:
            raise UserError(f"profile {requested.name}: fallback cycle through {', '.join(seen)}")
        current = load_profile(current.fallback)
    if current is requested:
        return Resolved(current, requested)
    note = f"profile {requested.name} cannot run here ({'; '.join(reasons)}); using its declared fallback {current.name}"
    return Resolved(current, requested, note)


def precision_family(precision: str | None) -> str:
    """A manifest's backbone precision (a recipe's label) as a profile precision."""
    p = (precision or "fp32").lower()
    if p.startswith("nvfp4"):
        return "nvfp4"
    if p.startswith(("int8", "mixed")) or p == "int4-weights+int8":
        return "int8"
    if p in ("fp8", "fp16", "fp32"):
        return p
    return p
