"""Image and distribution metrics in pure numpy (no torch, no scipy).

- ``psnr``: peak signal-to-noise ratio in dB.
- ``ssim``: structural similarity (Wang et al. 2004): 11x11 Gaussian window with sigma 1.5,
  K1 = 0.01, K2 = 0.03, population (not sample) covariances, mean over the "valid" region
  (positions where the whole window lies inside the image), averaged over channels. This
  matches ``skimage.metrics.structural_similarity(a, b, gaussian_weights=True, sigma=1.5,
  use_sample_covariance=False, data_range=..., channel_axis=-1)``.
- ``frechet_distance`` / ``gaussian_stats``: the Frechet (2-Wasserstein) distance between
  two Gaussians fitted to feature sets, as in FID.
- ``relative_l2``: ||a - b|| / ||b||.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "psnr",
    "ssim",
    "gaussian_window",
    "frechet_distance",
    "gaussian_stats",
    "relative_l2",
]


def _pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {b.shape}")
    return a, b


def psnr(a, b, data_range: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB; ``inf`` when the arrays are identical."""
    a, b = _pair(a, b)
    mse = float(np.mean((a - b) ** 2))
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(float(data_range) ** 2 / mse)


def gaussian_window(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    """Normalised 1-D Gaussian taps (the 2-D window is their outer product)."""
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2.0
    w = np.exp(-0.5 * (x / sigma) ** 2)
    return w / w.sum()


def _filter_valid(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Separable 'valid' correlation of the two leading axes of x with the 1-D taps w."""
    k = len(w)
    h, wd = x.shape[0] - k + 1, x.shape[1] - k + 1
    rows = w[0] * x[0:h]
    for i in range(1, k):
        rows = rows + w[i] * x[i : i + h]
    out = w[0] * rows[:, 0:wd]
    for i in range(1, k):
        out = out + w[i] * rows[:, i : i + wd]
    return out


def ssim(
    a,
    b,
    data_range: float = 255.0,
    *,
    win_size: int = 11,
    sigma: float = 1.5,
    k1: float = 0.01,
    k2: float = 0.03,
) -> float:
    """Mean structural similarity of two images, HxW or HxWxC (uint8 or float).

    For colour images SSIM is computed per channel and averaged. Images must be at least
    ``win_size`` pixels in each spatial dimension.
    """
    a, b = _pair(a, b)
    if a.ndim == 2:
        a, b = a[..., None], b[..., None]
    if a.ndim != 3:
        raise ValueError(f"expected HxW or HxWxC images, got shape {a.shape}")
    if a.shape[0] < win_size or a.shape[1] < win_size:
        raise ValueError(f"images of {a.shape[:2]} are smaller than the {win_size}x{win_size} window")
    w = gaussian_window(win_size, sigma)
    c1 = (k1 * data_range) ** 2
    c2 = (k2 * data_range) ** 2
    mu_a = _filter_valid(a, w)
    mu_b = _filter_valid(b, w)
    var_a = _filter_valid(a * a, w) - mu_a * mu_a
    var_b = _filter_valid(b * b, w) - mu_b * mu_b
    cov = _filter_valid(a * b, w) - mu_a * mu_b
    num = (2.0 * mu_a * mu_b + c1) * (2.0 * cov + c2)
    den = (mu_a * mu_a + mu_b * mu_b + c1) * (var_a + var_b + c2)
    per_channel = (num / den).mean(axis=(0, 1))
    return float(per_channel.mean())


def gaussian_stats(features) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and unbiased covariance (D, D) of an (N, D) feature array (N >= 2)."""
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2:
        raise ValueError(f"expected (N, D) features, got shape {f.shape}")
    if f.shape[0] < 2:
        raise ValueError("need at least two feature vectors for a covariance")
    mu = f.mean(axis=0)
    sigma = np.cov(f, rowvar=False)
    return mu, np.atleast_2d(sigma)


def _sym(m: np.ndarray) -> np.ndarray:
    return 0.5 * (m + m.T)


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Frechet distance between N(mu1, sigma1) and N(mu2, sigma2).

    d^2 = |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1^1/2 S2 S1^1/2)^1/2).

    The trace term is computed from eigenvalues: S1^1/2 comes from ``eigh`` of S1 (negative
    round-off eigenvalues clipped to 0), and the trace of the square root of the symmetric
    PSD matrix S1^1/2 S2 S1^1/2 is the sum of the square roots of its (clipped)
    eigenvalues. This avoids the complex results and instabilities of ``sqrtm(S1 @ S2)`` on
    singular covariances. The result is clipped at 0.
    """
    mu1 = np.atleast_1d(np.asarray(mu1, dtype=np.float64))
    mu2 = np.atleast_1d(np.asarray(mu2, dtype=np.float64))
    s1 = np.atleast_2d(np.asarray(sigma1, dtype=np.float64))
    s2 = np.atleast_2d(np.asarray(sigma2, dtype=np.float64))
    d = mu1.shape[0]
    if mu1.shape != (d,) or mu2.shape != (d,) or s1.shape != (d, d) or s2.shape != (d, d):
        raise ValueError(
            f"inconsistent shapes: mu1 {mu1.shape}, sigma1 {s1.shape}, mu2 {mu2.shape}, sigma2 {s2.shape}"
        )
    s1, s2 = _sym(s1), _sym(s2)
    w, v = np.linalg.eigh(s1)
    s1_half = (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T
    m = _sym(s1_half @ s2 @ s1_half)
    tr_covmean = float(np.sqrt(np.clip(np.linalg.eigvalsh(m), 0.0, None)).sum())
    diff = mu1 - mu2
    value = float(diff @ diff) + float(np.trace(s1)) + float(np.trace(s2)) - 2.0 * tr_covmean
    return max(value, 0.0)


def relative_l2(a, b) -> float:
    """||a - b||_2 / ||b||_2 (b is the reference); 0 if both are zero, inf if only b is."""
    a, b = _pair(a, b)
    num = float(np.linalg.norm((a - b).ravel()))
    den = float(np.linalg.norm(b.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den
