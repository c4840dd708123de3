"""Text-to-image with ONNX Runtime and numpy: tokenize -> encode -> sample -> decode.

`Pipeline.iter_generate` is a generator (one event per step) so progress bars, previews and
calibration capture all hang off the same loop; `Pipeline.__call__` just drains it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..artifacts import read_manifest, verify_folder
from ..errors import UserError
from ..paths import default_model_folder
from ..samplers import SamplerTable, iter_sample, schedule_from_config, table_from_config
from .backbone import GuidedBackbone
from .sampling_graph import SamplingGraph
from .session import make_session
from .tokenizer import PromptTokenizer


LOOP_FORMS = ("host", "loop", "unrolled")


@dataclass
class StepEvent:
    step: int
    num_steps: int
    timestep: float
    latents: np.ndarray
    denoised: np.ndarray


@dataclass
class GenerationResult:
    images: np.ndarray  # (batch, H, W, 3) uint8
    latents: np.ndarray  # final latents before VAE scaling
    init_latents: np.ndarray
    noise: np.ndarray | None
    settings: dict = field(default_factory=dict)

    def save(self, path: Path | str) -> list[Path]:
        from ..imageio import save_images

        return save_images(self.images, Path(path))


@dataclass(frozen=True)
class GenerateOptions:
    steps: int = 20
    sampler: str | None = None  # None: the one the folder's scheduler_config.json names
    guidance: float = 7.5
    seed: int = 0
    height: int | None = None
    width: int | None = None
    batch: int = 1
    spacing: str | None = None
    loop: str = "host"  # host | loop | unrolled


class Pipeline:
    def __init__(self, folder: Path, manifest: dict, provider: str, threads: int | None):
        self.folder = folder
        self.manifest = manifest
        self.provider = provider
        info = manifest["pipeline"]
        self.info = info
        self.tokenizer = PromptTokenizer(folder / "tokenizer")
        comps = manifest["components"]
        self.text_encoder = make_session(folder / comps["text_encoder"]["path"], provider, threads)
        self.unet = _backbone_session(folder / comps["unet"]["path"], comps["unet"], provider, threads)
        self.vae_decoder = make_session(folder / comps["vae_decoder"]["path"], provider, threads)
        self._threads = threads
        self._graphs: dict[str, SamplingGraph] = {}
        # a quantized backbone may come with a sampler-side output correction (quantize --correct)
        self.correction = None
        if comps["unet"].get("correction"):
            from ..quantize.correction import OutputCorrection

            self.correction = OutputCorrection.from_dict(comps["unet"]["correction"])
        sched_path = folder / "scheduler" / "scheduler_config.json"
        try:
            self.scheduler_config = json.loads(sched_path.read_text())
            self.schedule = schedule_from_config(self.scheduler_config)
        except (OSError, json.JSONDecodeError, ValueError) as e:
            raise UserError(f"{sched_path}: {e}") from None

    @classmethod
    def from_folder(cls, folder: Path | str | None = None, provider: str = "cpu", verify: bool = True,
                    threads: int | None = None, warmup: bool = False) -> Pipeline:
        """Load an exported model folder (default: the embedded model). Hashes are checked unless verify=False."""
        folder = Path(folder) if folder is not None else default_model_folder()
        manifest = read_manifest(folder)
        if verify:
            verify_folder(folder, manifest)
        pipe = cls(folder, manifest, provider, threads)
        if warmup:
            pipe(prompt="", steps=1, guidance=1.0)
        return pipe

    # -- stages -------------------------------------------------------------------------------
    def encode_prompt(self, prompts: list[str]) -> np.ndarray:
        ids = self.tokenizer(prompts)
        return self.text_encoder.run(["last_hidden_state"], {"input_ids": ids})[0]

    def decode(self, latents: np.ndarray) -> np.ndarray:
        scaled = (latents / np.float32(self.info["vae_scaling_factor"])).astype(np.float32)
        image = self.vae_decoder.run(["sample"], {"latent_sample": scaled})[0]
        image = np.clip(image / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1)
        return (image * 255).round().astype(np.uint8)

    def table(self, options: GenerateOptions, mu: float | None = None,
              image_seq_len: int | None = None) -> SamplerTable:
        """The sampler table from the folder's scheduler config (its own sampler unless options name one).

        `mu` or `image_seq_len`: the dynamic shift of a flow schedule that uses one.
        """
        try:
            return table_from_config(self.scheduler_config, options.steps, options.sampler, spacing=options.spacing,
                                     mu=mu, image_seq_len=image_seq_len)
        except ValueError as e:
            raise UserError(str(e)) from None

    def latent_shape(self, options: GenerateOptions) -> tuple[int, int, int, int]:
        info = self.info
        h = options.height or info["default_height"]
        w = options.width or info["default_width"]
        m = info["size_multiple"]
        for name, v in (("height", h), ("width", w)):
            if v <= 0 or v % m:
                raise UserError(f"{name} must be a positive multiple of {m} for this model, got {v}")
        if options.batch < 1:
            raise UserError(f"batch must be >= 1, got {options.batch}")
        f = info["vae_scale_factor"]
        return (options.batch, info["latent_channels"], h // f, w // f)

    def latent_shape_for(self, batch: int, height: int | None = None, width: int | None = None) -> tuple[int, ...]:
        return self.latent_shape(GenerateOptions(batch=batch, height=height, width=width))

    def sampling_graph(self, form: str) -> SamplingGraph:
        if form not in LOOP_FORMS[1:]:
            raise UserError(f"unknown loop form {form!r}; choose from {', '.join(LOOP_FORMS)}")
        if form not in self._graphs:
            info = self.manifest["components"].get(f"sampler_{form}")
            if info is None:
                raise UserError(f"{self.folder} has no '{form}' sampling graph (run `onnxdiffusion compile-loop --form {form}`)")
            session = make_session(self.folder / info["path"], self.provider, self._threads)
            self._graphs[form] = SamplingGraph(session, info)
        return self._graphs[form]

    # -- generation ---------------------------------------------------------------------------
    def prepare(self, options: GenerateOptions, latents: np.ndarray | None, noise: np.ndarray | None):
        """Validate everything before any model runs; returns (table, latents, noise)."""
        if not np.isfinite(options.guidance) or options.guidance < 0:
            raise UserError(f"guidance must be >= 0, got {options.guidance}")
        table = self.table(options)
        shape = self.latent_shape(options)
        if options.loop != "host":
            graph = self.sampling_graph(options.loop)
            if graph.form == "unrolled" and graph.steps != table.num_steps:
                raise UserError(f"this model's unrolled graph runs exactly {graph.steps} model evaluations, "
                                f"this sampler needs {table.num_steps}")
        rng = np.random.default_rng(options.seed)
        if latents is None:
            latents = rng.standard_normal(shape, dtype=np.float32)
        else:
            latents = np.asarray(latents, dtype=np.float32)
            if latents.shape != shape:
                raise UserError(f"latents must have shape {shape}, got {latents.shape}")
        if table.needs_noise and noise is None:
            noise = rng.standard_normal((table.num_steps, *shape), dtype=np.float32)
        if noise is not None:
            noise = np.asarray(noise, dtype=np.float32)
            if noise.shape != (table.num_steps, *shape):
                raise UserError(f"noise must have shape {(table.num_steps, *shape)}, got {noise.shape}")
        return table, latents, noise

    def iter_generate(self, prompt: str | list[str], negative_prompt: str | list[str] | None = None,
                      latents: np.ndarray | None = None, noise: np.ndarray | None = None,
                      **kwargs) -> Iterator[StepEvent | GenerationResult]:
        """Validate all inputs now (before any model runs), then return the per-step generator."""
        try:
            options = GenerateOptions(**kwargs)
        except TypeError as e:
            raise UserError(str(e)) from None
        table, latents, noise = self.prepare(options, latents, noise)
        b = options.batch
        prompts = [prompt] * b if isinstance(prompt, str) else list(prompt)
        if len(prompts) != b:
            raise UserError(f"got {len(prompts)} prompts for batch {b}")
        negatives = negative_prompt if negative_prompt is not None else ""
        negatives = [negatives] * b if isinstance(negatives, str) else list(negatives)
        if len(negatives) != b:
            raise UserError(f"got {len(negatives)} negative prompts for batch {b}")
        return self._run(options, table, latents, noise, prompts, negatives)

    def _run(self, options, table, latents, noise, prompts, negatives):
        guided = options.guidance > 1.0
        cond = self.encode_prompt(prompts)
        if options.loop != "host":
            uncond = self.encode_prompt(negatives)
            x = self.sampling_graph(options.loop).run(table, latents, cond, uncond, options.guidance, noise)
        else:
            uncond = self.encode_prompt(negatives) if guided else None
            model_fn = GuidedBackbone(self.unet, latents.shape, cond, uncond, options.guidance)
            if self.correction is not None:
                model_fn = self.correction.wrap(model_fn)
            x = latents
            for i, x, den in iter_sample(model_fn, latents, table, noise):
                yield StepEvent(i, table.num_steps, float(table.timesteps[i]), x, den)
        yield GenerationResult(
            images=self.decode(x),
            latents=x,
            init_latents=latents,
            noise=noise,
            settings={"prompt": prompts, "negative_prompt": negatives, **options.__dict__, "sampler": table.sampler},
        )

    def __call__(self, prompt: str | list[str], **kwargs) -> GenerationResult:
        result = None
        for event in self.iter_generate(prompt, **kwargs):
            result = event
        assert isinstance(result, GenerationResult)
        return result


def _backbone_session(path: Path, info: dict, provider: str, threads: int | None):
    """The backbone's session; a quantized backbone may name ORT optimizers to leave off.

    int8 backbones disable the NCHWc/NHWC layout rewrites: the NHWC one wraps every QLinearConv in
    transposes (slower on CPU), and NCHWc changes float convolutions' summation order, which made
    the host loop and the Loop form (where ORT does not apply it) round differently.
    """
    disabled = list((info.get("session_options") or {}).get("disabled_optimizers") or [])
    return make_session(path, provider, threads, disabled_optimizers=disabled or None)
