"""diffusers' second-order flow schedulers driven on the sigmas Flux / Qwen-Image hand their scheduler.

FluxPipeline and QwenImagePipeline call ``scheduler.set_timesteps(sigmas=linspace(1, 1/N, N), mu=mu)``.
diffusers' FlowMatchHeunDiscreteScheduler.set_timesteps takes neither (static shift on its own grid) and
DPMSolverMultistepScheduler's takes mu but no sigmas (its own flow grid), so neither runs in those
pipelines as shipped. `generate --sampler flow_heun|dpmpp_2m` on such a folder runs the Heun / DPM-Solver++
update on the schedule the pipeline would use with its own scheduler: diffusers' FlowMatchEulerDiscreteScheduler
sigmas for those base sigmas and mu (dynamic / static shift, shift_terminal, time-shift type).

The twins here make that comparable with diffusers' own code: set_timesteps asks diffusers'
FlowMatchEulerDiscreteScheduler for the step sigmas (with the pipeline's sigmas and mu), then lays them out
exactly as the scheduler's own set_timesteps does; step() is diffusers' unchanged. Where diffusers' own
set_timesteps applies (its own grid, static shift) the twins reproduce it (tests/families/test_flow_families.py).
"""

from __future__ import annotations

import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler


def flowmatch_sigmas(config, num_inference_steps, device, sigmas, mu) -> torch.Tensor:
    """Step sigmas (float32, without the final 0) of diffusers' FlowMatchEulerDiscreteScheduler."""
    euler = FlowMatchEulerDiscreteScheduler.from_config(config)
    euler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu)
    return euler.sigmas[:-1].to(torch.float32)


class HeunOnPipelineSigmas(FlowMatchHeunDiscreteScheduler):
    flow_config: dict = {}

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
        s = flowmatch_sigmas(self.flow_config, num_inference_steps, device, sigmas, mu)
        # the rest is FlowMatchHeunDiscreteScheduler.set_timesteps (diffusers 0.39) after its sigma computation
        self.num_inference_steps = len(s)
        ts = s * self.config.num_train_timesteps
        self.timesteps = torch.cat([ts[:1], ts[1:].repeat_interleave(2)]).to(device=device)
        s = torch.cat([s, torch.zeros(1, device=s.device)])
        self.sigmas = torch.cat([s[:1], s[1:-1].repeat_interleave(2), s[-1:]])
        self.prev_derivative = None
        self.dt = None
        self._step_index = None
        self._begin_index = None


class DPMOnPipelineSigmas(DPMSolverMultistepScheduler):
    """DPM-Solver++ with flow sigmas. FluxPipeline drops its sigmas for a scheduler whose config says
    use_flow_sigmas (it then runs DPM's own grid with flow_shift = exp(mu), a different schedule from the
    folder's); so the twin's config leaves use_flow_sigmas off and its alpha/sigma are the use_flow_sigmas
    branch of diffusers' own _sigma_to_alpha_sigma_t, the only other place the option is read."""

    flow_config: dict = {}

    def _sigma_to_alpha_sigma_t(self, sigma):
        return 1 - sigma, sigma

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
        s = flowmatch_sigmas(self.flow_config, num_inference_steps, device, sigmas, mu)
        # the rest is DPMSolverMultistepScheduler.set_timesteps (diffusers 0.39) after its sigma computation, with
        # final_sigmas_type "zero"; the timesteps the model sees are the flow-match ones (not truncated to int)
        assert self.config.final_sigmas_type == "zero"
        self.sigmas = torch.cat([s.cpu(), torch.zeros(1)])
        self.timesteps = (s * self.config.num_train_timesteps).to(device=device)
        self.num_inference_steps = len(s)
        self.model_outputs = [None] * self.config.solver_order
        self.lower_order_nums = 0
        self._step_index = None
        self._begin_index = None


def driven(sampler: str, config):
    """The twin of `sampler` on a flow folder whose pipeline passes sigmas (see the module docstring)."""
    if sampler == "flow_heun":
        twin = HeunOnPipelineSigmas.from_config(config)
    else:  # dpmpp_2m on a flow folder: what onnxdiffusion.samplers.config.resolve configures
        twin = DPMOnPipelineSigmas.from_config(config, prediction_type="flow_prediction", use_flow_sigmas=False,
                                               algorithm_type="dpmsolver++", solver_order=2)
    twin.flow_config = dict(config)
    return twin
