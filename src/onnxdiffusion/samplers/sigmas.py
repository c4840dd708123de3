"""Sigma-grid shapes shared by diffusers' schedulers (Karras, exponential, beta) and log-sigma lookup.

Pure numpy: the beta distribution's quantile function, which diffusers takes from scipy, is
computed here by bisection on the regularized incomplete beta function (no scipy at run time).
"""

from __future__ import annotations

import math

import numpy as np

SIGMA_SHAPES = ("default", "karras", "exponential", "beta")


def karras(sigma_max: float, sigma_min: float, n: int, rho: float = 7.0) -> np.ndarray:
    ramp = np.linspace(0, 1, n)
    hi, lo = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def exponential(sigma_max: float, sigma_min: float, n: int) -> np.ndarray:
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), converges for x < (a+1)/(a+b+2)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h


def beta_cdf(x: float, a: float, b: float) -> float:
    """Regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def beta_ppf(q: float, a: float, b: float) -> float:
    """Quantile of the Beta(a, b) distribution, to float64 resolution (bisection: the cdf is monotone)."""
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def beta(sigma_max: float, sigma_min: float, n: int, alpha: float = 0.6, beta_: float = 0.6) -> np.ndarray:
    """"Beta Sampling is All You Need" grid, as diffusers' _convert_to_beta."""
    ppf = np.array([beta_ppf(float(t), alpha, beta_) for t in 1 - np.linspace(0, 1, n)])
    return sigma_min + ppf * (sigma_max - sigma_min)


SHAPES = {"karras": karras, "exponential": exponential, "beta": beta}


def reshape(shape: str, in_sigmas: np.ndarray, n: int, sigma_min: float | None = None,
            sigma_max: float | None = None) -> np.ndarray:
    """Replace a descending sigma grid by `shape`'s n sigmas between its ends (or the given bounds)."""
    lo = float(in_sigmas[-1]) if sigma_min is None else float(sigma_min)
    hi = float(in_sigmas[0]) if sigma_max is None else float(sigma_max)
    return SHAPES[shape](hi, lo, n)


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timestep of each sigma: linear interpolation in log sigma (diffusers' _sigma_to_t)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, None]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    lo, hi = log_sigmas[low], log_sigmas[low + 1]
    w = np.clip((lo - log_sigma) / (lo - hi), 0, 1)
    return ((1 - w) * low + w * (low + 1)).reshape(np.shape(sigmas))
