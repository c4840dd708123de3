"""Running a compiled sampling graph (Loop or unrolled): inputs checked before ONNX Runtime sees them."""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..samplers import COLUMNS, SamplerTable


class SamplingGraph:
    def __init__(self, session, info: dict):
        self.session = session
        self.form = info["form"]
        self.steps = info.get("steps")
        self.whole = bool(info.get("whole"))
        self.latent_channels = session.get_inputs()[0].shape[1]
        self.latent_rank = len(session.get_inputs()[0].shape)
        self.input_names = {i.name for i in session.get_inputs()}
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

    def run(self, table: SamplerTable, latents: np.ndarray, cond: dict[str, np.ndarray] | np.ndarray,
            uncond: dict[str, np.ndarray] | np.ndarray | None, guidance: float, noise: np.ndarray | None = None,
            steps: int | None = None, extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """cond/uncond: the backbone's conditioning by input name (an array: encoder_hidden_states alone);
        uncond None for a graph without the guidance batch (guidance-distilled backbones). `extra`: more
        inputs by name (a run-time LoRA's tensors, adapters/graph.py)."""
        from ..samplers.graph import CONTEXT, cond_input_names

        feeds = self.feeds(table, latents, noise, guidance, steps)
        if isinstance(cond, np.ndarray):
            cond, uncond = {CONTEXT: cond}, {CONTEXT: uncond}
        for name, value in cond.items():
            c, u = cond_input_names(name)
            feeds[c] = np.ascontiguousarray(value, dtype=np.float32)
            if u in self.input_names:
                if uncond is None:
                    raise UserError(f"this sampling graph runs guided: it needs unconditional {name!r}")
                feeds[u] = np.ascontiguousarray(uncond[name], dtype=np.float32)
        return self.session.run(None, {**feeds, **(extra or {})})[0]
