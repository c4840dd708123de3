"""Sampler rows for rectified-flow schedules (x = (1 - sigma) x0 + sigma noise).

The backbone predicts a velocity v = noise - x0, so the denoiser is D = x - sigma * v:
p = 1, q = -sigma in every row.  The model sees x unscaled (c_in = 1) and the timestep
sigma * num_train_timesteps; the loop starts from the noise itself (init_scale = 1).
"""

from __future__ import annotations

import numpy as np

from ..schedules import FlowSchedule


def flow_euler(sched: FlowSchedule, s: np.ndarray):
    """FlowMatchEulerDiscreteScheduler: x' = x + (s' - s) v == (s'/s) x + (1 - s'/s) D."""
    n = len(s)
    s_next = np.append(s[1:], 0.0)
    a = s_next / s
    zeros, ones = np.zeros(n), np.ones(n)
    return np.stack([sched.timesteps(s), ones, ones, -s, a, 1.0 - a, zeros, zeros], axis=1), 1.0
