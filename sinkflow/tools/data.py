"""Data of the real shape when the real data is not here (a CPU box before the GPU run, a GPU box offline).

Preflight and the memory benchmark need every phase to see exactly the shapes it will see in the real
run, not the pixels. When an image set cannot be opened (MNIST not downloaded, ``data.path`` unset),
``real_or_synthetic`` swaps in an ``ImageDistribution`` over random uint8 images of the shape the
real set would have, so the very same sampling, normalisation and flip code runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np

from sinkflow import data
from sinkflow.errors import DataNotFound

log = logging.getLogger("sinkflow")

DOWNLOADS = ("mnist", "cifar10")  # the image sets data.download fetches
# native (C, H, W) of the image sets whose files may be missing; folder has no native size
NATIVE_CHW = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "cifar10": (3, 32, 32), "folder": (3, 64, 64)}


def image_shape(data_cfg: dict) -> tuple[int, int, int]:
    """(C, H, W) the target image set will have after ``data.channels`` / ``data.image_size``."""
    c, h, w = NATIVE_CHW[data_cfg["target"]]
    size = data_cfg.get("image_size")
    return (data_cfg.get("channels") or c, size or h, size or w)


def synthetic_images(name: str, shape: tuple[int, ...], n_train: int = 512, n_test: int = 256, flip: bool = False,
                     val_fraction: float = 0.0):
    """An ``ImageDistribution`` over seeded random uint8 images (labels 0-9): real code path, fake pixels; with the
    run's validation split (a flow's evaluation scores it: preflight flow-mnist failed "there is no validation
    split" without its data)."""
    from sinkflow.data.images import ImageDistribution

    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, size=(n_train, *shape), dtype=np.uint8)
    test = rng.integers(0, 256, size=(n_test, *shape), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n_train).astype(np.int64)
    test_labels = rng.integers(0, 10, size=n_test).astype(np.int64)
    return ImageDistribution(f"synthetic-{name}", train, test, labels, test_labels, flip=flip,
                             val_fraction=val_fraction)


def needs_synthetic(cfg: dict) -> str | None:
    """Why the real data cannot be used here (None when it can): it is not on this machine (``DataNotFound``).
    Data that is here but cannot serve the run (a corrupt image, mixed sizes, a partial copy) raises its error: a
    check passed on synthetic images would hide what `sinkflow train` refuses."""
    if cfg["data"]["target"] not in NATIVE_CHW:
        return None
    # never wait on a download to learn this; a set that downloads nothing is probed as the run opens it, so the
    # run's own call finds it built (an image folder is scanned, and its headers read, once)
    probe = {**cfg, "data": {**cfg["data"], "download": False}} if cfg["data"]["target"] in DOWNLOADS else cfg
    try:
        data.distributions(probe)
        return None
    except DataNotFound as exc:
        return exc.problem


@contextlib.contextmanager
def sampling_data(cfg: dict, run_dir: Path, draws: bool = True):
    """``_sampling_data``; where the block ``draws`` from the source, a source point file is checked against the run's
    record first (``data_record.check_source``; a network alone, ``Run.model``, needs only the shape)."""
    with _sampling_data(cfg, run_dir) as reason:
        spec = str(cfg["data"]["source"])
        if draws and (spec.lower().endswith(data.POINT_SUFFIXES) or "/" in spec):  # a point file (cached): hashed
            from sinkflow.runtime.data_record import check_source

            check_source(Path(run_dir), data.distributions(cfg)[0])
        yield reason


@contextlib.contextmanager
def _sampling_data(cfg: dict, run_dir: Path):
    """Sampling a trained image run needs its data's shape, not its pixels: a run copied off the machine it trained
    on (a Kaggle run on a laptop) samples without its data set. Within the block, when the target image set is not
    on this machine (``DataNotFound``; nothing is downloaded to learn that), synthetic images of the run's shape
    stand in, which no sampler reads (tests/test_images.py: the same samples bit for bit), as they do where its decoded
    cache cannot be written under the run's data.root (a folder of the machine it trained on); the shape is the one
    RUN/data_split.json records, else the one the config implies. Yields the reason, None when the data is here.
    A point-file target: ``_points_sampling_data``."""
    if cfg["data"]["target"] not in NATIVE_CHW:
        with _points_sampling_data(cfg, run_dir) as reason:
            yield reason
        return
    from sinkflow.data.images import CacheNotWritable

    try:
        reason = needs_synthetic(cfg)
    except CacheNotWritable as exc:  # digits (always here, decoded into data.root) from a data.root of the machine
        # the run trained on, which this one cannot create: `sample` failed where it needs the shape alone
        reason = exc.problem
    if reason is None:
        yield None
        return
    try:
        shape = _recorded_shape(run_dir)
    except (OSError, ValueError, KeyError, TypeError):  # a record from before it held the shape
        if cfg["data"]["target"] == "folder" and not cfg["data"].get("image_size"):
            raise DataNotFound(reason, "sampling this run needs its image folder (its native image size is "
                                       "recorded nowhere else): put it back, or name its new place once with "
                                       "`sinkflow train --resume RUN data.path=NEW_PATH --no-report`") from None
        shape = image_shape(cfg["data"])

    log.info("data: %s is not on this machine; sampling needs only its shape %s (%s)", cfg["data"]["target"],
             shape, reason)
    with data.substituted(_stand_in(shape, n_train=2, n_test=2)):
        yield reason


def _recorded_shape(run_dir: Path) -> tuple[int, ...]:
    """The per-sample shape RUN/data_split.json records of the run's target (image sets, point files)."""
    return tuple(int(d) for d in json.loads((Path(run_dir) / "data_split.json").read_text())["shape"])


@contextlib.contextmanager
def _points_sampling_data(cfg: dict, run_dir: Path):
    """``sampling_data`` for a point-file target: a 2D run trained on a GPU box and copied to a laptop without its
    file samples from its source (a normal of the recorded shape, or its own point file, which it needs) and a
    stand-in target that only knows its shape; what would read the target's points (the scatter's reference)
    raises the file's own DataNotFound. A missing source file, or a record without the shape, raises as before."""
    target = Path(str(cfg["data"]["target"])).expanduser()
    try:
        data.distributions(cfg)
        missing = None
    except DataNotFound as exc:
        if target.is_file() or not str(target).lower().endswith(data.POINT_SUFFIXES):
            raise  # the missing file is the source: sampling draws from it
        missing = exc
    if missing is None:  # (not yielded inside the try: an error of the caller's block is not this one)
        yield None
        return
    try:
        shape = _recorded_shape(run_dir)
    except (OSError, ValueError, KeyError, TypeError):  # a record from before it held the shape
        raise missing from None
    log.info("data: %s is not on this machine; sampling needs only its shape %s", target, shape)

    def build(data_cfg: dict):
        stand_in = data.AbsentPointFile(target.name, shape, missing)
        return data.build_distribution(data_cfg["source"], data_cfg={**data_cfg, "shape": shape, "test_rows": 0}), \
            stand_in

    with data.substituted(build):
        yield missing.problem


def _stand_in(shape: tuple[int, ...] | None = None, **images):
    """A ``data.substituted`` builder for image targets: synthetic images (``synthetic_images(**images)``) of
    ``shape`` (None: the one each data section implies), and the section's own source drawn at that shape."""
    def build(data_cfg: dict):
        if data_cfg["target"] not in NATIVE_CHW:
            return None
        target = synthetic_images(data_cfg["target"], shape or image_shape(data_cfg), flip=bool(data_cfg.get("flip")),
                                  val_fraction=float(data_cfg.get("val_fraction") or 0.0), **images)
        source = data.build_distribution(data_cfg["source"], data_cfg={**data_cfg, "shape": tuple(target.shape)})
        return source, target

    return build


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
    log.info("data: synthetic %s images of shape %s (%s)", cfg["data"]["target"], image_shape(cfg["data"]), reason)
    with data.substituted(_stand_in()):
        yield reason
