"""Text-to-image with ONNX Runtime and numpy: tokenize -> encode -> sample -> decode.

`Pipeline.iter_generate` is a generator (one event per step) so progress bars, previews and
calibration capture all hang off the same loop; `Pipeline.__call__` just drains it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..folder.artifacts import component_path, read_manifest, verify_folder
from ..cpu.check import kernels_warning
from ..errors import UserError
from ..families import NumpyOps, get_family
from ..folder.manifest import Manifest, confined
from . import guards
from ..folder.paths import default_model_folder
from ..samplers import SamplerTable, default_sampler, table_from_config
from ..samplers.schedules import FlowSchedule
from ..adapters.runtime import RuntimeLora, with_feeds
from ..techniques.state import TechniqueState
from .generation import (  # noqa: F401  (re-exported: the public names live here too)
    GenerateOptions, GenerationResult, StepEvent, resolve_options)
from .backbone import Conditioning, DeviceBackbone, DevicePool, FedBackbone, GuidedBackbone
from .memory import LazySession, memory_options
from .pictures import PictureStages  # decode, encode_image, encode_pixels, backbone_extra_channels
from .session_makers import SessionMakers  # session_maker, component_session, backbone_session_maker
from .sampling_graph import SamplingGraph, open_sampling_graph
from .static_shapes import session_factory
from .loading import backbone_remedies, load_scheduler, lora_backbone
from .session import check_external_data
from .tokenizer import PromptTokenizer
from .vae_tiling import check_tiling


LOOP_FORMS = ("host", "loop", "unrolled")


class Pipeline(SessionMakers, PictureStages):
    def __init__(self, folder: Path, manifest: Manifest, provider: str, threads: int | None, profile=None, memory=None):
        from .profiled import backbone_entry, foreign_ops_note, session_providers

        self.folder = folder
        self.manifest = manifest
        self.provider = provider
        self.profile = profile  # a profiles.Resolved, or None
        self.memory = mem = memory_options(memory)
        info = manifest.pipeline
        self.info = info
        if mem.vae_tile:
            check_tiling(mem.vae_tile, mem.vae_tile_overlap, info.vae_scale_factor)  # before any session loads
        self.family = family = get_family(manifest.family)
        family.check_folder(str(folder), manifest)
        comps = manifest.components
        # the family's text encoders this folder has (optional ones, like SD3's T5, may be absent)
        self.slots = [s for s in family.text_encoders if s.name in comps]
        self.tokenizers = {s.name: family.make_tokenizer(s, folder, info) for s in self.slots}
        bb = comps[family.backbone]
        self._threads = threads  # (session_maker's, as the providers for each role)
        self._chain = chain = session_providers(profile, bb, info, threads)
        # text encoders: loaded now (their I/O is checked below); with memory `release_text_encoders` they
        # are let go after each encoding and loaded again from their files for the next prompt
        # static_shapes (runtime/static_shapes.py): the backbone only, which runs every step; the text encoders and
        # the VAE decoder run once an image, where a compile per new shape costs more than the static graph saves
        static = profile is not None and profile.profile.static_shapes
        self.text_sessions = {
            s.name: LazySession(session_factory(False, chain["other"], component_path(folder, manifest, s.name),
                                                self.session_maker("other", comps[s.name])), mem.release_text_encoders)
            for s in self.slots}
        bb = backbone_entry(folder, bb, provider, profile)
        self._backbone_info = bb
        if provider == "cpu" and (note := kernels_warning(bb.int8_kernels)):
            warnings.warn(f"{folder}: {note}", stacklevel=3)
        # the backbone's session is made on first use: a pipeline that runs only a sampling graph (which
        # holds the backbone's weights itself) never loads it; its I/O is checked now, from its graph
        backbone_path = confined(folder, bb.path, "backbone")
        backbone_io = check_external_data(backbone_path)
        if note := foreign_ops_note(backbone_io.foreign_ops, provider):
            warnings.warn(f"{folder}: {note}", stacklevel=3)
        self._backbone = LazySession(session_factory(static, chain["backbone"], backbone_path,
                                                     self.session_maker("backbone"), io=backbone_io), release=False)
        # the run-time LoRA state (adapters/runtime.py): the pipeline calls into it, it never reads the pipeline
        self.lora = RuntimeLora(manifest, family.backbone, lora_backbone(backbone_path, bb, family.backbone, provider,
                                                                         profile, self.session_maker("backbone")))
        if self.lora.fused is not None:  # no adapter: the points' branches taken out (adapters/fused.py)
            self._backbone = LazySession(self.lora.fused.plain, release=False)
        self.vae_decoder = session_factory(False, chain["other"], component_path(folder, manifest, "vae_decoder"),
                                           self.session_maker("other", comps["vae_decoder"]))()
        # every family's components keep fixed I/O names: a swapped or foreign component fails here
        for slot in self.slots:
            guards.check_io(folder, slot.name, self.text_sessions[slot.name].get(), ("input_ids",), tuple(slot.outputs))
        guards.check_io(folder, family.backbone, backbone_io, ("sample", "timestep"), ("out_sample",))
        guards.check_io(folder, "vae_decoder", self.vae_decoder, ("latent_sample",), ("sample",))
        if family.latent_image_input:
            guards.check_latent_channels(folder, info, {family.backbone: (backbone_io, "sample"),
                                                        "vae_decoder": (self.vae_decoder, "latent_sample")})
        guards.check_declared_dims(folder, family, info, {**{s.name: self.text_sessions[s.name].get() for s in self.slots},
                                                          family.backbone: backbone_io, "vae_decoder": self.vae_decoder})
        self._graphs: dict[str, SamplingGraph] = {}
        self._init_pictures(backbone_io)
        self.device_pool = DevicePool()  # io_binding device: bound buffers reused across generations
        self.technique_state = TechniqueState()  # per-step techniques' own caches (a cut backbone, loaded nets)
        self.correction, self.precision_schedule, self.backbone_high = backbone_remedies(
            folder, comps, bb, provider, threads, profile, chain["backbone"], mem)
        self.scheduler_config, self.schedule = load_scheduler(folder)
        kind = getattr(self.schedule, "prediction_type", None)
        if kind is not None and info.prediction_type is not None and kind != info.prediction_type:
            raise UserError(f"{folder}: the scheduler's prediction_type {kind!r} disagrees with "
                            f"the manifest's {info.prediction_type!r}")
        self.recommended = manifest.recommended
        # lengths and widths of the text side agree with the backbone: one empty-prompt encoding now, or, where
        # the encoders are let go after each encoding, a check of the first real one (an LLM encoder's probe
        # would load and run it a second time before the first image: minutes at release size)
        self._text_unchecked = backbone_io if mem.release_text_encoders else None
        if self._text_unchecked is None:
            guards.probe_text(folder, self, backbone_io)

    @classmethod
    def from_folder(cls, folder: Path | str | None = None, provider: str = "cpu", verify: bool = True,
                    threads: int | None = None, warmup: bool = False, profile=None, memory=None) -> Pipeline:
        """Load an exported model folder (default: the embedded model). Hashes are checked unless verify=False.

        `memory`: `default` | `lean` | MemoryOptions (runtime/memory.py): `lean` lets the text encoders go
        after each encoding and turns off ORT's memory pattern (a lower peak resident set; images identical).

        `profile`: a hardware profile (name, YAML path, or profiles.Profile): it decides the provider,
        its options and how the loop binds memory; `provider` is then ignored. None on the CPU provider: the
        folder's recommended profile (a tuned folder's), if any. One that cannot run
        here falls back as it declares (warning) or fails with one line.
        """
        folder = Path(folder) if folder is not None else default_model_folder()
        manifest = read_manifest(folder)
        if verify:
            verify_folder(folder, manifest)
        resolved = None
        if profile is None and provider == "cpu" and manifest.recommended.profile is not None:
            profile = manifest.recommended.profile  # a tuned folder's (`tune` chose it on this CPU)
        if profile is not None:
            from .profiled import resolve_for_folder

            resolved = resolve_for_folder(profile, manifest)
            provider = resolved.profile.provider
            threads = threads or resolved.profile.threads
            memory = memory if memory is not None else resolved.profile.memory
        pipe = cls(folder, manifest, provider, threads, resolved, memory)
        if warmup:
            pipe(prompt="", steps=1, guidance=1.0)
        return pipe

    @property
    def backbone(self):
        return self._backbone.get()

    @backbone.setter
    def backbone(self, session) -> None:  # a caller's own session (quantize); None: let it go, remade on use
        self._backbone.set(session)

    def release_backbone(self) -> None:
        """Let the backbone's session (and compiled sampling graphs, which hold its weights) go; made again from
        the files on the next use."""
        self._backbone.set(None)
        self._graphs.clear()
        from ..onnxio import release_memory

        release_memory()

    @property
    def backbone_loaded(self) -> bool:  # False until a host step (or a caller) needs the backbone's session
        return self._backbone.loaded

    @property
    def backbone_info(self) -> dict:  # the backbone's manifest entry as run here (a profile may pick another file)
        return self._backbone_info

    # the first (SD: only) text encoder and tokenizer, for callers that time or hook them
    @property
    def tokenizer(self) -> PromptTokenizer:
        return self.tokenizers[self.slots[0].name]

    @property
    def text_encoder(self):
        return self.text_sessions[self.slots[0].name].get()

    @contextmanager
    def holding_text_encoders(self):
        """Keep the text encoders loaded across several encodings (prompt and negative prompt); with
        memory `release_text_encoders` they are let go when the outermost holder is done."""
        with ExitStack() as stack:
            for holder in self.text_sessions.values():
                stack.enter_context(holder.use())
            yield

    # -- stages -------------------------------------------------------------------------------
    def encode_prompt(self, prompts: list[str], adapter=None, pictures=None) -> Conditioning:
        """The text conditioning of the backbone, by input name: every text encoder, combined as
        the family says (SD: encoder_hidden_states; SDXL adds the pooled text_embeds; ...).
        `adapter`: LoRA feeds (adapters.AdapterFeeds) for the text encoders that have some; `pictures`: what an
        editing family's text encoders read of its reference pictures (Family.reference_text)."""
        unchecked = self._text_unchecked
        if unchecked is not None:  # the load-time probe deferred to this first encoding (see __init__)
            cond = guards.checked_encoding(self.folder, lambda: self._encode_prompt(prompts, adapter, pictures),
                                           unchecked)
            self._text_unchecked = None
            return cond
        return self._encode_prompt(prompts, adapter, pictures)

    def _encode_prompt(self, prompts: list[str], adapter=None, pictures=None) -> Conditioning:
        seen = {} if pictures is None else {"pictures": pictures}
        with self.holding_text_encoders():
            encoded = {slot.name: self.family.encode_text(slot, self.tokenizers[slot.name],
                                                          with_feeds(self.text_sessions[slot.name].get(),
                                                                     adapter and adapter.for_component(slot.name)),
                                                          prompts, self.info, **seen)
                       for slot in self.slots}
        cond = self.family.combine(NumpyOps(), encoded, self.info)
        for v in cond.values():
            guards.check_finite(v, "text encoding (the text encoder produced NaN/inf)")
        return cond

    def conditioning(self, prompts: list[str], negatives: list[str] | None, guided: bool, height: int,
                     width: int, adapter=None, references: Conditioning | None = None
                     ) -> tuple[Conditioning, Conditioning | None]:
        """(cond, uncond) for the backbone; uncond None when unguided. `negatives` None: no negative
        prompt given (SDXL then uses zeros, as diffusers does; others encode ""). `references`: an editing
        model's reference inputs (runtime/references.py), the same in cond and uncond."""
        if references is None and self.family.image_role == "reference" and not self.family.references_optional:
            # an editing model measured without a picture (calibration, schedule selection): the probe picture;
            # a generation always brings its own (run_loop.prepare_run refuses one without)
            from .references import plan_references, probe_feeds

            references = plan_references(self, probe_feeds(self, width, height, light=True)["image"], len(prompts))
        size = {**self.family.size_conditioning(self.info, len(prompts), height, width), **(references or {})}
        pictures = getattr(references, "text", None)
        with self.holding_text_encoders():  # one load for both when they are let go after use
            cond = {**self.encode_prompt(prompts, adapter, pictures), **size}
            if not guided:
                return cond, None
            if negatives is None and self.family.zero_negative(self.info):
                uncond = {k: np.zeros_like(v) for k, v in cond.items() if k not in size}
            else:
                uncond = self.encode_prompt(negatives if negatives is not None else [""] * len(prompts), adapter,
                                            pictures)
        return self.family.align(cond, {**uncond, **size})

    def guided_backbone(self, prompts: list[str], negatives: list[str] | None, guidance: float, height: int,
                        width: int, shape: tuple[int, ...], session=None, extra=None, adapter=None,
                        inputs=None, references=None) -> GuidedBackbone:
        """model_fn(x, t) over the backbone (or `session`), conditioned and guided as this family is (a
        guidance-distilled backbone takes the scale as an input and runs unbatched). `extra`: an inpainting
        backbone's extra sample channels; `adapter`: LoRA feeds; `references`: an editing model's reference inputs."""
        embedded = self.family.guidance_input_for(self.info)
        if embedded is None:  # the family's guidance as the CFG scale of u + s (c - u)
            guidance = self.family.cfg_scale(guidance)
        guided = guidance > 1.0 and self.family.true_cfg(self.info)
        cond, uncond = self.conditioning(prompts, negatives, guided, height, width, adapter, references)
        if embedded is not None:
            cond[embedded] = np.full((len(prompts),), guidance, np.float32)
        if inputs:  # more backbone inputs (ControlNet residuals), already on the [uncond; cond] batch
            return GuidedBackbone(session, shape, cond, uncond, guidance, rescale=self.family.cfg_rescale, extra=extra,
                                  inputs=inputs)
        if adapter and adapter.for_component(self.family.backbone):  # LoRA tensors bound beside the sample (runtime.py)
            # (no extra input channels here: techniques/registry.py refuses LoRA with an inpainting backbone)
            fused, bound = self.lora.step_inputs(session, adapter)
            return FedBackbone(session or fused or self.backbone, shape, cond, uncond, guidance,
                               rescale=self.family.cfg_rescale, extra=bound)
        session = session or self.backbone
        if self.profile is not None and self.profile.profile.io_binding == "device":
            if extra is not None:
                raise UserError("an inpainting backbone's extra input channels are not bound to device memory yet; "
                                "use a profile with host io_binding")
            device = "cuda" if self.provider in ("cuda", "tensorrt") else "cpu"
            return DeviceBackbone(session, shape, cond, uncond, guidance, rescale=self.family.cfg_rescale,
                                  device=device, pool=self.device_pool)
        return GuidedBackbone(session, shape, cond, uncond, guidance, rescale=self.family.cfg_rescale, extra=extra)

    def table(self, options: GenerateOptions, mu: float | None = None,
              image_seq_len: int | None = None) -> SamplerTable:
        """The sampler table from the folder's scheduler config (its own sampler unless options name one).

        `mu` or `image_seq_len`: the dynamic shift of a flow schedule that uses one (by default the
        image token count the family's backbone sees at this size).
        """
        options = self.resolve(options)
        if mu is None and image_seq_len is None and getattr(self.schedule, "use_dynamic_shifting", False):
            mu = self.family.schedule_mu(self.info, *self.image_size(options), options.steps)
            if mu is None:
                image_seq_len = self.family.image_seq_len(self.info, *self.image_size(options))
        # Flux and Qwen-Image pipelines hand their flow scheduler base sigmas of their own
        sigmas = self.family.base_sigmas(options.steps) if isinstance(self.schedule, FlowSchedule) else None
        try:
            return table_from_config(self.scheduler_config, options.steps, options.sampler, spacing=options.spacing,
                                     mu=mu, image_seq_len=image_seq_len, sigmas=sigmas)
        except ValueError as e:
            raise UserError(str(e)) from None

    def resolve(self, options: GenerateOptions) -> GenerateOptions:
        options = resolve_options(options, self.recommended)
        if options.sampler is None:
            options = replace(options, sampler=default_sampler(self.scheduler_config))
        return options

    def image_size(self, options: GenerateOptions) -> tuple[int, int]:
        shape = guards.latent_shape(self.info, options)  # checks types, ranges, multiples, batch
        f = self.info.vae_scale_factor
        return shape[2] * f, shape[3] * f

    def latent_shape(self, options: GenerateOptions) -> tuple[int, ...]:
        h, w = self.image_size(options)
        return self.family.latent_shape(self.info, options.batch, h, w)

    def latent_shape_for(self, batch: int, height: int | None = None, width: int | None = None) -> tuple[int, ...]:
        return self.latent_shape(GenerateOptions(batch=batch, height=height, width=width))

    def sampling_graph(self, form: str) -> SamplingGraph:
        if form not in self._graphs:
            self._graphs[form] = open_sampling_graph(self, form)
        return self._graphs[form]

    # -- generation ---------------------------------------------------------------------------
    def prepare(self, options: GenerateOptions, latents: np.ndarray | None, noise: np.ndarray | None,
                image=None, mask=None):
        """Validate everything before any model runs; returns (table, latents, noise), and with an
        `image` a fourth item, the ImageStart (image_input.py): noise then has the cut table's rows."""
        from .run_loop import prepare

        return prepare(self, options, latents, noise, image, mask)

    def iter_generate(self, prompt: str | list[str], negative_prompt: str | list[str] | None = None,
                      latents: np.ndarray | None = None, noise: np.ndarray | None = None, image=None, mask=None,
                      loras=None, controlnets=None, **kwargs) -> Iterator[StepEvent | GenerationResult]:
        """Validate all inputs now (before any model runs), then return the per-step generator.

        `image` means what the model's family says (`family.image_role`, runtime/references.py):
        img2img ("start"): an RGB picture ((H, W, 3) uint8 or PIL) or scaled image latents
        (B, C, h, w) float32, used as they are; `strength` in (0, 1] (default 1) says how much of the
        schedule runs; `latents` stays the Gaussian noise. `mask` (inpainting, white = repaint; with
        `mask_blur` pixels of Gaussian blur first) keeps the rest of the picture. An editing model
        ("reference"): the picture to edit, or a list of pictures where the family takes several; the
        prompt is the instruction and height/width the output's exact size.
        `controlnets`: [ControlNetSpec | (name, image[, scale[, start, end]]), ...] (techniques/controlnet.py).
        `loras`: [(path, scale), ...] run-time LoRAs (a folder with insertion points: `lora points`), or the
        AdapterFeeds `lora_feeds` returned for them (converted once, reused)."""
        from ..techniques.lora import LoraUse, backbone_layers
        from .run_loop import prepare_run, run

        try:
            options = GenerateOptions(**kwargs)
        except TypeError as e:
            raise UserError(str(e)) from None
        from .references import edit_size

        options = edit_size(self, self.resolve(options), image)
        # the table's lora x inpaint_backbone row keys on LoRAs with backbone layers: read only when it asks
        lora = LoraUse(lambda: backbone_layers(self.lora_feeds(loras, options.loop), self.family.backbone)) \
            if loras else False
        specs, prepared, references = prepare_run(self, options, latents, noise, image, mask, lora=lora,
                                                  controlnet=bool(controlnets))
        b = options.batch
        prompts = guards.prompt_list(prompt, b, "prompt")
        negatives = None if negative_prompt is None else guards.prompt_list(negative_prompt, b, "negative prompt")
        from ..techniques.controlnet import prepare as prepare_controls

        controls = prepare_controls(self, controlnets, options, loras)
        adapter = self.lora_feeds(loras, options.loop)
        start = prepared[3] if len(prepared) > 3 else None
        return guards.model_errors(self.folder, run(self, options, *prepared[:3], prompts, negatives, start, adapter,
                                                    controls, specs, references))

    def lora_feeds(self, loras, loop: str = "host"):
        """The adapter feeds of `loras` (adapters/feeds.py), files read once per pipeline (LRU)."""
        return self.lora.feeds(loras, loop)

    def __call__(self, prompt: str | list[str], **kwargs) -> GenerationResult:
        result = None
        for event in self.iter_generate(prompt, **kwargs):
            result = event
        assert isinstance(result, GenerationResult)
        return result

