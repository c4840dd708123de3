"""The Family protocol: what differs between model kinds, declared once per kind.

A family (one small module per model kind, like optimum's `OnnxConfig` classes) says:
  - which diffusers pipeline classes it covers and which components they hold (with the
    accepted classes, required or optional), and each component's ONNX I/O names, dtypes
    and named dynamic axes, with an export tolerance;
  - how the text encoders' outputs combine into the backbone's conditioning (`combine`,
    written once against `Ops` so the numpy run time and the one-graph `--whole` form share
    it), plus any conditioning that does not come from text (`size_conditioning`);
  - the backbone's conditioning inputs (every backbone input other than sample and timestep,
    fed [uncond; cond] along the batch), latent shape, VAE scaling/shift, the prediction
    parameterization handed to the sampler tables, default and allowed sizes.

This module is run-time code: numpy only, and nothing from export/. The torch side of each
family (wrapping its modules for export, the feeds export validates with) is export/family_export.py.

Every backbone, whatever its family, exports with inputs `sample`, `timestep`, the family's
conditioning inputs, and output `out_sample`; every text encoder takes `input_ids`. So the
sampler loops, quantization and bench never need to know the family to feed a backbone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..errors import UserError
from ..folder.manifest import Manifest
from .arrays import NumpyOps, Ops  # noqa: F401 (Ops: combine's; both re-exported)
from .editing import PictureInput

SAMPLE, TIMESTEP, OUT = "sample", "timestep", "out_sample"
CONTEXT = "encoder_hidden_states"  # the sequence conditioning every family has
PREDICTIONS = ("epsilon", "v_prediction", "flow")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    dims: tuple[str | int, ...]  # str = named dynamic axis


@dataclass(frozen=True)
class ComponentSpec:
    """One ONNX component: its I/O, its export tolerance, and how the torch module is called."""

    name: str  # folder name in the model folder
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    atol: float  # max abs error allowed, relative to max(1, max |reference|)
    kind: str  # torch wrapper kind: text_encoder | unet | transformer | vae_decoder | vae_encoder | ...
    source: str  # diffusers sub-folder holding the weights ("vae" for both VAE halves)
    options: dict = field(default_factory=dict)  # wrapper options (e.g. which encoder outputs)

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)}
            for t in (*self.inputs, *self.outputs)
        }

    def to_manifest(self) -> dict:
        def one(t: TensorSpec) -> dict:
            return {"name": t.name, "dtype": t.dtype, "shape": list(t.dims)}

        return {"inputs": [one(t) for t in self.inputs], "outputs": [one(t) for t in self.outputs]}


@dataclass(frozen=True)
class TextEncoderSlot:
    """One text encoder of a family: component and tokenizer folders, accepted classes, outputs read."""

    name: str  # component folder (text_encoder, text_encoder_2, ...)
    tokenizer: str  # tokenizer folder
    classes: tuple[str, ...]
    tokenizer_classes: tuple[str, ...]
    outputs: tuple[str, ...]  # ONNX outputs the family's combine() reads
    required: bool = True
    max_length: int | None = None  # fixed token length; None: the tokenizer's model_max_length
    # an LLM encoder read through its tokenizer's chat template: apply_chat_template's keyword arguments; export
    # renders the folder's template once into pipeline.chat_templates[name] (a str.format template, one {})
    chat_template: tuple[tuple[str, Any], ...] | None = None


def class_of(model_index: dict, name: str) -> str | None:
    entry = model_index.get(name)
    if isinstance(entry, list) and len(entry) == 2:
        return entry[1]
    return None


MAX_SIDE = 16384  # pixels: the run time's bound for any family (guards.MAX_SIDE)


@dataclass(frozen=True)
class SizeLimits:
    """The image sizes a model's backbone accepts: multiples of `multiple`, at most `max_height` x
    `max_width` pixels. `why` names the bound (a position table, say) so a refusal can say it."""

    multiple: int
    max_height: int = MAX_SIDE
    max_width: int = MAX_SIDE
    why: str = "the run time's largest side"

    def problem(self, height, width) -> str | None:
        """None when (height, width) runs, else one line saying which limit it breaks."""
        for name, v, hi in (("height", height, self.max_height), ("width", width, self.max_width)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0 or v % self.multiple:
                return f"{name} must be a positive multiple of {self.multiple} for this model, got {v!r}"
            if v > hi:
                return f"{name} must be at most {hi} for this model ({self.why}), got {v}"
        return None

    def describe(self) -> dict:
        return {"multiple": self.multiple, "max_height": self.max_height, "max_width": self.max_width, "why": self.why}


class Family(PictureInput):
    """Base class and protocol. Subclasses set the class attributes and override what differs (what a picture
    given with the prompt means: the PictureInput mixin, families/editing.py)."""

    name: ClassVar[str]
    pipeline_classes: ClassVar[tuple[str, ...]]
    backbone: ClassVar[str]  # component folder of the denoiser: "unet" | "transformer"
    backbone_classes: ClassVar[tuple[str, ...]]
    backbone_kind: ClassVar[str]  # torch wrapper kind for export
    # the backbone's `sample` input is the latent image itself (NCHW, latent_channels at axis 1);
    # False for backbones fed packed patch sequences
    latent_image_input: ClassVar[bool] = False
    text_encoders: ClassVar[tuple[TextEncoderSlot, ...]]
    vae_classes: ClassVar[tuple[str, ...]] = ("AutoencoderKL",)
    predictions: ClassVar[tuple[str, ...]] = ("epsilon", "v_prediction")
    # JSON files beside the components' configs that pipeline_info reads, relative to the source folder (keyed in
    # its `configs` without ".json")
    source_configs: ClassVar[tuple[str, ...]] = ()

    # -- the source folder (export) ---------------------------------------------------------------
    def check_source(self, src_name: str, model_index: dict, present: set[str]) -> None:
        """Every required component there with an accepted class; optional ones absent or accepted."""
        slots = [(s.name, s.classes, s.required) for s in self.text_encoders]
        slots += [(s.tokenizer, s.tokenizer_classes, s.required) for s in self.text_encoders]
        slots += [(self.backbone, self.backbone_classes, True), ("vae", self.vae_classes, True)]
        for comp, classes, required in slots:
            cls = class_of(model_index, comp)
            if cls is None:
                if required:
                    raise UserError(f"{src_name}: a {self.name} pipeline needs '{comp}' ({' or '.join(classes)}); "
                                    f"model_index.json has none")
                continue
            if cls not in classes:
                raise UserError(f"{src_name}: component '{comp}' is {cls!r}; a {self.name} pipeline expects "
                                f"{' or '.join(classes)} (components of different model families mixed?)")
            if comp not in present:
                raise UserError(f"{src_name}: component folder '{comp}' is missing")

    def pipeline_info(self, configs: dict[str, dict]) -> dict:
        """manifest['pipeline'] from the source's JSON configs (keyed by sub-folder; 'model_index',
        'scheduler' and each tokenizer's tokenizer_config included). Checks cross-component agreement."""
        raise NotImplementedError

    def component_specs(self, info: dict, present: set[str]) -> dict[str, ComponentSpec]:
        """Export specs of the components this folder has, in export order."""
        raise NotImplementedError

    def export_dims(self, spec: ComponentSpec, info: dict) -> list[dict[str, int]]:
        """Named-dim values for validation: the export-time dummy first, then a second, different
        shape that proves the dynamic axes are dynamic."""
        raise NotImplementedError

    # -- the model folder (run time) --------------------------------------------------------------
    def conditioning(self, info: dict) -> tuple[TensorSpec, ...]:
        """The backbone's inputs other than sample and timestep, each [uncond; cond] on axis 0."""
        raise NotImplementedError

    def backbone_spec(self, info: dict) -> ComponentSpec:
        return self.component_specs(info, {self.backbone})[self.backbone]

    def combine(self, ops: Ops, encoded: dict[str, dict[str, Any]], info: dict) -> dict[str, Any]:
        """Text encoders' outputs (by component, then output name) -> text conditioning by input name.
        Optional encoders the folder lacks are absent from `encoded`."""
        raise NotImplementedError

    def size_conditioning(self, info: dict, batch: int, height: int, width: int) -> dict[str, np.ndarray]:
        """Conditioning that depends on the image size, not the text (SDXL's add_time_ids)."""
        return {}

    def diffusers_call(self, info: dict, guidance: float) -> dict[str, Any]:
        """Keyword arguments that make the diffusers pipeline do what `generate` does at this guidance with no
        negative prompt (the bench's PyTorch reference runs the same work)."""
        return {"guidance_scale": guidance}

    def diffusers_latents(self, info: dict, latents: np.ndarray, height: int, width: int) -> np.ndarray:
        """Our initial latents in the layout the diffusers pipeline takes as `latents=` (the same by default)."""
        return latents

    def zero_negative(self, info: dict) -> bool:
        """Whether an absent negative prompt means all-zero unconditional embeddings (SDXL)."""
        return False

    def sequence_length(self, component: str, info: dict) -> int:
        """Token length a text encoder is fed, or (backbone) the conditioning sequence length."""
        lengths = info.setting("max_lengths") or {}
        if component in lengths:
            return int(lengths[component])
        return int(info.context_length or info.model_max_length)

    def timing_feed(self, component: str, info: dict, batch: int, rng) -> dict[str, np.ndarray] | None:
        """A component's inputs for quantize's latency runs where its manifest shapes are not enough; None: those."""
        return None

    def image_seq_len(self, info: dict, height: int, width: int) -> int | None:
        """Image tokens the backbone sees (flow schedules' dynamic shift reads it); None: no tokens."""
        return None

    def schedule_mu(self, info: dict, height: int, width: int, steps: int) -> float | None:
        """mu of a dynamically shifted flow schedule when the pipeline computes its own (FLUX.2's empirical fit);
        None: the scheduler's line over `image_seq_len`."""
        return None

    def size_limits(self, info: dict) -> SizeLimits:
        """What sizes the backbone accepts. The default (the UNet families, and the RoPE transformers whose
        positions come from id inputs, not a table): multiples of size_multiple up to the run time's bound."""
        return SizeLimits(int(info.size_multiple))

    def latent_shape(self, info: dict, batch: int, height: int, width: int) -> tuple[int, ...]:
        f = int(info.vae_scale_factor)
        return (batch, int(info.latent_channels), height // f, width // f)

    def decode_scale_shift(self, info: dict) -> tuple[float, float]:
        """(scale, shift) with decoder input = latents * scale + shift (diffusers: x / scaling + shift)."""
        return 1.0 / float(info.vae_scaling_factor), float(info.vae_shift_factor or 0.0)

    # -- methods the transformer families override (the defaults are Stable Diffusion's behaviour) ---
    # backbone input fed the guidance scale itself (guidance-distilled Flux): no [uncond; cond] batch
    guidance_input: ClassVar[str | None] = None

    # node-name patterns of the backbone's repeated blocks, as torch's exporter names them
    cache_block_pattern: ClassVar[str] = r"^(/model/(?:transformer_blocks|single_transformer_blocks)\.\d+/)"

    def cache_span(self, method: str, node_names: list[str], branch: int = 1,
                   layers: int = 0, all_blocks: bool = False) -> tuple[tuple[str, ...], str | None]:
        """Step caching: (node-name prefixes of the span a cached step skips, the first block's prefix).

        Transformer families: every block after the first (first-block cache, TaylorSeer, residual cache), or
        with `all_blocks` (a method whose cached step skips every block) all of them."""
        import re

        if method == "deepcache":
            raise ValueError("deepcache caches a UNet's deep path; use first_block, taylorseer or residual on this backbone")
        blocks = list(dict.fromkeys(m.group(1) for n in node_names if (m := re.match(self.cache_block_pattern, n))))
        if len(blocks) < 2:
            raise ValueError("the backbone has fewer than two named transformer blocks")
        return (tuple(blocks) if all_blocks else tuple(blocks[1:])), blocks[0]

    def cfg_scale(self, guidance: float) -> float:
        """The classifier-free guidance scale s of `u + s (c - u)` for the user's `guidance` (diffusers' guidance_scale
        of this family's pipeline); s <= 1 runs without the unconditional batch."""
        return guidance

    def guidance_input_for(self, info: dict) -> str | None:
        """The guidance backbone input for this folder (a family may have it only for some backbones)."""
        return self.guidance_input

    def true_cfg(self, info: dict) -> bool:
        """Whether guidance runs the [uncond; cond] batch (a guidance-embedding or step-distilled backbone: no)."""
        return self.guidance_input_for(info) is None

    # -- ControlNet (families/control.py: the shared names and record) -------------------------------
    # the family's ControlNet support, a control.ControlNetSupport table the methods below delegate to;
    # None: the backbone takes none, unless the family overrides the methods (the UNet families do)
    controlnet: ClassVar[Any] = None

    def _control(self, what: str) -> Any:
        if self.controlnet is None:
            raise UserError(f"a {self.name} {what} here")
        return self.controlnet

    def controlnet_record(self, config: dict, backbone_config: dict, info: dict) -> dict:
        """A ControlNet's config.json checked against this folder's backbone: what the manifest records
        (residuals, widths); a ControlNet of another family or size is a one-line UserError."""
        return self._control("model folder takes no ControlNet").record(config, backbone_config, info, self.name)

    def controlnet_spec(self, info: dict, record: dict) -> ComponentSpec:
        """The exported ControlNet's I/O for a record `controlnet_record` gave."""
        return self._control("model folder takes no ControlNet").spec(self.conditioning(info), record)

    def control_residuals(self, record: dict, latent: tuple[int, int, int] | None = None) -> list[tuple[str, tuple]]:
        """The backbone's residual inputs for a ControlNet record, in the net's output order: (name, dims),
        symbolic dims, or concrete ones for a (batch, latent height, latent width)."""
        return self._control("backbone takes no ControlNet residuals").residuals(record, latent)

    def control_joins(self, nodes, record: dict) -> list[tuple[str, str, int, bool]]:
        """Where the residuals join the backbone graph (`nodes`: its NodeProtos): (residual name, node,
        input index, every reader). The edge on that node input gets `+ residual`, for that input alone
        or, with every reader, right after its producer for all its readers. A residual may join twice."""
        return self._control("backbone takes no ControlNet residuals").joins(nodes, record)

    def control_latents(self, info: dict, record: dict, latents):
        """A latent-conditioned ControlNet (record condition "latents"): the folder's scaled VAE latents of
        the control picture -> the net's controlnet_cond."""
        return latents if self.controlnet is None else self.controlnet.latents(info, record, latents)

    # true CFG rescaled to the conditional prediction's norm over the last axis (Qwen-Image)
    cfg_rescale: ClassVar[bool] = False
    # latents packed into p x p patch tokens [B, S, C*p*p] (Flux, Qwen-Image); None: NCHW
    latent_patch: ClassVar[int | None] = None
    # whether `compile-loop --whole` can inline the text side (ids -> encoders -> combine)
    whole_graph: ClassVar[bool] = True
    # whether an AutoencoderTiny (TAESD) can stand in for the VAE (families/tiny_vae.py)
    tiny_vae: ClassVar[bool] = True
    # how GGUF backbone files name its tensors (a families/gguf_names.GgufNames); None: no GGUF backbone read
    gguf_names: ClassVar[Any] = None

    def make_tokenizer(self, slot: TextEncoderSlot, folder, info: dict):
        from ..folder.manifest import confined
        from ..runtime.tokenizer import PromptTokenizer

        return PromptTokenizer(confined(folder, slot.tokenizer, "tokenizer folder"), self.sequence_length(slot.name, info))

    def encode_text(self, slot: TextEncoderSlot, tokenizer, session, prompts: list[str], info: dict) -> dict[str, Any]:
        """One text encoder's outputs (by output name) for `prompts`."""
        outs = session.run(list(slot.outputs), {"input_ids": tokenizer(prompts)})
        return dict(zip(slot.outputs, outs))

    def align(self, cond: dict[str, Any], uncond: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Make cond and uncond batchable (same shapes); text of variable length is padded here."""
        return cond, uncond

    def base_sigmas(self, steps: int) -> np.ndarray | None:
        """Base sigmas the diffusers pipeline hands its flow scheduler (None: the scheduler's own)."""
        return None

    def decoder_feed(self, info: dict, latents: np.ndarray, height: int, width: int) -> np.ndarray:
        """Final sampler state -> the VAE decoder's `latent_sample`."""
        scale, shift = self.decode_scale_shift(info)
        return (latents * np.float32(scale) + np.float32(shift)).astype(np.float32)

    def decoded_images(self, sample: np.ndarray) -> np.ndarray:
        """The VAE decoder's output -> (batch, 3, H, W) in [-1, 1]."""
        return sample

    def required_components(self, info: dict) -> tuple[str, ...]:
        return (*(s.name for s in self.text_encoders if s.required), self.backbone, "vae_decoder")

    def check_folder(self, folder_name: str, manifest: Manifest) -> None:
        """A loaded model folder: every required component there, none from another family, and
        the backbone's recorded inputs what this family feeds."""
        comps = manifest.components
        for name in self.required_components(manifest.pipeline):
            if name not in comps:
                raise UserError(f"{folder_name}: a {self.name} model folder needs component '{name}'; the manifest has none")
        for name, comp in comps.items():
            fam = comp.family
            if fam is not None and fam != self.name:
                raise UserError(f"{folder_name}: component '{name}' was exported for family {fam!r}, "
                                f"the folder is {self.name!r} (components of different families mixed)")
        prediction = manifest.pipeline.prediction_type
        if prediction is not None and prediction not in self.predictions:
            # a flow scheduler reads no prediction_type: without this the manifest's word would be ignored
            raise UserError(f"{folder_name}: pipeline.prediction_type {prediction!r} is not what a {self.name} backbone "
                            f"predicts ({', '.join(self.predictions)})")
        recorded = [t.name for t in comps[self.backbone].inputs]
        if recorded:
            want = [SAMPLE, TIMESTEP, *(t.name for t in self.conditioning(manifest.pipeline))]
            if recorded != want:
                raise UserError(f"{folder_name}: backbone inputs {recorded} are not those of a {self.name} "
                                f"backbone {want} (components of different families mixed?)")


def tokenizer_max_length(configs: dict[str, dict], slot: TextEncoderSlot) -> int:
    if slot.max_length is not None:
        return slot.max_length
    cfg = configs.get(f"{slot.tokenizer}/tokenizer_config") or {}
    return int(cfg.get("model_max_length", 77))


def size_multiple(info: dict) -> int:
    return int(info.size_multiple)
