"""The denoising backbone behind IO binding: buffers allocated once per generation, reused every step."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ..families.base import OUT, SAMPLE, TIMESTEP
from ..samplers import cfg_combine

Conditioning = dict[str, np.ndarray]  # backbone input name -> (batch, ...) array


def batch_conditioning(cond: Conditioning, uncond: Conditioning | None) -> Conditioning:
    """[uncond; cond] along the batch for every conditioning input (cond alone when unguided)."""
    if uncond is None:
        return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in cond.items()}
    return {k: np.ascontiguousarray(np.concatenate([uncond[k], v]), dtype=np.float32) for k, v in cond.items()}


class GuidedBackbone:
    """model_fn(x, t) for the sampler loop: one backbone call on [uncond; cond], then guidance.

    The sample, timestep and output buffers are bound to the session once; each step writes
    into them in place, so the loop allocates nothing per step on the CPU provider. `cond`
    (and `uncond`) hold every conditioning input of the family's backbone, by input name.
    """

    def __init__(self, session: ort.InferenceSession, latents_shape: tuple[int, ...], cond: Conditioning,
                 uncond: Conditioning | None, guidance: float):
        self.batch = latents_shape[0]
        self.guided = uncond is not None
        n = 2 * self.batch if self.guided else self.batch
        self.guidance = guidance
        self.sample = np.empty((n, *latents_shape[1:]), np.float32)
        self.timestep = np.empty((n,), np.float32)
        self.out = np.empty_like(self.sample)
        self.conditioning = batch_conditioning(cond, uncond)
        wanted = {i.name for i in session.get_inputs()} - {SAMPLE, TIMESTEP}
        if wanted != set(self.conditioning):
            raise ValueError(f"backbone wants conditioning {sorted(wanted)}, got {sorted(self.conditioning)}")
        self.session = session
        self.binding = session.io_binding()
        feeds = {SAMPLE: self.sample, TIMESTEP: self.timestep, **self.conditioning}
        for name, arr in feeds.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        self.binding.bind_ortvalue_output(OUT, ort.OrtValue.ortvalue_from_numpy(self.out))

    @property
    def context(self) -> np.ndarray:
        """The sequence conditioning (encoder_hidden_states), [uncond; cond]."""
        return self.conditioning["encoder_hidden_states"]

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

    def __init__(self, session: ort.InferenceSession, latents_shape: tuple[int, ...], cond: Conditioning,
                 uncond: Conditioning | None, guidance: float, device: str = "cuda", device_id: int = 0):
        self.batch = latents_shape[0]
        self.guided = uncond is not None
        n = 2 * self.batch if self.guided else self.batch
        self.guidance = guidance
        self.session = session
        self.host_sample = np.empty((n, *latents_shape[1:]), np.float32)
        self.host_timestep = np.empty((n,), np.float32)
        conditioning = batch_conditioning(cond, uncond)
        self.sample = ort.OrtValue.ortvalue_from_shape_and_type(self.host_sample.shape, np.float32, device, device_id)
        self.timestep = ort.OrtValue.ortvalue_from_shape_and_type(self.host_timestep.shape, np.float32, device, device_id)
        self.conditioning = {k: ort.OrtValue.ortvalue_from_numpy(v, device, device_id) for k, v in conditioning.items()}
        self.out = ort.OrtValue.ortvalue_from_shape_and_type(self.host_sample.shape, np.float32, device, device_id)
        self.binding = session.io_binding()
        for name, value in {SAMPLE: self.sample, TIMESTEP: self.timestep, **self.conditioning}.items():
            self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_ortvalue_output(OUT, self.out)

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
