"""DPM-Solver++ rows (1st/2nd order, midpoint/heun, ODE or SDE) for any (alpha, sigma) grid.

The state is x = alpha x0 + sigma noise; ``alpha``/``sigma`` hold each step's values and
``alpha_next``/``sigma_next`` the values it steps to (sigma_next = 0 lands on x = D).
The multistep history is the previous row's D, carried by the ``d`` column.
"""

from __future__ import annotations

import numpy as np

SOLVER_TYPES = ("midpoint", "heun")


def dpmpp_rows(alpha, sigma, alpha_next, sigma_next, second: np.ndarray, solver_type: str = "midpoint",
               sde: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(a, c, d, e) per step; `second[i]` selects the 2nd-order update (needs i >= 1)."""
    with np.errstate(divide="ignore"):
        lam = np.log(alpha) - np.log(sigma)
        lam_next = np.log(alpha_next) - np.log(sigma_next)  # +inf when sigma_next == 0
    h = lam_next - lam
    ratio = sigma_next / sigma
    if sde:
        decay = np.exp(-h)
        a = ratio * decay
        c1 = -alpha_next * np.expm1(-2.0 * h)
        e = sigma_next * np.sqrt(-np.expm1(-2.0 * h))
        with np.errstate(divide="ignore", invalid="ignore"):
            heun = alpha_next * (np.expm1(-2.0 * h) / (2.0 * h) + 1.0)
    else:
        a = ratio
        c1 = -alpha_next * np.expm1(-h)
        e = np.zeros_like(a)
        with np.errstate(divide="ignore", invalid="ignore"):
            heun = alpha_next * (np.expm1(-h) / h + 1.0)
    c2 = 0.5 * c1 if solver_type == "midpoint" else heun
    c, d = c1.copy(), np.zeros_like(a)
    for i in np.flatnonzero(second & (h != 0)):  # h == 0 (a repeated sigma): the step is x' = x
        r = (lam[i] - lam[i - 1]) / h[i]  # D1 = (D - D_prev) / r
        c[i], d[i] = c1[i] + c2[i] / r, -c2[i] / r
    return a, c, d, e


def second_order_mask(n: int, solver_order: int, lower_order_final: bool, euler_at_final: bool,
                      final_zero: bool) -> np.ndarray:
    """Which steps DPMSolverMultistepScheduler.step takes at 2nd order (its lower_order_final rules)."""
    if solver_order not in (1, 2):
        raise ValueError(f"solver_order={solver_order!r} is not reproduced by DPM-Solver++; use 1 or 2")
    second = np.arange(n) >= 1
    if solver_order == 1:
        second[:] = False
    if n >= 1 and (euler_at_final or (lower_order_final and n < 15) or final_zero):
        second[-1] = False
    return second
