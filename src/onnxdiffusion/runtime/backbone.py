"""The denoising backbone behind IO binding: buffers allocated once per generation, reused every step."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ..samplers import cfg_combine


class GuidedBackbone:
    """model_fn(x, t) for the sampler loop: one UNet call on [uncond; cond], then guidance.

    The sample, timestep and output buffers are bound to the session once; each step writes
    into them in place, so the loop allocates nothing per step on the CPU provider.
    """

    def __init__(self, session: ort.InferenceSession, latents_shape: tuple[int, ...], cond: np.ndarray,
                 uncond: np.ndarray | None, guidance: float):
        self.batch = latents_shape[0]
        self.guided = uncond is not None
        n = 2 * self.batch if self.guided else self.batch
        self.guidance = guidance
        self.sample = np.empty((n, *latents_shape[1:]), np.float32)
        self.timestep = np.empty((n,), np.float32)
        self.out = np.empty_like(self.sample)
        self.context = np.ascontiguousarray(np.concatenate([uncond, cond]) if self.guided else cond, dtype=np.float32)
        self.session = session
        self.binding = session.io_binding()
        for name, arr in (("sample", self.sample), ("timestep", self.timestep), ("encoder_hidden_states", self.context)):
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        self.binding.bind_ortvalue_output("out_sample", ort.OrtValue.ortvalue_from_numpy(self.out))

    def __call__(self, x: np.ndarray, t: float) -> np.ndarray:
        b = self.batch
        self.sample[:b] = x
        if self.guided:
            self.sample[b:] = x
        self.timestep.fill(t)
        self.session.run_with_iobinding(self.binding)
        if not self.guided:
            return self.out.copy()
        return cfg_combine(self.out[:b], self.out[b:], self.guidance)
