import os

os.environ["HF_HUB_OFFLINE"] = "1"

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from onnxdiffusion.evaluate.metrics import (  # noqa: E402
    frechet_distance,
    gaussian_stats,
    gaussian_window,
    psnr,
    relative_l2,
    ssim,
)


def _smooth_image(seed: int = 0, size: int = 48) -> np.ndarray:
    """A textured uint8 RGB image (random blobs plus gradients)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    img = np.zeros((size, size, 3))
    for c in range(3):
        img[..., c] = 60 + 40 * np.sin(xx / (3 + c)) + 30 * np.cos(yy / (4 + c))
        for _ in range(6):
            cy, cx, r = rng.uniform(0, size, 2).tolist() + [rng.uniform(3, 9)]
            img[..., c] += rng.uniform(-80, 120) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
    return np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------- PSNR


def test_psnr_constant_difference_of_one():
    a = np.zeros((8, 8, 3), np.uint8)
    b = np.ones((8, 8, 3), np.uint8)
    # 10 log10(255^2 / 1) = 48.1308 dB
    assert psnr(a, b) == pytest.approx(20 * math.log10(255.0), abs=1e-9)
    assert psnr(a, b) == pytest.approx(48.1308, abs=1e-4)


def test_psnr_known_values():
    a = np.zeros((4, 4), np.uint8)
    assert psnr(a, np.full((4, 4), 255, np.uint8)) == pytest.approx(0.0, abs=1e-12)
    # MSE = (0^2 + 2^2) / 2 = 2 -> 10 log10(255^2 / 2)
    assert psnr(np.array([0, 0]), np.array([0, 2])) == pytest.approx(10 * math.log10(255.0**2 / 2))
    # float images on a unit range: MSE 0.01 -> 20 dB
    x = np.zeros((5, 5, 3))
    assert psnr(x, x + 0.1, data_range=1.0) == pytest.approx(20.0)


def test_psnr_identical_is_inf_and_uint8_does_not_wrap():
    img = _smooth_image()
    assert psnr(img, img) == math.inf
    # uint8 subtraction would wrap around; the result must match the float computation.
    a, b = np.array([[10]], np.uint8), np.array([[250]], np.uint8)
    assert psnr(a, b) == pytest.approx(10 * math.log10(255.0**2 / 240.0**2))


def test_psnr_shape_mismatch():
    with pytest.raises(ValueError):
        psnr(np.zeros((4, 4)), np.zeros((4, 5)))


# ---------------------------------------------------------------- SSIM


def _ssim_bruteforce(a: np.ndarray, b: np.ndarray, data_range: float = 255.0) -> float:
    """Direct definition: full 2-D 11x11 Gaussian window at every valid position."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    g = gaussian_window(11, 1.5)
    w2 = np.outer(g, g)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    vals = []
    for c in range(a.shape[2]):
        s = []
        for i in range(a.shape[0] - 10):
            for j in range(a.shape[1] - 10):
                pa, pb = a[i : i + 11, j : j + 11, c], b[i : i + 11, j : j + 11, c]
                ma, mb = (w2 * pa).sum(), (w2 * pb).sum()
                va = (w2 * (pa - ma) ** 2).sum()
                vb = (w2 * (pb - mb) ** 2).sum()
                cov = (w2 * (pa - ma) * (pb - mb)).sum()
                s.append(((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))
        vals.append(np.mean(s))
    return float(np.mean(vals))


def test_gaussian_window():
    w = gaussian_window(11, 1.5)
    assert w.shape == (11,)
    assert w.sum() == pytest.approx(1.0)
    assert np.allclose(w, w[::-1])
    assert w[5] / w[6] == pytest.approx(math.exp(0.5 / 1.5**2))


def test_ssim_identical_is_one():
    img = _smooth_image()
    assert ssim(img, img) == pytest.approx(1.0, abs=1e-12)
    assert ssim(img[..., 0], img[..., 0]) == pytest.approx(1.0, abs=1e-12)


def test_ssim_constant_images_closed_form():
    # Zero variance: SSIM = (2ab + C1) / (a^2 + b^2 + C1) with C1 = (0.01 * 255)^2.
    a = np.full((16, 16, 3), 100, np.uint8)
    b = np.full((16, 16, 3), 120, np.uint8)
    c1 = (0.01 * 255) ** 2
    assert ssim(a, b) == pytest.approx((2 * 100 * 120 + c1) / (100**2 + 120**2 + c1), rel=1e-12)


def test_ssim_matches_bruteforce_definition():
    a = _smooth_image(1, 20)
    b = np.clip(a.astype(int) + np.random.default_rng(2).integers(-30, 31, a.shape), 0, 255).astype(np.uint8)
    assert ssim(a, b) == pytest.approx(_ssim_bruteforce(a, b), rel=1e-10)


def test_ssim_shifted_and_inverted():
    img = _smooth_image()
    shifted = np.roll(img, 2, axis=1)
    inverted = 255 - img
    s_shift = ssim(img, shifted)
    s_inv = ssim(img, inverted)
    assert s_shift < 0.99
    assert s_inv < 0.0 < s_shift
    assert s_inv < s_shift - 0.5
    assert ssim(img, shifted) == pytest.approx(ssim(shifted, img))  # symmetric


def test_ssim_float_and_uint8_agree():
    img = _smooth_image()
    other = np.roll(img, 1, axis=0)
    assert ssim(img.astype(np.float32) / 255, other.astype(np.float32) / 255, data_range=1.0) == pytest.approx(
        ssim(img, other), rel=1e-5
    )


def test_ssim_matches_skimage():
    metrics = pytest.importorskip("skimage.metrics")
    a = _smooth_image(3)
    b = np.clip(a.astype(int) + np.random.default_rng(4).integers(-25, 26, a.shape), 0, 255).astype(np.uint8)
    ref = metrics.structural_similarity(
        a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=255, channel_axis=-1
    )
    assert ssim(a, b) == pytest.approx(ref, abs=1e-6)


def test_ssim_too_small():
    with pytest.raises(ValueError):
        ssim(np.zeros((8, 8, 3)), np.zeros((8, 8, 3)))


# ---------------------------------------------------------------- Frechet distance


def _random_spd(d: int, seed: int) -> np.ndarray:
    m = np.random.default_rng(seed).normal(size=(d, d))
    return m @ m.T / d + 0.1 * np.eye(d)


def test_frechet_identical_is_zero():
    mu = np.random.default_rng(0).normal(size=16)
    sigma = _random_spd(16, 1)
    assert frechet_distance(mu, sigma, mu, sigma) == pytest.approx(0.0, abs=1e-8)


def test_frechet_shifted_mean_is_squared_norm():
    sigma = _random_spd(8, 2)
    mu1 = np.zeros(8)
    shift = np.arange(8, dtype=float) / 3
    assert frechet_distance(mu1, sigma, mu1 + shift, sigma) == pytest.approx(float(shift @ shift), abs=1e-8)


def test_frechet_diagonal_closed_form():
    a = np.array([1.0, 4.0, 0.25, 9.0])
    b = np.array([4.0, 1.0, 0.25, 0.0])
    mu1, mu2 = np.array([0.0, 1.0, 0.0, 2.0]), np.array([1.0, 1.0, 0.0, 0.0])
    expected = float(((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum())
    assert expected == pytest.approx(1 + 4 + 1 + 1 + 0 + 9)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, abs=1e-10)


def test_frechet_one_dimensional():
    # N(0, 4) vs N(3, 1): 9 + (2 - 1)^2 = 10
    assert frechet_distance([0.0], [[4.0]], [3.0], [[1.0]]) == pytest.approx(10.0)


def test_frechet_general_matches_sqrtm_and_is_symmetric():
    s1, s2 = _random_spd(6, 3), _random_spd(6, 4)
    mu1, mu2 = np.ones(6), np.zeros(6)
    d12 = frechet_distance(mu1, s1, mu2, s2)
    assert d12 == pytest.approx(frechet_distance(mu2, s2, mu1, s1), rel=1e-9)
    # Reference via an eigen-decomposition of S1 S2 (similar to a symmetric PSD matrix).
    tr_covmean = np.sqrt(np.linalg.eigvals(s1 @ s2).real.clip(0)).sum()
    ref = 6 + np.trace(s1) + np.trace(s2) - 2 * tr_covmean
    assert d12 == pytest.approx(ref, rel=1e-9)
    linalg = pytest.importorskip("scipy.linalg")
    ref2 = 6 + np.trace(s1) + np.trace(s2) - 2 * np.trace(linalg.sqrtm(s1 @ s2).real)
    assert d12 == pytest.approx(ref2, rel=1e-7)


def test_frechet_singular_covariances():
    # Rank-deficient covariances (fewer samples than dimensions) stay finite and non-negative.
    rng = np.random.default_rng(5)
    f1, f2 = rng.normal(size=(10, 32)), rng.normal(size=(10, 32)) + 0.5
    d = frechet_distance(*gaussian_stats(f1), *gaussian_stats(f2))
    assert np.isfinite(d) and d > 0
    assert frechet_distance(*gaussian_stats(f1), *gaussian_stats(f1)) == pytest.approx(0.0, abs=1e-8)


def test_frechet_shape_mismatch():
    with pytest.raises(ValueError):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


def test_gaussian_stats():
    f = np.random.default_rng(6).normal(size=(200, 5)) * np.array([1, 2, 3, 4, 5]) + 7
    mu, sigma = gaussian_stats(f)
    assert mu.shape == (5,) and sigma.shape == (5, 5)
    assert np.allclose(mu, f.mean(0))
    assert np.allclose(sigma, np.cov(f, rowvar=False))
    # unbiased (N - 1) normalisation
    assert sigma[0, 0] == pytest.approx(((f[:, 0] - f[:, 0].mean()) ** 2).sum() / 199)
    mu1, sigma1 = gaussian_stats(f[:, :1])
    assert mu1.shape == (1,) and sigma1.shape == (1, 1)
    with pytest.raises(ValueError):
        gaussian_stats(f[:1])


# ---------------------------------------------------------------- relative L2


def test_relative_l2():
    b = np.array([3.0, 4.0])
    assert relative_l2(b, b) == 0.0
    assert relative_l2(b * 1.1, b) == pytest.approx(0.1)
    assert relative_l2(np.array([3.0, 5.0]), b) == pytest.approx(1 / 5)
    assert relative_l2(np.zeros(2), b) == pytest.approx(1.0)
    assert relative_l2(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_l2(np.ones(3), np.zeros(3)) == math.inf
    assert relative_l2(np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32)) == pytest.approx(0.5)
