"""Exact 2-Wasserstein distance between two empirical measures: the paper's (and torchcfm's) metric."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from sinkflow.errors import require

log = logging.getLogger(__name__)


def _as_points(name: str, t: torch.Tensor | np.ndarray) -> np.ndarray:
    arr = t.detach().cpu().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)
    require(arr.ndim >= 2, f"{name} has shape {arr.shape} but must be shaped (N, *)", "add a feature axis")
    require(arr.shape[0] >= 1, f"{name} holds no samples", "pass at least one sample")
    require(np.isfinite(arr).all(), f"{name} contains NaN or Inf", f"check the samples in {name}")
    return arr.reshape(arr.shape[0], -1)


def w2(x: torch.Tensor | np.ndarray, y: torch.Tensor | np.ndarray) -> float:
    """W2 = sqrt(min_pi sum pi_ij |x_i - y_j|^2) with uniform weights, solved exactly by POT's emd2.

    Any per-sample shape (N, *) is flattened; computed in float64 on the CPU.
    """
    shape_x = tuple(x.shape[1:])
    shape_y = tuple(y.shape[1:])
    require(
        shape_x == shape_y,
        f"per-sample shapes differ: x {shape_x} vs y {shape_y}",
        "compare samples of the same shape",
    )
    import ot  # POT: imported here so the velocity code does not pay for it

    xa, ya = _as_points("x", x), _as_points("y", y)
    a = np.full(xa.shape[0], 1.0 / xa.shape[0])
    b = np.full(ya.shape[0], 1.0 / ya.shape[0])
    cost = ot.dist(xa, ya, metric="sqeuclidean")
    value, info = ot.emd2(a, b, cost, numItermax=int(1e7), log=True)
    if info.get("warning"):
        log.warning("POT emd2 did not fully converge: %s", info["warning"])
    return math.sqrt(max(float(value), 0.0))
