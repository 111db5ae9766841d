"""Image distributions served by index from the decode-once uint8 memmap cache.

``sample`` draws indices from the caller's generator, gathers uint8 rows (sorted, for memmap locality),
moves them to the device and only there converts to float32 in [-1, 1] and applies the optional
per-sample horizontal flip. Host memory per batch is n*C*H*W bytes; nothing else is kept in RAM.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from sinkflow.data.base import DEFAULT_TEST_SEED, Distribution, check_sample_args, warn_once
from sinkflow.data.cache import building, cache_stem, cached_pixels_sha256, open_cache, write_cache
from sinkflow.data.sources import CIFAR10Source, DigitsSource, FolderSource, MNISTSource
from sinkflow.errors import SinkflowError

log = logging.getLogger(__name__)
IMAGE_SETS = {"digits": DigitsSource, "mnist": MNISTSource, "cifar10": CIFAR10Source, "folder": FolderSource}
DIGIT_SETS = ("digits", "mnist")  # labelled digits: the evaluation fits a digit classifier and FD-CNN's network to them
SPLITS = ("train", "test")
VAL_SEED = 20261123  # fixed: the validation split of a set depends only on val_fraction and the train split
# The data section's keys an image set reads (rules and defaults: sinkflow/config/schema.py DATA).
IMAGE_KEYS = ("root", "path", "holdout", "image_size", "channels", "flip", "split", "val_fraction", "download")


def to_unit_range(x: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] -> float32 [-1, 1] on whatever device ``x`` is on (0 -> -1, 255 -> 1)."""
    return x.to(torch.float32).mul_(2.0 / 255.0).sub_(1.0)


def val_split(n_train: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fit_index, val_index)``: sorted, disjoint indices into a train split of ``n_train`` images that
    together cover it. ``round(val_fraction * n_train)`` images (at least 1 when the fraction is > 0, and
    leaving at least 1 to fit on) are drawn by a permutation with the fixed seed ``VAL_SEED``."""
    if val_fraction <= 0:
        return torch.arange(n_train), torch.zeros(0, dtype=torch.long)
    n_val = min(max(1, round(val_fraction * n_train)), n_train - 1)
    if n_val < 1:
        raise SinkflowError(f"a validation split needs at least 2 training images, the train split has {n_train}",
                            "add images or set data.val_fraction=0")
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(VAL_SEED))
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def trains_on_test(target, split: str = "test") -> bool:
    """Is ``split`` of ``target`` the one the run trained on (``data.split=test``)? Scores against it are then on
    training images: the evaluation said "held-out" over them, a warning at the top of the log the only sign."""
    return split == "test" and getattr(target, "split", "train") == "test"


class ImageDistribution(Distribution):
    """Images of one set; ``sample`` serves ``split``, ``val_set`` the validation split, ``test_set`` the
    held-out test split.

    ``images``/``labels`` (the whole train split, validation included) and ``test_images``/``test_labels``
    expose the raw uint8 arrays (memmaps) and int64 labels (None for folders), e.g. for the digits classifier
    metric. With ``val_fraction > 0`` a validation split is carved from the train split with a fixed seed
    (:func:`val_split`): ``sample`` on the train split then never serves a validation image, ``val_set``
    serves them, and ``fit_images`` is the uint8 array of the images that remain for fitting.
    """

    def __init__(self, name: str, train: np.ndarray, test: np.ndarray, train_labels, test_labels,
                 flip: bool = False, split: str = "train", val_fraction: float = 0.0):
        self.name, self.flip, self.split = name, bool(flip), split
        self.images, self.labels = train, train_labels
        self.test_images, self.test_labels = test, test_labels
        self.val_fraction = float(val_fraction)
        self.fit_index, self.val_index = val_split(len(train), self.val_fraction)
        self._serve = train if split == "train" else test
        if split == "test":  # documented, but a score then reads the images the model trained on
            warn_once(log, name, "%s: data.split=test trains on the held-out split, which the evaluation scores "
                      "against too: its scores are on training images", name)
        self._map = self.fit_index if split == "train" and len(self.val_index) else None
        self.shape = tuple(int(s) for s in train.shape[1:])

    def __len__(self) -> int:
        return len(self._serve) if self._map is None else len(self._map)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """uint8 rows ``idx`` of the served split, in the order given, read in sorted order."""
        return _gather(self._serve, idx if self._map is None else self._map[idx])

    def fit_images(self) -> np.ndarray:
        """uint8 training images a model may be fitted to: the train split minus the validation split."""
        return np.asarray(self.images[self.fit_index.numpy()])

    def val_set(self) -> torch.Tensor:
        """Every validation image as float32 in [-1, 1] on CPU, never flipped, in a fixed order."""
        if not len(self.val_index):
            raise SinkflowError(f"{self.name}: there is no validation split (data.val_fraction=0)",
                                "set data.val_fraction, e.g. 0.1, to carve one from the train split")
        return to_unit_range(_gather(self.images, self.val_index))

    def sample(self, n, generator, device="cpu"):
        check_sample_args(n, generator, device)
        idx = torch.randint(0, len(self), (n,), generator=generator)
        flip = torch.rand(n, generator=generator) < 0.5 if self.flip else None
        device = torch.device(device)
        x = self.gather(idx)
        if device.type == "cuda":
            x = x.pin_memory()
        x = to_unit_range(x.to(device, non_blocking=True))
        if flip is not None:
            flip = flip.to(device, non_blocking=True).view(n, *([1] * len(self.shape)))
            x = torch.where(flip, x.flip(-1), x)
        return x

    def check_test_n(self, n: int, flag: str = "eval.n") -> None:
        """A digit set is scored by FD-CNN, a Fréchet distance, which fits a covariance to each side's features:
        one image has none, and the report failed in numpy's eigensolver after the run had trained. The one check
        of `train`'s eval.n (before the run folder), `sinkflow eval --n` and ``Run.evaluate(n=)``; a folder's W2
        scores one image (FID's own count is checked where its weights are read)."""
        if n < 2 and self.name in DIGIT_SETS:
            sep = " " if flag.startswith("-") else "="
            raise SinkflowError(f"{flag}{sep}{n}: {self.name} is scored by FD-CNN, a Fréchet distance, which fits a "
                                "covariance to each side's features, so it needs at least 2 images",
                                f"use {flag}{sep}2 or more")

    def test_indices(self, n: int, seed: int = DEFAULT_TEST_SEED) -> torch.Tensor:
        """Sorted indices into ``test_images`` of a fixed random subset of size n (no repeats)."""
        total = len(self.test_images)
        if not isinstance(n, int) or n < 1 or n > total:
            raise SinkflowError(f"{self.name}: asked for {n} held-out images but the test split has {total}",
                                f"ask for at most {total} (e.g. lower the eval sample count)")
        return torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n].sort().values

    def test_set(self, n, seed=DEFAULT_TEST_SEED):
        """Held-out real images as float32 in [-1, 1] on CPU, never flipped."""
        return to_unit_range(_gather(self.test_images, self.test_indices(n, seed)))


def _gather(arr: np.ndarray, idx: torch.Tensor) -> torch.Tensor:
    sorted_idx, order = torch.sort(idx)
    rows = torch.from_numpy(np.ascontiguousarray(arr[sorted_idx.numpy()]))
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def check_image_cfg(data_cfg: dict) -> dict:
    """The image keys of the data section, checked against the config schema, with defaults filled in.

    A library caller's dict may omit keys: they take the schema's defaults, except ``download``, which is
    off unless asked for (a caller that says nothing never reaches the network; a config tree always says)."""
    from sinkflow.config import check_value
    from sinkflow.config.schema import DATA

    cfg = {k: DATA[k].default for k in IMAGE_KEYS}
    cfg["download"] = False
    cfg.update({k: v for k, v in data_cfg.items() if k in cfg})
    return {k: check_value(f"data.{k}", DATA[k], v) for k, v in cfg.items()}


def image_source(name: str, cfg: dict):
    """The prepared source of image set ``name`` (files found, unpacked or downloaded), nothing decoded yet."""
    if name == "folder":
        src = FolderSource(cfg["path"], cfg["channels"], cfg["image_size"], cfg["holdout"])
    else:
        src = IMAGE_SETS[name](cfg["root"], cfg["channels"], cfg["image_size"], cfg["download"])
    src.prepare()
    return src


def source_split_info(name: str, data_cfg: dict) -> dict:
    """What the source of image set ``name`` records of its splits (an image folder: its file lists' hashes;
    MNIST's t10k-only split: the index hashes), read from its files before anything is decoded: a run refused on
    changed data (``check_split``) must not first rewrite the decoded cache under data.root."""
    src = image_source(name, check_image_cfg(data_cfg))
    return src.split_info() if hasattr(src, "split_info") else {}


class CacheNotWritable(SinkflowError):
    """The decoded-image cache under ``data.root`` cannot be written: a run's absolute data.root names a folder of
    the machine it trained on (``/workspace/data`` on a rented GPU), which a laptop cannot create. Sampling, which needs
    the data's shape alone, stands in for the data then (``tools.data.sampling_data``)."""


def build_image_distribution(name: str, data_cfg: dict) -> ImageDistribution:
    """Open (or decode once into) the cache for both splits of image set ``name``."""
    cfg = check_image_cfg(data_cfg)
    src = image_source(name, cfg)
    arrays, pixels = {}, {}
    for split in SPLITS:
        stem = cache_stem(cfg["root"], src.name, split, src.size, src.chw[0])
        fp = src.fingerprint(split)
        hit = open_cache(stem, fp, src.chw)
        if hit is None:
            try:
                with building(stem):  # another process decoding it now: wait, then read what it wrote
                    hit = open_cache(stem, fp, src.chw)
                    if hit is None:
                        log.info("decoding %s/%s once into %s.npy", name, split, stem)
                        hit = src.decode_into(split, lambda shape, fill, stem=stem, fp=fp:
                                              write_cache(stem, fp, shape, fill))
            except OSError as exc:  # the cache folder, a file in it, or a folder above it that mkdir could not make
                # (/workspace of /workspace/data on a laptop: EACCES names the ancestor, not the cache folder)
                if exc.filename is None or not (str(exc.filename).startswith(str(stem.parent))
                                                or Path(exc.filename) in stem.parent.parents):
                    raise
                raise CacheNotWritable(
                    f"cannot write the image cache {stem.parent} under data.root={cfg['root']} "
                    f"({exc.strerror or type(exc).__name__})",
                    "set data.root to a writable folder with room for the decoded images (a run's: `sinkflow train "
                    "--resume RUN data.root=NEW --no-report` names it once, a finished run too)") from None
        if len(hit[0]) == 0:
            raise SinkflowError(f"{name}: the {split} split is empty", "add images (or check the data files)")
        arrays[split] = hit
        pixels[f"{split}_pixels_sha256"] = cached_pixels_sha256(stem)
    (train, train_labels), (test, test_labels) = arrays["train"], arrays["test"]
    dist = ImageDistribution(name, train, test, train_labels, test_labels, flip=cfg["flip"], split=cfg["split"],
                             val_fraction=cfg["val_fraction"])
    dist.split_info = split_record(src, dist)
    dist.split_info.update({k: v for k, v in pixels.items() if v is not None})  # compared where recorded (check_split)
    return dist


def split_record(src, dist: ImageDistribution) -> dict:
    """The splits a run trains and is scored on, for RUN/data_split.json: the source's layout (MNIST's
    t10k-only split: seed and index hashes), sizes, and the validation split's seed and index hash."""
    from sinkflow.data.sources import indices_sha256

    info = src.split_info() if hasattr(src, "split_info") else {"set": dist.name}
    info.update({"shape": list(dist.shape),  # what sampling needs of the data (``tools.data.sampling_data``)
                 "n_train": len(dist.images), "n_test": len(dist.test_images), "val_fraction": dist.val_fraction,
                 "n_val": len(dist.val_index), "trains_on": dist.split})
    if len(dist.val_index):
        info.update({"val_seed": VAL_SEED, "val_indices_sha256": indices_sha256(dist.val_index.numpy())})
    return info
