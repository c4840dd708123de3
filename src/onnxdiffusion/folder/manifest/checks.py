"""The manifest's schema: every field a consumer reads is checked here, on read, with one error naming it.

Model folders are untrusted input. `validate_manifest` checks a parsed `manifest.json` (types, ranges and
paths; optional fields filled with their defaults), or raises one UserError naming the first bad field;
model.py types what it passed (consumers read those records' attributes, never these keys). Unknown keys
are kept, so a newer writer's extra fields (a family's settings, more components) pass through untouched.

Format version 1 (the only one so far):
  format_version  1
  family          str, default "sd"; model-family settings may live in `family_config` (a dict)
  pipeline        dict: prediction_type str, vae_scaling_factor float > 0, vae_scale_factor / size_multiple /
                  latent_channels / default_height / default_width / model_max_length / num_train_timesteps
                  positive ints (heights and widths multiples of size_multiple)
  components      dict name -> {path: relative str, external_data: [relative str],
                  inputs/outputs: [{name: str, dtype: str, shape: [int | axis name]}], ...}
  files           dict relative path -> sha256 hex (required: without it nothing is verified)
  recommended     optional dict: guidance (float >= 0), steps (int >= 1), sampler (str), used as defaults;
                  `tune` adds cache (a step-cache spec str), decoder ("full" | "tiny") and profile (a shipped
                  hardware profile's name), also defaults
  a quantized backbone's entry may hold `correction` (an object) and `precision_schedule`
                  {component: another backbone component, precision: fp32|fp16, ranges: [[lo, hi], ...]}
  entries may also hold what other writers record (checked when present): lora / validation /
                  quantized_from objects, kind / family / precision / requires_provider / form strings,
                  bytes / steps integers, controlnets [name], fallback {path, external_data, ...}
  controlnets     optional dict name -> {path, external_data, ...} (export --controlnet, add-controlnet)
"""

from __future__ import annotations

import math
import re
from pathlib import Path, PurePosixPath
from typing import Any

from ...errors import UserError

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
DEFAULT_FAMILY = "sd"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# generous but finite: a manifest asking for more than this is not a model this tool made
_MAX_SIDE = 16384
_MAX_INT = 1 << 20


class ManifestError(UserError):
    """A manifest field is missing, of the wrong type, out of range or points outside the folder."""


def _fail(where: str, field: str, problem: str) -> None:
    raise ManifestError(f"{where}: manifest field '{field}' {problem}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# the kinds of optional field (checked when present and not null): (test, the problem named when it fails)
OBJECT = (lambda v: isinstance(v, dict), "must be an object")
STRING = (lambda v: isinstance(v, str), "must be a string, got {v!r}")
COUNT = (lambda v: _is_int(v) and v >= 0, "must be a non-negative integer, got {v!r}")
NUMBER = (_is_num, "must be a finite number, got {v!r}")
NAMES = (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "must be a list of names")


def _check_optional(record: dict, fields: dict, where: str, prefix: str = "") -> None:
    """Each field of the table (name -> kind) that `record` holds, not null, is of its kind; in table order."""
    for key, (ok, problem) in fields.items():
        v = record.get(key)
        if v is not None and not ok(v):
            _fail(where, f"{prefix}.{key}" if prefix else key, problem.format(v=v))


def check_relative(rel: Any, where: str, field: str) -> str:
    """A path from an untrusted file: a non-empty relative posix path with no `..`, no drive, no NUL."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        _fail(where, field, f"must be a relative path inside the model folder, got {rel!r}")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or re.match(r"^[A-Za-z]:", rel):
        _fail(where, field, f"must stay inside the model folder, got {rel!r}")
    return rel


def confined(folder: Path | str, rel: Any, what: str = "path") -> Path:
    """`folder / rel` resolved (symlinks included), refused unless it stays inside `folder`."""
    root = Path(folder).resolve()
    if isinstance(rel, str) and rel and "\x00" not in rel and "\\" not in rel:
        p = PurePosixPath(rel)
        if not p.is_absolute() and ".." not in p.parts:
            target = (root / rel).resolve()
            if target == root or root in target.parents:
                return target
    raise UserError(f"{folder}: {what} {rel!r} points outside the model folder")


def _check_pipeline(p: Any, where: str) -> None:
    if not isinstance(p, dict):
        _fail(where, "pipeline", f"must be an object, got {type(p).__name__}")
    if not isinstance(p.get("prediction_type", "epsilon"), str):
        _fail(where, "pipeline.prediction_type", "must be a string")
    s = p.get("vae_scaling_factor")
    if not _is_num(s) or not 1e-6 <= s <= 1e6:
        _fail(where, "pipeline.vae_scaling_factor", f"must be a finite number in [1e-6, 1e6], got {s!r}")
    _check_optional(p, {"vae_shift_factor": NUMBER}, where, "pipeline")
    for key, hi in (("vae_scale_factor", 64), ("size_multiple", 1024), ("latent_channels", 4096),
                    ("default_height", _MAX_SIDE), ("default_width", _MAX_SIDE), ("model_max_length", 1 << 16),
                    ("num_train_timesteps", 100_000)):
        v = p.get(key)
        if not _is_int(v) or not 1 <= v <= hi:
            _fail(where, f"pipeline.{key}", f"must be an integer in [1, {hi}], got {v!r}")
    _check_family_fields(p, where)
    m = p["size_multiple"]
    if m % p["vae_scale_factor"]:
        _fail(where, "pipeline.size_multiple", f"must be a multiple of vae_scale_factor {p['vae_scale_factor']}, got {m}")
    for key in ("default_height", "default_width"):
        if p[key] % m:
            _fail(where, f"pipeline.{key}", f"must be a multiple of size_multiple {m}, got {p[key]}")


# settings only some families record (SDXL/SD3/Flux/Qwen-Image): checked when present
_OPTIONAL_INTS = {"context_dim": (1, 1 << 16), "pooled_dim": (1, 1 << 16), "patch_size": (1, 64),
                  "out_channels": (1, 4096), "context_length": (1, 1 << 16), "max_prompt_tokens": (1, 1 << 16),
                  "prompt_template_drop": (0, 1 << 16), "max_latent": (1, _MAX_SIDE)}
_OPTIONAL_INT_LISTS = ("encoder_widths", "encoder_projections")
_OPTIONAL_NUM_LISTS = ("vae_latents_mean", "vae_latents_std")


def _check_family_fields(p: dict, where: str) -> None:
    for key, (lo, hi) in _OPTIONAL_INTS.items():
        v = p.get(key)
        if key in p and not (key == "max_latent" and v is None) and (not _is_int(v) or not lo <= v <= hi):
            _fail(where, f"pipeline.{key}", f"must be an integer in [{lo}, {hi}], got {v!r}")
    for key in _OPTIONAL_INT_LISTS:
        v = p.get(key)
        if key in p and (not isinstance(v, list) or not all(_is_int(x) and 1 <= x <= 1 << 16 for x in v)):
            _fail(where, f"pipeline.{key}", f"must be a list of positive integers, got {v!r}")
    for key in _OPTIONAL_NUM_LISTS:
        v = p.get(key)
        if key in p and (not isinstance(v, list) or len(v) != p.get("latent_channels")
                         or not all(_is_num(x) for x in v) or (key.endswith("std") and min(v, default=1) <= 0)):
            _fail(where, f"pipeline.{key}", f"must be one finite number per latent channel, got {v!r}")


def _check_components(comps: Any, where: str, required: tuple[str, ...]) -> None:
    if not isinstance(comps, dict):
        _fail(where, "components", f"must be an object, got {type(comps).__name__}")
    for name in required:
        if name not in comps:
            _fail(where, f"components.{name}", "is missing")
    for name, entry in comps.items():
        if not isinstance(entry, dict):
            _fail(where, f"components.{name}", f"must be an object, got {type(entry).__name__}")
        entry.setdefault("external_data", [])
        _check_files_of(entry, where, f"components.{name}")
        _check_optional(entry, {"session_options": OBJECT, "correction": OBJECT}, where, f"components.{name}")
        for key in ("inputs", "outputs"):
            _check_tensor_specs(entry.get(key, []), where, f"components.{name}.{key}")
        if entry.get("precision_schedule") is not None:
            check_precision_schedule(entry["precision_schedule"], where, name, comps)
        _check_entry_records(entry, where, f"components.{name}")


# what other writers record on an entry (quantize, fixup-trt, lora points, compile-loop), typed on read
# (model.Component): checked when present, so a hostile value fails here in one line, not in a consumer
_ENTRY_FIELDS = {
    "lora": OBJECT, "validation": OBJECT, "quantized_from": OBJECT,
    "kind": STRING, "family": STRING, "precision": STRING, "requires_provider": STRING, "form": STRING,
    "bytes": COUNT, "steps": COUNT, "scaling_factor": NUMBER, "shift_factor": NUMBER, "controlnets": NAMES,
    "fallback": OBJECT, "weights": OBJECT,
}


def _check_entry_records(entry: dict, where: str, field: str) -> None:
    _check_optional(entry, _ENTRY_FIELDS, where, field)
    fallback = entry.get("fallback")
    if fallback is not None:
        _check_files_of(fallback, where, f"{field}.fallback")
        _check_entry_records(fallback, where, f"{field}.fallback")


def _check_files_of(record: dict, where: str, field: str) -> None:
    """A record's `path` and `external_data` (components, their fallbacks, ControlNets): relative, inside."""
    check_relative(record.get("path"), where, f"{field}.path")
    ext = record.get("external_data", [])
    if not isinstance(ext, list):
        _fail(where, f"{field}.external_data", "must be a list of relative paths")
    for i, rel in enumerate(ext):
        check_relative(rel, where, f"{field}.external_data[{i}]")


def _check_controlnets(nets: Any, where: str) -> None:
    """export --controlnet / add-controlnet records: name -> an entry like a component's."""
    if nets is None:
        return
    if not isinstance(nets, dict):
        _fail(where, "controlnets", "must be an object")
    for name, rec in nets.items():
        if not isinstance(rec, dict):
            _fail(where, f"controlnets.{name}", "must be an object")
        _check_files_of(rec, where, f"controlnets.{name}")


_HIGH_PRECISIONS = ("fp32", "fp16")


def check_precision_schedule(s: Any, where: str, name: str, comps: dict) -> None:
    """A quantized backbone's per-step precision schedule (quantize/schedule.py): the component it
    switches to and the timestep ranges where it does."""
    field = f"components.{name}.precision_schedule"
    if not isinstance(s, dict):
        _fail(where, field, "must be an object")
    other = s.get("component")
    if not isinstance(other, str) or other == name or not isinstance(comps.get(other), dict) \
            or comps[other].get("kind") == "sampling_graph":
        _fail(where, f"{field}.component", f"must name another backbone component of the folder, got {other!r}")
    if s.get("precision") not in _HIGH_PRECISIONS:
        _fail(where, f"{field}.precision", f"must be one of {', '.join(_HIGH_PRECISIONS)}, got {s.get('precision')!r}")
    ranges = s.get("ranges")
    if not isinstance(ranges, list) or not 1 <= len(ranges) <= 1000:
        _fail(where, f"{field}.ranges", "must be a list of 1 to 1000 [lo, hi] timestep ranges")
    prev = -math.inf
    for i, r in enumerate(ranges):
        if not isinstance(r, list) or len(r) != 2 or not all(_is_num(v) for v in r) or r[0] > r[1] or r[0] <= prev:
            _fail(where, f"{field}.ranges[{i}]", f"must be finite [lo, hi] with lo <= hi, ascending and disjoint, got {r!r}")
        prev = r[1]
    _check_optional(s, {"selected": OBJECT}, where, field)


def _check_tensor_specs(specs: Any, where: str, field: str) -> None:
    """I/O records: {name: str, dtype: str, shape: [int | axis name]} (read by the family and quantize)."""
    if not isinstance(specs, list):
        _fail(where, field, "must be a list of {name, dtype, shape} objects")
    for i, t in enumerate(specs):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("dtype"), str):
            _fail(where, f"{field}[{i}]", "must be an object with a string name and dtype")
        shape = t.get("shape")
        if not isinstance(shape, list) or not all((_is_int(d) and d >= 0) or isinstance(d, str) for d in shape):
            _fail(where, f"{field}[{i}].shape", "must be a list of sizes and axis names")


def _check_files(files: Any, where: str) -> None:
    if files is None:
        _fail(where, "files", "is missing (the hash list; a folder without it cannot be verified)")
    if not isinstance(files, dict) or not files:
        _fail(where, "files", "must be a non-empty object mapping relative paths to sha256 digests")
    for rel, digest in files.items():
        check_relative(rel, where, f"files[{rel!r}]")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            _fail(where, f"files[{rel!r}]", f"must be a sha256 hex digest, got {digest!r}")


def check_recommended(r: Any, where: str) -> dict:
    if r is None:
        return {}
    if not isinstance(r, dict):
        _fail(where, "recommended", f"must be an object, got {type(r).__name__}")
    g = r.get("guidance")
    if g is not None and (not _is_num(g) or not 0 <= g <= 100):
        _fail(where, "recommended.guidance", f"must be a number in [0, 100], got {g!r}")
    s = r.get("steps")
    if s is not None and (not _is_int(s) or not 1 <= s <= 1000):
        _fail(where, "recommended.steps", f"must be an integer in [1, 1000], got {s!r}")
    _check_optional(r, {"sampler": STRING, "spacing": STRING, "cache": STRING, "profile": STRING}, where, "recommended")
    if r.get("decoder") is not None and r["decoder"] not in ("full", "tiny"):
        _fail(where, "recommended.decoder", f"must be 'full' or 'tiny', got {r['decoder']!r}")
    if r.get("profile") is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", r["profile"]):
        # a name only: a path would let an untrusted folder point the loader at a file outside it
        _fail(where, "recommended.profile", f"must be a shipped profile's name, got {r['profile']!r}")
    return r


# records other writers keep at the top (a tool's description may be a plain string)
_RECORD = (lambda v: isinstance(v, (dict, str)), "must be an object")
_TOP_FIELDS = {"quantization": _RECORD, "attention": _RECORD, "source": _RECORD}


def validate_manifest(manifest: Any, where: str, required: tuple[str, ...] = ()) -> dict:
    """Check a parsed manifest (see the module docstring); returns it with defaults filled in."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"{where}: manifest must be a JSON object, got {type(manifest).__name__}")
    v = manifest.get("format_version")
    if not _is_int(v) or v not in SUPPORTED_VERSIONS:
        _fail(where, "format_version", f"must be one of {list(SUPPORTED_VERSIONS)}, got {v!r}")
    family = manifest.setdefault("family", DEFAULT_FAMILY)
    if not isinstance(family, str) or not family:
        _fail(where, "family", f"must be a non-empty string, got {family!r}")
    _check_optional(manifest, {"family_config": OBJECT}, where)
    _check_pipeline(manifest.get("pipeline"), where)
    _check_components(manifest.get("components"), where, required)
    _check_files(manifest.get("files"), where)
    manifest["recommended"] = check_recommended(manifest.get("recommended"), where)
    _check_optional(manifest, _TOP_FIELDS, where)
    _check_controlnets(manifest.get("controlnets"), where)
    _check_optional(manifest, {"export_seconds": (_is_num, "must be a number, got {v!r}")}, where)
    return manifest


# --- scheduler/scheduler_config.json -------------------------------------------------------------------
def check_scheduler_config(cfg: Any, where: str) -> dict:
    """The fields NoiseSchedule reads, typed and in range (it trusts them)."""
    if not isinstance(cfg, dict):
        raise UserError(f"{where}: scheduler config must be a JSON object, got {type(cfg).__name__}")

    def bad(field: str, problem: str):
        raise UserError(f"{where}: scheduler field '{field}' {problem}")

    n = cfg.get("num_train_timesteps")
    if n is not None and (not _is_int(n) or not 2 <= n <= 100_000):
        bad("num_train_timesteps", f"must be an integer in [2, 100000], got {n!r}")
    for key in ("beta_start", "beta_end"):
        v = cfg.get(key)
        if v is not None and (not _is_num(v) or not 0 < v < 1):
            bad(key, f"must be a number in (0, 1), got {v!r}")
    off = cfg.get("steps_offset")
    if off is not None and (not _is_int(off) or not 0 <= off < (n or 1000)):
        bad("steps_offset", f"must be an integer in [0, num_train_timesteps), got {off!r}")
    for key in ("beta_schedule", "prediction_type", "timestep_spacing"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            bad(key, f"must be a string, got {cfg[key]!r}")
    for key in ("set_alpha_to_one", "clip_sample"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            bad(key, f"must be true or false, got {cfg[key]!r}")
    return cfg
