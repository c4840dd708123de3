"""The denoising backbone behind IO binding: host buffers allocated once per generation and reused every
step; device buffers allocated once per pipeline and input shapes and reused by every generation."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort

from ..families.base import OUT, SAMPLE, TIMESTEP
from ..families.latents import channel_axis
from ..samplers import cfg_combine
from .static_shapes import session_for

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
                 uncond: Conditioning | None, guidance: float, rescale: bool = False,
                 extra: np.ndarray | None = None, inputs: Conditioning | None = None):
        self.batch = latents_shape[0]
        self.guided = uncond is not None
        n = 2 * self.batch if self.guided else self.batch
        self.guidance = guidance
        self.rescale = rescale
        # extra: input channels after the latents' (a 9-channel inpainting UNet's mask + masked-image
        # latents, Flux Fill's on the token channels), the same every step: written once into the sample buffer
        axis = channel_axis(len(latents_shape))
        shape = list(latents_shape)
        shape[0] = n
        shape[axis] += 0 if extra is None else extra.shape[axis]
        self.sample = np.empty(shape, np.float32)
        # the sample's latents part: x is written there every step
        self.latent_part = (slice(None),) * axis + (slice(0, latents_shape[axis]),)
        if extra is not None:
            self.sample[(slice(None),) * axis + (slice(latents_shape[axis], None),)] = \
                np.concatenate([extra, extra]) if self.guided else extra
        self.timestep = np.empty((n,), np.float32)
        self.out = np.empty((n, *latents_shape[1:]), np.float32)
        # inputs: more backbone inputs on the whole batch (ControlNet residuals), bound as they are: their
        # owner rewrites them in place between steps; a function of the batch's conditioning where their
        # shapes follow it (residuals over the text tokens)
        batched = batch_conditioning(cond, uncond)
        self.conditioning = {**batched, **((inputs(batched) if callable(inputs) else inputs) or {})}
        wanted = {i.name for i in session.get_inputs()} - {SAMPLE, TIMESTEP}
        if wanted != set(self.conditioning):
            raise ValueError(f"backbone wants conditioning {sorted(wanted)}, got {sorted(self.conditioning)}")
        feeds = {SAMPLE: self.sample, TIMESTEP: self.timestep, **self.conditioning}
        self.session = session = session_for(session, {k: v.shape for k, v in feeds.items()})
        self.binding = session.io_binding()
        for name, arr in feeds.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        self.binding.bind_ortvalue_output(OUT, ort.OrtValue.ortvalue_from_numpy(self.out))

    @property
    def context(self) -> np.ndarray:
        """The sequence conditioning (encoder_hidden_states), [uncond; cond]."""
        return self.conditioning["encoder_hidden_states"]

    def __call__(self, x: np.ndarray, t: float) -> np.ndarray:
        b, part = self.batch, self.latent_part[1:]
        self.sample[(slice(0, b), *part)] = x
        if self.guided:
            self.sample[(slice(b, None), *part)] = x
        self.timestep.fill(t)
        self.session.run_with_iobinding(self.binding)
        if not self.guided:
            return self.out.copy()
        return cfg_combine(self.out[:b], self.out[b:], self.guidance, rescale=self.rescale)


class FedBackbone(GuidedBackbone):
    """GuidedBackbone whose IO binding also holds a LoRA adapter's tensors (adapters/runtime.py), bound once as
    OrtValues over the adapter's own arrays: nothing is converted or copied per step."""

    def __init__(self, session, latents_shape, cond, uncond, guidance: float, rescale: bool = False,
                 extra: dict[str, np.ndarray] | None = None):
        super().__init__(session, latents_shape, cond, uncond, guidance, rescale)
        # float32 A/B, or a fused backbone's merged weights in their own types (int8, int32 bias)
        self.adapter = {name: np.ascontiguousarray(arr) for name, arr in (extra or {}).items()}
        for name, arr in self.adapter.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))


class DeviceBuffers:
    """The backbone's inputs and output as OrtValues in device memory, bound once to one IO binding.

    A captured CUDA graph replays the device addresses it was captured with, so these buffers are
    never re-allocated: every call writes new values into them in place. Each set carries its own
    CUDA graph id (ORT's `gpu_graph_id` run option), so sets of different shapes each capture and
    replay their own graph.
    """

    def __init__(self, session: ort.InferenceSession, shapes: dict[str, tuple[int, ...]], device: str, device_id: int,
                 graph_id: int):
        self.values = {name: ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, device, device_id)
                       for name, shape in shapes.items()}
        self.binding = session.io_binding()
        for name, value in self.values.items():
            if name == OUT:
                self.binding.bind_ortvalue_output(name, value)
            else:
                self.binding.bind_ortvalue_input(name, value)
        self.graph_id = graph_id
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.in_use = False

    def addresses(self) -> dict[str, int]:
        return {name: v.data_ptr() for name, v in self.values.items()}


class DevicePool:
    """Bound device buffers by (session, device, input shapes): allocated on first use, reused by every
    later generation of the same shapes (one per pipeline). A set is lent to one generation at a time;
    a concurrent generation of the same shapes gets a set (and a graph id) of its own."""

    def __init__(self) -> None:
        self._sets: dict[tuple, list[DeviceBuffers]] = {}
        self._sessions: dict[int, ort.InferenceSession] = {}  # keeps each keyed session alive: its id stays unique
        self._lock = threading.Lock()
        self._next_id = 0

    def acquire(self, session: ort.InferenceSession, shapes: dict[str, tuple[int, ...]], device: str,
                device_id: int) -> DeviceBuffers:
        key = (id(session), device, device_id, tuple(sorted(shapes.items())))
        with self._lock:
            self._sessions[id(session)] = session
            for buffers in self._sets.setdefault(key, []):
                if not buffers.in_use:
                    buffers.in_use = True
                    return buffers
            buffers = DeviceBuffers(session, shapes, device, device_id, self._next_id)
            self._next_id += 1
            buffers.in_use = True
            self._sets[key].append(buffers)
            return buffers

    def release(self, buffers: DeviceBuffers) -> None:
        with self._lock:
            buffers.in_use = False

    def __len__(self) -> int:
        return sum(len(v) for v in self._sets.values())


class DeviceBackbone:
    """GuidedBackbone with its inputs and output in the provider's device memory (a profile's
    `io_binding: device`).

    The bound OrtValues come from `pool` (the pipeline's): allocated once per input shapes and
    reused by later generations with new values written in place, so their addresses never change
    and a CUDA graph the provider captured on an earlier call replays on the right inputs. Without
    a pool, the buffers are this object's own. Each step copies x in and the output out; the
    sampler update stays in numpy (the compiled Loop form, `loop: loop`, keeps the latents on the
    device for the whole loop instead). `close()` hands the buffers back to the pool.
    """

    def __init__(self, session: ort.InferenceSession, latents_shape: tuple[int, ...], cond: Conditioning,
                 uncond: Conditioning | None, guidance: float, rescale: bool = False, device: str = "cuda",
                 device_id: int = 0, pool: DevicePool | None = None):
        self.batch = latents_shape[0]
        self.guided = uncond is not None
        n = 2 * self.batch if self.guided else self.batch
        self.guidance = guidance
        self.rescale = rescale
        self.session = session
        self.host_sample = np.empty((n, *latents_shape[1:]), np.float32)
        self.host_timestep = np.empty((n,), np.float32)
        conditioning = batch_conditioning(cond, uncond)
        shapes = {SAMPLE: self.host_sample.shape, TIMESTEP: self.host_timestep.shape, OUT: self.host_sample.shape,
                  **{k: v.shape for k, v in conditioning.items()}}
        self.pool = pool if pool is not None else DevicePool()  # (an empty pool is falsy)
        self.buffers = self.pool.acquire(session, shapes, device, device_id)
        values = self.buffers.values
        self.sample, self.timestep, self.out = values[SAMPLE], values[TIMESTEP], values[OUT]
        self.conditioning = {k: values[k] for k in conditioning}
        for k, v in conditioning.items():
            values[k].update_inplace(v)
        self.binding = self.buffers.binding

    def __call__(self, x: np.ndarray, t: float) -> np.ndarray:
        if self.buffers is None:
            raise RuntimeError("DeviceBackbone called after close()")
        b = self.batch
        self.host_sample[:b] = x
        if self.guided:
            self.host_sample[b:] = x
        self.host_timestep.fill(t)
        self.sample.update_inplace(self.host_sample)
        self.timestep.update_inplace(self.host_timestep)
        self.session.run_with_iobinding(self.binding, self.buffers.run_options)
        out = self.out.numpy()
        if not self.guided:
            return out
        return cfg_combine(out[:b], out[b:], self.guidance, rescale=self.rescale)

    def close(self) -> None:
        if self.buffers is not None:
            self.pool.release(self.buffers)
            self.buffers = None

    def __del__(self) -> None:  # a generation abandoned without close() still hands its buffers back
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
