"""Data of the real shape when the real data is not here (a CPU box before the GPU run, a GPU box offline).

Preflight and the memory benchmark need every phase to see exactly the shapes it will see in the real
run, not the pixels. When an image set cannot be opened (MNIST not downloaded, ``data.path`` unset),
``real_or_synthetic`` swaps in an ``ImageDistribution`` over random uint8 images of the shape the
real set would have, so the very same sampling, normalisation and flip code runs.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np

from sinkflow import data
from sinkflow.errors import DataNotFound

log = logging.getLogger("sinkflow")

# native (C, H, W) of the image sets whose files may be missing; folder has no native size
NATIVE_CHW = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "cifar10": (3, 32, 32), "folder": (3, 64, 64)}


def image_shape(data_cfg: dict) -> tuple[int, int, int]:
    """(C, H, W) the target image set will have after ``data.channels`` / ``data.image_size``."""
    c, h, w = NATIVE_CHW[data_cfg["target"]]
    size = data_cfg.get("image_size")
    return (data_cfg.get("channels") or c, size or h, size or w)


def synthetic_images(name: str, shape: tuple[int, ...], n_train: int = 512, n_test: int = 256, flip: bool = False):
    """An ``ImageDistribution`` over seeded random uint8 images (labels 0-9): real code path, fake pixels."""
    from sinkflow.data.images import ImageDistribution

    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, size=(n_train, *shape), dtype=np.uint8)
    test = rng.integers(0, 256, size=(n_test, *shape), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n_train).astype(np.int64)
    test_labels = rng.integers(0, 10, size=n_test).astype(np.int64)
    return ImageDistribution(f"synthetic-{name}", train, test, labels, test_labels, flip=flip)


def needs_synthetic(cfg: dict) -> str | None:
    """Why the real data cannot be used here (None when it can): it is not on this machine (``DataNotFound``).
    Data that is here but cannot serve the run (a corrupt image, mixed sizes, a partial copy) raises its error: a
    check passed on synthetic images would hide what `sinkflow train` refuses."""
    if cfg["data"]["target"] not in NATIVE_CHW:
        return None
    probe = {**cfg, "data": {**cfg["data"], "download": False}}  # never wait on a download to learn this
    try:
        data.distributions(probe)
        return None
    except DataNotFound as exc:
        return exc.problem


@contextlib.contextmanager
def real_or_synthetic(cfg: dict, force: bool = False):
    """Within the block, ``sinkflow.data.distributions`` serves synthetic images of the real shape if needed.

    Yields the reason for the substitution (None when the real data is used). The substitute is registered
    with ``sinkflow.data.substituted``, so every caller (model building, phases, evaluation) sees it.
    """
    reason = "forced" if force and cfg["data"]["target"] in NATIVE_CHW else needs_synthetic(cfg)
    if reason is None:
        yield None
        return
    shape = image_shape(cfg["data"])

    def synthetic(data_cfg: dict):
        if data_cfg["target"] not in NATIVE_CHW:
            return None
        target = synthetic_images(data_cfg["target"], image_shape(data_cfg), flip=bool(data_cfg.get("flip")))
        source = data.build_distribution(data_cfg["source"], data_cfg={**data_cfg, "shape": tuple(target.shape)})
        return source, target

    log.info("data: synthetic %s images of shape %s (%s)", cfg["data"]["target"], shape, reason)
    with data.substituted(synthetic):
        yield reason
