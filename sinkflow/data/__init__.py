"""Data layer: every source and target of sinkflow is a ``Distribution`` built from a spec string.

    dist = build_distribution("moons", data_cfg=cfg["data"])
    x = dist.sample(256, generator)          # float32 (256, *dist.shape), randomness from `generator`
    ref = dist.test_set(1024)                # fixed evaluation samples on CPU

Specs: ``normal`` ``normal-qmc`` ``8gaussians`` ``8gaussians-qmc`` ``moons`` ``scurve`` ``checkerboard``,
a path to a ``.npy`` point file, or an image set ``digits`` ``mnist`` ``cifar10`` ``folder``. See docs/data.md.
"""

from __future__ import annotations

import difflib
import os

from sinkflow.data.base import Distribution
from sinkflow.data.floor import W2_FLOOR_PROTOCOL, measure_floor, w2_exact
from sinkflow.data.images import IMAGE_SETS, ImageDistribution, build_image_distribution
from sinkflow.data.points import PointFile
from sinkflow.data.toy2d import TOY2D, Checkerboard, EightGaussians, Moons, Normal, SCurve
from sinkflow.errors import SinkflowError

__all__ = [
    "Distribution", "build_distribution", "SPECS", "W2_FLOOR_PROTOCOL", "measure_floor", "w2_exact",
    "Normal", "EightGaussians", "Moons", "SCurve", "Checkerboard", "PointFile", "ImageDistribution",
]

SPECS = ("normal", "normal-qmc", "8gaussians", "8gaussians-qmc", *[k for k in TOY2D if k != "8gaussians"],
         *IMAGE_SETS)


def _shape(data_cfg: dict) -> tuple[int, ...]:
    """The shape of ``normal``: not a config key, the methods pass the target's shape under ``"shape"``."""
    shape = data_cfg.get("shape") or (2,)
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                                                        for s in shape):
        raise SinkflowError(f"normal: the sample shape must be a list of positive ints, got {shape!r}",
                            "pass data_cfg={'shape': [2]} (a run gives data.source=normal the shape of data.target)")
    return tuple(shape)


def build_distribution(spec: str, *, data_cfg: dict) -> Distribution:
    """The distribution named by ``spec`` (a name or a ``.npy`` path), configured by the ``data`` section."""
    if not isinstance(spec, str) or not spec:
        raise SinkflowError(f"data spec must be a name or a .npy path, got {spec!r}",
                            f"use one of {', '.join(SPECS)} or a path to an (N, 2) .npy file")
    data_cfg = data_cfg or {}
    if spec in ("normal", "normal-qmc"):
        return Normal(_shape(data_cfg), qmc=spec == "normal-qmc")
    if spec == "8gaussians-qmc":
        return EightGaussians(qmc=True)
    if spec in TOY2D:
        return TOY2D[spec]()
    if spec in IMAGE_SETS:
        return build_image_distribution(spec, data_cfg)
    if spec.endswith(".npy") or os.sep in spec or "/" in spec or os.path.exists(spec):
        return PointFile(spec)
    close = difflib.get_close_matches(spec, SPECS, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(SPECS)} or a path to a .npy file"
    raise SinkflowError(f"unknown data spec '{spec}'", hint)
