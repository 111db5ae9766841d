"""Decode-once image cache: a uint8 (N, C, H, W) .npy memmap per (set, split, size, channels).

Layout under ``<data.root>/cache/``: ``<name>-<split>-<size>-<channels>.npy`` (the images),
``.labels.npy`` beside it when the set has labels, and ``.json`` (source fingerprint and shape) written
last. Every file is written under a temporary name and renamed into place, so a killed build leaves
either the old valid cache or none; a cache whose fingerprint, header or shape disagrees is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)
CACHE_VERSION = 1


def cache_stem(root: str | os.PathLike, name: str, split: str, size: str, channels: int) -> Path:
    return Path(root) / "cache" / f"{name}-{split}-{size}-{channels}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_cache(stem: Path, fingerprint: str, chw: tuple[int, int, int] | None = None):
    """Return ``(images memmap, labels or None)`` if a valid cache exists at ``stem``, else None."""
    data, meta_path, lab = stem.with_suffix(".npy"), stem.with_suffix(".json"), stem.with_suffix(".labels.npy")
    try:
        meta = json.loads(meta_path.read_text())
        images = np.load(data, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    ok = (
        meta.get("version") == CACHE_VERSION
        and meta.get("fingerprint") == fingerprint
        and images.dtype == np.uint8
        and images.ndim == 4
        and list(images.shape) == meta.get("shape")
        and (chw is None or tuple(images.shape[1:]) == tuple(chw))
    )
    if not ok:
        log.info("image cache %s is stale or does not match; rebuilding", data)
        return None
    labels = None
    if meta.get("labels"):
        try:
            labels = np.load(lab, allow_pickle=False)
        except (OSError, ValueError):
            return None
        if labels.shape != (images.shape[0],):
            return None
    return images, labels


def write_cache(stem: Path, fingerprint: str, shape: tuple[int, int, int, int],
                fill: Callable[[np.ndarray], np.ndarray | None]):
    """Allocate the memmap, let ``fill(out)`` decode into it (returning labels or None), publish atomically."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    data, meta_path, lab = stem.with_suffix(".npy"), stem.with_suffix(".json"), stem.with_suffix(".labels.npy")
    meta_path.unlink(missing_ok=True)  # the old cache is invalid from here on, whatever happens next
    tmp = stem.with_name(f".{stem.name}.npy.tmp{os.getpid()}")
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=shape)
        labels = fill(out)
        out.flush()
        del out
        _fsync_file(tmp)
        os.replace(tmp, data)
    finally:
        tmp.unlink(missing_ok=True)
    if labels is not None:
        _atomic_save_npy(lab, np.asarray(labels, dtype=np.int64))
    meta = {"version": CACHE_VERSION, "fingerprint": fingerprint, "shape": list(shape), "labels": labels is not None}
    tmp_meta = meta_path.with_name(f".{meta_path.name}.tmp{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta))
    _fsync_file(tmp_meta)
    os.replace(tmp_meta, meta_path)
    result = open_cache(stem, fingerprint)
    assert result is not None, f"freshly written cache {data} does not validate"
    return result
