"""Running a compiled sampling graph (Loop or unrolled): inputs checked before ONNX Runtime sees them."""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..folder.manifest import Component
from ..samplers import COLUMNS, SamplerTable
from ..techniques.stop import read_record as read_stop_record


class SamplingGraph:
    def __init__(self, session, entry: Component):
        self.session = session
        self.form = entry.form
        self.steps = entry.steps
        self.whole = entry.whole
        self.cache = entry.cache  # the step-caching method compiled in (techniques/caching_graph.py), or None
        self.controlnets = list(entry.controlnets)  # ControlNets built in (techniques/controlnet_graph.py)
        self.stop = read_stop_record(entry)  # adaptive stopping compiled in (techniques/stop.py)
        self.latent_channels = session.get_inputs()[0].shape[1]
        self.latent_rank = len(session.get_inputs()[0].shape)
        self.input_names = {i.name for i in session.get_inputs()}
        # read once here: tests wrap `session` in objects that only run
        self.output_names = [o.name for o in getattr(session, "get_outputs", list)()]
        # inputs with a default (the image inputs) are overridable initializers to ORT
        overridable = getattr(session, "get_overridable_initializers", None)
        self.input_names |= {i.name for i in (overridable() if overridable else [])}
        # graphs compiled before the clip columns (r, k) existed read 8 columns
        width = {i.name: i.shape for i in session.get_inputs()}.get("table", [None, len(COLUMNS)])[1]
        self.table_width = width if isinstance(width, int) else len(COLUMNS)

    def check(self, table: np.ndarray, latents: np.ndarray, noise: np.ndarray | None, steps: int) -> None:
        width = getattr(self, "table_width", len(COLUMNS))
        if table.ndim != 2 or table.shape[1] != width or table.dtype != np.float32:
            raise UserError(f"sampler table must be float32 of shape (N, {width}), got {table.dtype} {table.shape}")
        if steps < 1 or steps > table.shape[0]:
            raise UserError(f"step count must be in [1, {table.shape[0]}] (rows of the table), got {steps}")
        if self.form == "unrolled" and steps != self.steps:
            raise UserError(f"this unrolled graph runs exactly {self.steps} steps, got {steps}")
        fixed = self.latent_channels if isinstance(self.latent_channels, int) else None
        if latents.ndim != self.latent_rank or (fixed is not None and self.latent_rank == 4 and latents.shape[1] != fixed):
            raise UserError(f"latents must have {self.latent_rank} dims (batch, {self.latent_channels}, ...), "
                            f"got {latents.shape}")
        if noise is not None and (noise.ndim != self.latent_rank + 1 or noise.shape[1:] != latents.shape or noise.shape[0] < 1):
            raise UserError(f"noise must have shape (K, *{latents.shape}), got {noise.shape}")

    def feeds(self, table: SamplerTable, latents: np.ndarray, noise: np.ndarray | None, guidance: float,
              steps: int | None = None) -> dict[str, np.ndarray]:
        if table.host_only:
            raise UserError(f"{table.sampler} keeps a longer multistep history than the sampling graphs carry "
                            "(one D_prev): run it with the host loop (--loop host)")
        rows = np.ascontiguousarray(table.rows, dtype=np.float32)
        if self.table_width < rows.shape[1]:
            if np.any(rows[:, self.table_width:]):
                raise UserError(f"this sampling graph reads {self.table_width} table columns and cannot run "
                                f"{table.sampler} with clip_sample; recompile it with `onnxdiffusion compile-loop`")
            rows = np.ascontiguousarray(rows[:, :self.table_width])
        steps = table.num_steps if steps is None else steps
        latents = np.ascontiguousarray(latents, dtype=np.float32)
        self.check(rows, latents, noise, steps)
        if noise is None:
            noise = np.zeros((1, *latents.shape), np.float32)
        feeds = {
            "latents": latents,
            "table": rows,
            "init_scale": np.array(table.init_scale, np.float32),
            # the host loop skips guidance at scale <= 1 (cond only); u + 1*(c - u) is that
            "guidance": np.array(max(guidance, 1.0), np.float32),
            "noise": np.ascontiguousarray(noise, dtype=np.float32),
        }
        if self.form == "loop":
            feeds["steps"] = np.array(steps, np.int64)
        return feeds

    def check_image_inputs(self, start) -> None:
        """A run from a picture needs a graph compiled with the image inputs (start row, image latents, ...)."""
        if "start" not in self.input_names:
            raise UserError("this sampling graph predates image input (img2img, inpainting); recompile it with "
                            "`onnxdiffusion compile-loop`")
        if (start.extra is not None) != ("sample_extra" in self.input_names):
            raise UserError("this sampling graph and the backbone disagree on the inpainting channels; recompile it")

    def image_feeds(self, table: SamplerTable, start) -> tuple[SamplerTable, dict[str, np.ndarray]]:
        """(the full table with the start row made fresh, the image inputs) for a run from `start`."""
        from ..samplers.levels import cut_rows

        self.check_image_inputs(start)
        rows64 = cut_rows(table.rows64, start.start)
        full = SamplerTable(sampler=table.sampler, rows=rows64.astype(np.float32), init_scale=start.noise_level,
                            needs_noise=table.needs_noise, rows64=rows64, levels=table.levels)
        feeds = {"start": np.array(start.start, np.int64),
                 "image_latents": np.ascontiguousarray(start.image_latents, np.float32),
                 "image_scale": np.array(start.signal, np.float32)}
        if start.keep is not None:
            feeds["keep"] = np.ascontiguousarray(start.keep, np.float32)
            feeds["blend"] = np.ascontiguousarray(table.levels[1:], np.float32)  # blend[j]: row j + 1's level
        if start.extra is not None:
            feeds["sample_extra"] = np.ascontiguousarray(start.extra, np.float32)
        return full, feeds

    def run(self, table: SamplerTable, latents: np.ndarray, cond: dict[str, np.ndarray] | np.ndarray,
            uncond: dict[str, np.ndarray] | np.ndarray | None, guidance: float, noise: np.ndarray | None = None,
            steps: int | None = None, image=None, extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """The final latents: run_outputs' first output (see there)."""
        return next(iter(self.run_outputs(table, latents, cond, uncond, guidance, noise, steps, image,
                                          extra).values()))

    def run_outputs(self, table: SamplerTable, latents: np.ndarray, cond: dict[str, np.ndarray] | np.ndarray,
                    uncond: dict[str, np.ndarray] | np.ndarray | None, guidance: float, noise: np.ndarray | None = None,
                    steps: int | None = None, image=None, extra: dict[str, np.ndarray] | None = None
                    ) -> dict[str, np.ndarray]:
        """cond/uncond: the backbone's conditioning by input name (an array: encoder_hidden_states alone);
        uncond None for a graph without the guidance batch (guidance-distilled backbones). `image`: an
        ImageStart (runtime/image_input.py); `latents` stay the noise, `noise` has the cut table's rows.
        `extra`: more inputs by name (a run-time LoRA's tensors, techniques/lora.py)."""
        from ..loopgraph.builder import CONTEXT, cond_input_names

        image_inputs = {}
        if image is not None:
            table, image_inputs = self.image_feeds(table, image)
            steps = table.num_steps - image.start if steps is None else steps
        feeds = self.feeds(table, latents, noise, guidance, steps)
        feeds.update(image_inputs)
        if isinstance(cond, np.ndarray):
            cond, uncond = {CONTEXT: cond}, {CONTEXT: uncond}
        for name, value in cond.items():
            c, u = cond_input_names(name)
            feeds[c] = np.ascontiguousarray(value, dtype=np.float32)
            if u in self.input_names:
                if uncond is None:
                    raise UserError(f"this sampling graph runs guided: it needs unconditional {name!r}")
                feeds[u] = np.ascontiguousarray(uncond[name], dtype=np.float32)
        return dict(zip(self.output_names, self.session.run(None, {**feeds, **(extra or {})})))


def open_sampling_graph(pipe, form: str) -> SamplingGraph:
    """The folder's compiled sampling graph of this form, checked against this machine's CPU target."""
    from .cpu_target import target_mismatch
    from .loading import disabled

    forms = ("loop", "unrolled")
    if form not in forms:
        raise UserError(f"unknown loop form {form!r}; choose from host, {', '.join(forms)}")
    entry = pipe.manifest.components.get(f"sampler_{form}")
    if entry is None:
        raise UserError(f"{pipe.folder} has no '{form}' sampling graph (run `onnxdiffusion compile-loop --form {form}`)")
    if pipe.provider == "cpu" and (diff := target_mismatch(entry.tuned_for)):
        raise UserError(f"{pipe.folder}: the '{form}' graph was tuned for another CPU target ({diff}); "
                        f"recompile it here with `onnxdiffusion compile-loop --form {form}` or use the host loop")
    # ORT's disabled_optimizers do not reach subgraphs: with a backbone that runs without the NCHWc
    # rewrite, the sampling graph stops below the layout rewrites, or a float Conv inside the
    # schedule's If rounds differently from the host's sessions (Loop vs host 56 dB -> identical)
    level = "extended" if "NchwcTransformer" in (disabled(pipe.backbone_info) or []) else None
    session = pipe.component_session(f"sampler_{form}", level=level)
    return SamplingGraph(session, entry)
