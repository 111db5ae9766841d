"""Decode-once image cache: a uint8 (N, C, H, W) .npy memmap per (set, split, size, channels).

Layout under ``<data.root>/cache/``: ``<name>-<split>-<size>-<channels>.npy`` (the images),
``.labels.npy`` beside it when the set has labels, and ``.json`` (source fingerprint, shape and the pixels'
SHA-256) written last. Every file is written under a temporary name and renamed into place, so a killed build leaves
either the old valid cache or none; a cache whose fingerprint, header or shape disagrees is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from sinkflow.data.atomic_write import atomic_path, atomic_write_bytes, atomic_write_text, create_array

log = logging.getLogger(__name__)
CACHE_VERSION = 1


def cache_stem(root: str | os.PathLike, name: str, split: str, size: str, channels: int) -> Path:
    return Path(root) / "cache" / f"{name}-{split}-{size}-{channels}"


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


@contextlib.contextmanager
def building(stem: Path) -> Iterator[None]:
    """One builder of a cache in ``stem``'s folder at a time (an exclusive ``flock`` on the folder: no lock file is
    left beside the caches), across processes:
    the ranks of a torchrun job all open the data before the run starts (``check_run``), and two runs started at once
    share a data.root. Two builders decoded the same images into the same files at once: the second's start made the
    first's just-written cache invalid, which then failed its own check ("freshly written cache ... does not
    validate", a 2-process CPU run, 2026-12-01). The caller opens the cache again once it holds the lock: the other
    builder has written it meanwhile. Where the folder's filesystem cannot lock it (NFS emulates flock with locks a
    folder opened read-only cannot take), the build goes on unlocked, as before."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(stem.parent, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def write_cache(stem: Path, fingerprint: str, shape: tuple[int, int, int, int],
                fill: Callable[[np.ndarray], np.ndarray | None]):
    """Allocate the memmap, let ``fill(out)`` decode into it (returning labels or None), publish atomically."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    data, meta_path, lab = stem.with_suffix(".npy"), stem.with_suffix(".json"), stem.with_suffix(".labels.npy")
    meta_path.unlink(missing_ok=True)  # the old cache is invalid from here on, whatever happens next
    with atomic_path(data) as tmp:
        out = create_array(tmp, np.uint8, shape, data)  # reserved: a disk filling as it decodes is ENOSPC, not SIGBUS
        labels = fill(out)
        out.flush()
        pixels = pixels_sha256(out)
        del out
    if labels is not None:
        atomic_write_bytes(lab, lambda f: np.save(f, np.asarray(labels, dtype=np.int64), allow_pickle=False))
    meta = {"version": CACHE_VERSION, "fingerprint": fingerprint, "shape": list(shape), "labels": labels is not None,
            "pixels_sha256": pixels}
    atomic_write_text(meta_path, json.dumps(meta))
    result = open_cache(stem, fingerprint)
    assert result is not None, f"freshly written cache {data} does not validate"
    return result


def pixels_sha256(images: np.ndarray, rows: int = 4096) -> str:
    """SHA-256 of decoded uint8 images, read ``rows`` at a time (a memmap is never loaded whole)."""
    h = hashlib.sha256()
    for lo in range(0, len(images), rows):
        h.update(np.ascontiguousarray(images[lo:lo + rows]).data)
    return h.hexdigest()


def cached_pixels_sha256(stem: Path) -> str | None:
    """The pixels' SHA-256 a cache recorded when it was written (``write_cache``); None for a cache written before it
    was recorded. What a run trained on, beyond its files' names and sizes: a file replaced by another of the same
    size changes the source's fingerprint (its time), so the cache is decoded anew, with other pixels."""
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    value = meta.get("pixels_sha256") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None
