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


class DeviceBackbone:
    """GuidedBackbone with its inputs and output in the provider's device memory (a profile's
    `io_binding: device`).

    The OrtValues are allocated and bound once, so their addresses never change: that is what lets
    the CUDA provider capture the call as a CUDA graph on the first run and replay it. Each step
    copies x in and the output out; the sampler update stays in numpy (the compiled Loop form,
    `loop: loop`, keeps the latents on the device for the whole loop instead).
    """

    def __init__(self, session: ort.InferenceSession, latents_shape: tuple[int, ...], cond: np.ndarray,
                 uncond: np.ndarray | None, guidance: float, device: str = "cuda", device_id: int = 0):
        self.batch = latents_shape[0]
        self.guided = uncond is not None
        n = 2 * self.batch if self.guided else self.batch
        self.guidance = guidance
        self.session = session
        self.host_sample = np.empty((n, *latents_shape[1:]), np.float32)
        self.host_timestep = np.empty((n,), np.float32)
        context = np.ascontiguousarray(np.concatenate([uncond, cond]) if self.guided else cond, dtype=np.float32)
        self.sample = ort.OrtValue.ortvalue_from_shape_and_type(self.host_sample.shape, np.float32, device, device_id)
        self.timestep = ort.OrtValue.ortvalue_from_shape_and_type(self.host_timestep.shape, np.float32, device, device_id)
        self.context = ort.OrtValue.ortvalue_from_numpy(context, device, device_id)
        self.out = ort.OrtValue.ortvalue_from_shape_and_type(self.host_sample.shape, np.float32, device, device_id)
        self.binding = session.io_binding()
        for name, value in (("sample", self.sample), ("timestep", self.timestep), ("encoder_hidden_states", self.context)):
            self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_ortvalue_output("out_sample", self.out)

    def __call__(self, x: np.ndarray, t: float) -> np.ndarray:
        b = self.batch
        self.host_sample[:b] = x
        if self.guided:
            self.host_sample[b:] = x
        self.host_timestep.fill(t)
        self.sample.update_inplace(self.host_sample)
        self.timestep.update_inplace(self.host_timestep)
        self.session.run_with_iobinding(self.binding)
        out = self.out.numpy()
        if not self.guided:
            return out
        return cfg_combine(out[:b], out[b:], self.guidance)
