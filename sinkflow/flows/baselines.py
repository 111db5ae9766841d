"""Simple density models for images, scored with the flows' bits/dim convention (docs/flows.md).

Every model here is a density on the dequantised cube ``[0, n_bins)^D`` (pixel levels ``k`` plus ``U[0, 1)``),
and its score is the expected negative log-density per dimension in bits over the dequantisation noise, on
the same scale as :func:`sinkflow.flows.bits_per_dim`. So the three are directly comparable with a flow:

- ``uniform_bpd``: the uniform density, ``log2(n_bins)``.
- ``independent_pixel_bpd``: a per-pixel categorical (add-one smoothed histograms of the fitting images).
  As a dequantised density it is piecewise constant on each bin, so its dequantised and discrete code
  lengths coincide exactly.
- ``gaussian_bpd``: a full-covariance Gaussian fitted to the dequantised fitting images, in closed form. The
  maximum-likelihood fit to ``k + u`` (``u ~ U[0, 1)^D`` independent of ``k``), in the limit of infinitely
  many noise draws, is mean ``E[k] + 1/2`` and covariance ``Cov[k] + I/12``; the expected score of a test
  image ``k`` over its noise is ``1/2 [D log 2 pi + log det S + (k + 1/2 - m)^T S^-1 (k + 1/2 - m)
  + tr(S^-1)/12]`` nats. No noise is drawn, so the number is exact.

Inputs are integer level arrays ``(N, D)`` (or any shape with N first) with values in ``[0, n_bins)``.
"""

from __future__ import annotations

import math

import numpy as np

from sinkflow.errors import SinkflowError


def _levels(x, n_bins: int) -> np.ndarray:
    k = np.asarray(x)
    k = k.reshape(len(k), -1)
    if not np.issubdtype(k.dtype, np.integer):
        if not np.all(k == np.rint(k)):
            raise SinkflowError("baseline densities take integer pixel levels", "pass levels k in [0, n_bins)")
        k = k.astype(np.int64)
    if k.size and (k.min() < 0 or k.max() >= n_bins):
        raise SinkflowError(f"pixel levels outside [0, {n_bins})", "pass levels k in [0, n_bins)")
    return k.astype(np.int64)


def uniform_bpd(n_bins: int) -> float:
    return math.log2(n_bins)


def independent_pixel_bpd(fit, test, n_bins: int, smoothing: float = 1.0) -> float:
    """Per-pixel categorical fitted to ``fit`` (add-``smoothing`` counts), mean bits/dim on ``test``."""
    fit, test = _levels(fit, n_bins), _levels(test, n_bins)
    d = fit.shape[1]
    counts = np.stack([np.bincount(fit[:, j], minlength=n_bins) for j in range(d)]) + float(smoothing)
    probs = counts / counts.sum(1, keepdims=True)
    return float(-np.mean(np.log2(probs[np.arange(d)[None, :], test])))


def fit_gaussian(fit, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form maximum-likelihood Gaussian of the dequantised ``fit`` levels: ``(mean, cov)``."""
    k = _levels(fit, n_bins).astype(np.float64)
    mean = k.mean(0) + 0.5
    cov = np.atleast_2d(np.cov(k.T, bias=True)) + np.eye(k.shape[1]) / 12.0
    return mean, cov


def gaussian_nll_bits(test, mean: np.ndarray, cov: np.ndarray, n_bins: int) -> np.ndarray:
    """Per-image expected bits/dim of ``N(mean, cov)`` over the dequantisation noise (closed form)."""
    k = _levels(test, n_bins).astype(np.float64)
    d = k.shape[1]
    chol = np.linalg.cholesky(cov)
    logdet = 2.0 * np.log(np.diag(chol)).sum()
    r = np.linalg.solve(chol, (k + 0.5 - mean).T)  # L^-1 (k + 1/2 - m)
    inv = np.linalg.inv(chol)
    trace = float((inv ** 2).sum())  # tr(S^-1) = ||L^-1||_F^2
    nats = 0.5 * (d * math.log(2 * math.pi) + logdet + (r ** 2).sum(0) + trace / 12.0)
    return nats / (d * math.log(2.0))


def gaussian_bpd(fit, test, n_bins: int) -> float:
    """Full-covariance Gaussian fitted to the dequantised ``fit`` images, mean bits/dim on ``test``."""
    mean, cov = fit_gaussian(fit, n_bins)
    return float(gaussian_nll_bits(test, mean, cov, n_bins).mean())


def baselines(fit, test, n_bins: int) -> dict[str, float]:
    """All three, keyed ``uniform``, ``independent_pixel``, ``gaussian``."""
    return {"uniform": uniform_bpd(n_bins), "independent_pixel": independent_pixel_bpd(fit, test, n_bins),
            "gaussian": gaussian_bpd(fit, test, n_bins)}
