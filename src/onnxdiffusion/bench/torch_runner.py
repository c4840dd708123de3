"""The PyTorch reference runner: the diffusers pipeline of the source folder, timed per component."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..errors import UserError
from .rss import current_rss_bytes
from .runner_base import Generation, Job, Runner, _delta, _Timed, _version
from .variants import VariantSpec


class TorchRunner(Runner):
    """The diffusers pipeline of the source folder (fp32, or bf16 for torch-bf16): DDIM built from the folder's scheduler config, or the
    folder's own scheduler when the variant runs the folder's default sampler (flow families, SDXL's Euler)."""

    def __init__(self, spec: VariantSpec, threads: int | None):
        self.spec, self.threads = spec, threads
        self.load_info = {}

    def load(self) -> dict:
        rss0 = current_rss_bytes()
        t0 = time.perf_counter()
        import torch
        from diffusers import DDIMScheduler, DiffusionPipeline
        from diffusers.utils import logging as dlog

        from ..export.pipeline import source_info
        from ..samplers.config import default_sampler

        import_s = time.perf_counter() - t0
        dlog.set_verbosity_error()
        dlog.disable_progress_bar()
        if self.threads:
            torch.set_num_threads(self.threads)
        self.torch = torch
        t0 = time.perf_counter()
        index = json.loads((Path(self.spec.folder) / "model_index.json").read_text())
        self.family, self.info = source_info(self.spec.folder)
        extra = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False} \
            if "safety_checker" in index else {}
        # components the folder leaves out ([null, null] in model_index.json, e.g. SD3 without its T5 encoder):
        # diffusers' loader wants them passed as None
        extra.update({k: None for k, v in index.items() if not k.startswith("_") and v == [None, None]})
        self.dtype = torch.bfloat16 if self.spec.precision == "bf16" else torch.float32
        pipe = DiffusionPipeline.from_pretrained(self.spec.folder, local_files_only=True, torch_dtype=self.dtype,
                                                 **extra)
        own = default_sampler(dict(pipe.scheduler.config))
        if self.spec.sampler == "ddim" and own != "ddim":
            pipe.scheduler = ddim_from_config(DDIMScheduler, pipe.scheduler.config)
        elif self.spec.sampler != own:  # the bench's sampler: the diffusers class our runtime reproduces it by
            import diffusers

            from ..samplers.config import SAMPLER_CLASS

            cls = getattr(diffusers, SAMPLER_CLASS.get(self.spec.sampler, ""), None)
            if cls is None:
                raise UserError(f"{self.spec.name}: diffusers has no scheduler for the {self.spec.sampler} sampler")
            pipe.scheduler = cls.from_config(pipe.scheduler.config)
        if self.spec.decoder == "tiny":  # the source's TAESD in place of the VAE, as FastSD runs diffusers
            from diffusers import AutoencoderTiny

            from .variants import TINY_VAE_DIR

            pipe.vae = AutoencoderTiny.from_pretrained(Path(self.spec.folder) / TINY_VAE_DIR, local_files_only=True,
                                                       torch_dtype=self.dtype).eval()
        pipe.set_progress_bar_config(disable=True)
        load_s = time.perf_counter() - t0
        self.pipe = pipe
        self.sink = {"te": 0.0, "te_end": 0.0, "vae": 0.0, "vae_end": 0.0}
        sink = self.sink

        def pre(module, args, kwargs=None):
            sink["_te_t0"] = time.perf_counter()

        def post(module, args, output):
            now = time.perf_counter()
            sink["te"] += now - sink["_te_t0"]
            sink["te_end"] = now

        for slot in self.family.text_encoders:  # every text encoder the folder has
            encoder = getattr(pipe, slot.name, None)
            if encoder is not None:
                encoder.register_forward_pre_hook(pre)
                encoder.register_forward_hook(post)
        pipe.vae.decode = _Timed(pipe.vae.decode, sink, "vae")
        sink["calls"] = 0

        def count(module, args):
            sink["calls"] += 1

        getattr(pipe, self.family.backbone).register_forward_pre_hook(count)
        self.load_info = {"load_s": load_s, "import_s": import_s, "rss_delta_bytes": _delta(rss0),
                          "versions": {"torch": torch.__version__, "diffusers": _version("diffusers")}}
        return self.load_info

    def generate(self, job: Job) -> Generation:
        torch = self.torch
        sink = self.sink
        sink["te"] = sink["vae"] = 0.0
        sink["calls"] = 0
        steps: list[float] = []
        lat: list[np.ndarray] = []
        steps_cpu: list[float] = []
        state = {"prev": None, "cprev": None, "last": None, "book": 0.0}

        def on_step(pipe, i, t, kwargs):
            now, cnow = time.perf_counter(), time.process_time()
            start = state["prev"] if state["prev"] is not None else sink["te_end"]
            steps.append(now - start)
            if state["cprev"] is not None:  # the first step's CPU start is inside the text encoder's call
                steps_cpu.append(cnow - state["cprev"])
            x = kwargs["latents"]
            if job.capture:
                lat.append(x.detach().float().cpu().numpy().copy())
            state["last"] = x.detach().float().cpu().numpy().copy() if i == self.spec.steps - 1 else None
            state["prev"], state["cprev"] = time.perf_counter(), time.process_time()
            state["book"] += state["prev"] - now
            return {}

        t0 = time.perf_counter()
        c0 = time.process_time()
        with torch.inference_mode():
            # by keyword: FLUX.2's pipelines take `image` first
            latents = self.family.diffusers_latents(self.info, np.ascontiguousarray(job.latents), job.height, job.width)
            out = self.pipe(
                prompt=job.prompts, latents=torch.from_numpy(latents).to(self.dtype), height=job.height,
                width=job.width, num_inference_steps=self.spec.steps, output_type="np",
                callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"],
                **self.family.diffusers_call(self.info, job.guidance),
            )
        total = time.perf_counter() - t0
        cpu = time.process_time() - c0
        images = (np.asarray(out.images) * 255).round().astype(np.uint8)
        return Generation(images=images, total_s=total - state["book"], text_encoder_s=sink["te"],
                          sampling_s=sum(steps), vae_s=sink["vae"], step_s=steps,
                          step_latents=lat if job.capture else None, final_latents=state["last"], cpu_s=cpu,
                          step_cpu_s=steps_cpu, backbone_calls=sink["calls"])

    def close(self) -> None:
        self.pipe = None


def ddim_from_config(cls, config):
    """DDIM from a folder's scheduler config, computing what our runtime computes.

    Our sampler tables never clip x0. diffusers' DDIMScheduler defaults to clip_sample=True, so a config
    that does not say (SD1.5's PNDMScheduler config) would clip in diffusers only; pin it off then.
    (Same rule in peer_worker.py.)
    """
    extra = {} if "clip_sample" in config else {"clip_sample": False}
    return cls.from_config(config, **extra)
