"""The manifest as typed, frozen records, built from a manifest `checks.validate_manifest` has passed.

Every record keeps the JSON object it was read from (`raw`, a private deep copy): unknown keys (a newer
writer's fields) and the key order survive a read-modify-write, so `to_dict()` gives back exactly what was
read, defaults filled, and `manifest_bytes` writes the same bytes the writers always wrote.

The records are also read-only mappings over `raw` (nested records for nested objects) only so that the
modules in tests/house/test_house_rules.py's shrinking allow-list keep working until they read attributes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .checks import DEFAULT_FAMILY, validate_manifest


class _Record(Mapping):
    """A read-only mapping view of `raw` for the not-yet-converted readers (see the module docstring)."""

    raw: Mapping

    def _children(self) -> Mapping:
        return {}

    def __getitem__(self, key: str) -> Any:
        children = self._children()
        return children[key] if key in children else self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def to_dict(self) -> dict:
        """A fresh copy of the JSON object, for a writer to edit (the record itself never changes)."""
        return copy.deepcopy(dict(self.raw))

    def _rebuild_args(self) -> tuple:
        return (dict(self.raw),)

    def __reduce__(self):
        # rebuilt from its JSON object: the read-only views (MappingProxyType) neither pickle nor deep-copy
        return type(self)._rebuild, self._rebuild_args()

    @classmethod
    def _rebuild(cls, *args):
        return cls.from_dict(*args)


def _tuple(v: Any) -> tuple | None:
    return None if v is None else tuple(v)


def _view(v: Any) -> Mapping | None:
    return None if v is None else MappingProxyType(v)


@dataclass(frozen=True, eq=False)
class TensorSpec(_Record):
    """One input or output of a component's graph: `shape` holds sizes and axis names."""

    name: str
    dtype: str
    shape: tuple
    raw: Mapping = field(repr=False, default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> TensorSpec:
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d)


@dataclass(frozen=True, eq=False)
class PrecisionScheduleRecord(_Record):
    """A quantized backbone's switch to `component` (fp32/fp16) over timestep `ranges` (quantize/schedule.py)."""

    component: str
    precision: str
    ranges: tuple[tuple[float, float], ...]
    selected: Mapping | None
    raw: Mapping = field(repr=False, default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> PrecisionScheduleRecord:
        return cls(d["component"], d["precision"], tuple(tuple(r) for r in d["ranges"]), _view(d.get("selected")), d)


@dataclass(frozen=True, eq=False)
class Component(_Record):
    """One entry of `components`: an ONNX graph, its weight files (all relative, confined when opened), its
    I/O records and what the writers that made or rewrote it recorded (quantize: correction, schedule)."""

    name: str
    path: str
    external_data: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    kind: str | None
    family: str | None
    precision: str | None
    bytes: int | None
    session_options: Mapping | None
    correction: Mapping | None
    precision_schedule: PrecisionScheduleRecord | None
    lora: Mapping | None
    requires_provider: str | None  # fixup-trt: a backbone only that provider runs ...
    fallback: Component | None  # ... and the one to run elsewhere
    int8_kernels: Any
    validation: Mapping | None  # export: the comparison with PyTorch
    quantized_from: Mapping | None  # quantize: the sha256 of the file it converted
    scaling_factor: float | None  # a tiny autoencoder's own latent scaling and shift (export --tiny-vae)
    shift_factor: float | None
    # a sampling graph's (kind "sampling_graph", compile-loop) record: what is compiled in
    form: str | None
    steps: int | None  # the unrolled form's fixed step count
    whole: bool
    cache: Any  # the step-caching method
    controlnets: tuple[str, ...]  # the ControlNets built in
    stop_early: bool
    tuned_for: Any  # the CPU target an ORT_ENABLE_ALL graph was optimized for
    raw: Mapping = field(repr=False, default_factory=dict)

    @classmethod
    def from_dict(cls, name: str, d: dict) -> Component:
        sched, fallback = d.get("precision_schedule"), d.get("fallback")
        return cls(
            name, d["path"], tuple(d.get("external_data", [])),
            inputs=tuple(TensorSpec.from_dict(t) for t in d.get("inputs", [])),
            outputs=tuple(TensorSpec.from_dict(t) for t in d.get("outputs", [])),
            kind=d.get("kind"), family=d.get("family"), precision=d.get("precision"), bytes=d.get("bytes"),
            session_options=_view(d.get("session_options")), correction=_view(d.get("correction")),
            precision_schedule=None if sched is None else PrecisionScheduleRecord.from_dict(sched),
            lora=_view(d.get("lora")), requires_provider=d.get("requires_provider"),
            fallback=Component.from_dict(name, fallback) if isinstance(fallback, dict) else None,
            int8_kernels=d.get("int8_kernels"), validation=_view(d.get("validation")),
            quantized_from=_view(d.get("quantized_from")), scaling_factor=d.get("scaling_factor"),
            shift_factor=d.get("shift_factor"),
            form=d.get("form"), steps=d.get("steps"), whole=bool(d.get("whole")), cache=d.get("cache"),
            controlnets=tuple(d.get("controlnets") or ()), stop_early=bool(d.get("stop_early")),
            tuned_for=d.get("tuned_for"), raw=d)

    def _rebuild_args(self) -> tuple:
        return (self.name, dict(self.raw))

    @property
    def files(self) -> list[str]:
        """The graph and its weight files, manifest-relative."""
        return [self.path, *self.external_data]

    @property
    def disabled_optimizers(self) -> list | None:
        """ORT optimizers a (quantized) component asks to leave off; None: none."""
        return list((self.session_options or {}).get("disabled_optimizers") or []) or None

    def with_session_options(self, options: dict) -> Component:
        """This entry with other session options (a fallback or a schedule's second backbone run as the first)."""
        return Component.from_dict(self.name, {**self.raw, "session_options": options})

    @property
    def lora_targets(self) -> Mapping | None:
        """The LoRA insertion points' targets (adapters/), or None for a folder without points."""
        return (self.lora or {}).get("targets") or None

    @property
    def is_sampling_graph(self) -> bool:
        return self.kind == "sampling_graph"

    def setting(self, key: str, default: Any = None) -> Any:
        """A writer-specific field (a sampling graph's form, steps, cache ...), for the modules that own it."""
        return self.raw.get(key, default)

    def _children(self) -> Mapping:
        c: dict = {}
        if self.precision_schedule is not None:
            c["precision_schedule"] = self.precision_schedule
        return c


@dataclass(frozen=True, eq=False)
class PipelineInfo(_Record):
    """`manifest.pipeline`: the settings every family records, then those only some families record."""

    vae_scaling_factor: float
    vae_scale_factor: int
    size_multiple: int
    latent_channels: int
    default_height: int
    default_width: int
    model_max_length: int
    num_train_timesteps: int
    prediction_type: str | None = None  # as recorded (flow families record none)
    vae_shift_factor: float | None = None
    context_dim: int | None = None
    pooled_dim: int | None = None
    patch_size: int | None = None
    out_channels: int | None = None
    context_length: int | None = None
    max_prompt_tokens: int | None = None
    prompt_template_drop: int | None = None
    max_latent: int | None = None
    time_cond_proj_dim: int | None = None
    encoder_widths: tuple[int, ...] | None = None
    encoder_projections: tuple[int, ...] | None = None
    vae_latents_mean: tuple[float, ...] | None = None
    vae_latents_std: tuple[float, ...] | None = None
    raw: Mapping = field(repr=False, default_factory=dict)

    _REQUIRED = ("vae_scaling_factor", "vae_scale_factor", "size_multiple", "latent_channels", "default_height",
                 "default_width", "model_max_length", "num_train_timesteps")
    _OPTIONAL = ("vae_shift_factor", "context_dim", "pooled_dim", "patch_size", "out_channels", "context_length",
                 "max_prompt_tokens", "prompt_template_drop", "max_latent", "time_cond_proj_dim")
    _LISTS = ("encoder_widths", "encoder_projections", "vae_latents_mean", "vae_latents_std")

    @classmethod
    def from_dict(cls, d: Mapping) -> PipelineInfo:
        kw = {k: d[k] for k in cls._REQUIRED}
        kw.update({k: d.get(k) for k in cls._OPTIONAL})
        kw.update({k: _tuple(d.get(k)) for k in cls._LISTS})
        return cls(prediction_type=d.get("prediction_type"), raw=d, **kw)

    def setting(self, key: str, default: Any = None) -> Any:
        """A family-specific setting (families/ write and read their own)."""
        return self.raw.get(key, default)

    def with_vae_scaling(self, scaling: float, shift: float) -> PipelineInfo:
        """These settings with another latent scaling and shift (a tiny decoder's, decoded as diffusers does)."""
        return PipelineInfo.from_dict({**self.to_dict(), "vae_scaling_factor": scaling, "vae_shift_factor": shift})


@dataclass(frozen=True, eq=False)
class Recommended(_Record):
    """Defaults the folder recommends (used where the caller gives none)."""

    guidance: float | None = None
    steps: int | None = None
    sampler: str | None = None
    spacing: str | None = None
    # what `tune` chose on top (none in an exported or quantized folder): a step-cache spec, the decoder,
    # a shipped hardware profile's name
    cache: str | None = None
    decoder: str | None = None
    profile: str | None = None
    raw: Mapping = field(repr=False, default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping) -> Recommended:
        return cls(d.get("guidance"), d.get("steps"), d.get("sampler"), d.get("spacing"), d.get("cache"),
                   d.get("decoder"), d.get("profile"), d)


@dataclass(frozen=True, eq=False)
class Manifest(_Record):
    """A model folder's manifest.json, validated (checks.py) and typed."""

    format_version: int
    family: str
    family_config: Mapping | None
    pipeline: PipelineInfo
    components: Mapping[str, Component]
    files: Mapping[str, str]
    recommended: Recommended
    quantization: Mapping | str | None = None
    attention: Mapping | str | None = None
    source: Mapping | str | None = None
    controlnets: Mapping | None = None
    export_seconds: float | None = None
    raw: Mapping = field(repr=False, default_factory=dict)

    @classmethod
    def from_validated(cls, d: dict) -> Manifest:
        """Type a manifest validate_manifest has checked (and filled); keeps a private copy of it."""
        d = copy.deepcopy(d)
        comps = MappingProxyType({n: Component.from_dict(n, e) for n, e in d["components"].items()})
        q, a, s = d.get("quantization"), d.get("attention"), d.get("source")
        return cls(d["format_version"], d.get("family", DEFAULT_FAMILY), _view(d.get("family_config")),
                   PipelineInfo.from_dict(d["pipeline"]), comps, MappingProxyType(d["files"]),
                   Recommended.from_dict(d["recommended"]),
                   _view(q) if isinstance(q, dict) else q, _view(a) if isinstance(a, dict) else a,
                   _view(s) if isinstance(s, dict) else s, _view(d.get("controlnets")), d.get("export_seconds"), d)

    @classmethod
    def _rebuild(cls, d: dict) -> Manifest:
        return cls.from_validated(d)

    @classmethod
    def parse(cls, obj: Any, where: str, required: tuple[str, ...] = ()) -> Manifest:
        """Validate a parsed manifest.json (one ManifestError naming the first bad field) and type it."""
        return cls.from_validated(validate_manifest(obj, where, required))

    def component(self, name: str) -> Component | None:
        return self.components.get(name)

    def controlnet(self, name: str) -> Component | None:
        """ControlNet `name`'s record as a component entry (its graph, weights, residuals ...), or None."""
        rec = (self.controlnets or {}).get(name)
        return None if rec is None else Component.from_dict(name, dict(rec))

    @property
    def quantization_recipe(self) -> Mapping:
        """The recipe quantize recorded ({} for a float folder or an old string record)."""
        q = self.quantization if isinstance(self.quantization, Mapping) else {}
        return (q.get("config") or {}).get("recipe") or {}

    @property
    def source_class(self) -> str | None:
        """The diffusers pipeline class export read (model_index.json's `_class_name`)."""
        return self.source.get("class") if isinstance(self.source, Mapping) else None

    @property
    def source_path(self) -> str | None:
        """Where export read the model from (a folder or a checkpoint file), as it recorded it."""
        return self.source.get("path") if isinstance(self.source, Mapping) else None

    def setting(self, key: str, default: Any = None) -> Any:
        """A top-level field this schema does not type (a writer's own record: export_seconds ...)."""
        return self.raw.get(key, default)

    def _children(self) -> Mapping:
        return {"pipeline": self.pipeline, "components": self.components, "recommended": self.recommended}


def as_dict(manifest: Manifest | Mapping) -> dict:
    """A writer's own copy of a manifest, typed or not."""
    if isinstance(manifest, _Record):
        return manifest.to_dict()
    return json.loads(json.dumps(manifest))


def manifest_bytes(manifest: Manifest | Mapping) -> bytes:
    """The one encoding of manifest.json (indent 2, key order kept, newline-terminated): quantize's outputs
    are compared by hash, so this must not change."""
    obj = manifest.to_dict() if isinstance(manifest, _Record) else manifest
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def typed(manifest: Manifest | Mapping, where: str = "manifest") -> Manifest:
    """`manifest` as a Manifest: a plain dict (a test's, a caller's own) is validated on a copy first."""
    if isinstance(manifest, Manifest):
        return manifest
    return Manifest.parse(json.loads(json.dumps(manifest)), where)
