"""Data layer: every source and target of sinkflow is a ``Distribution`` built from a spec string.

    dist = build_distribution("moons", data_cfg=cfg["data"])
    x = dist.sample(256, generator)          # float32 (256, *dist.shape), randomness from `generator`
    ref = dist.test_set(1024)                # fixed evaluation samples on CPU

Specs: ``normal`` ``normal-qmc`` ``8gaussians`` ``8gaussians-qmc`` ``moons`` ``scurve`` ``checkerboard``,
a path to a ``.npy`` point file, or an image set ``digits`` ``mnist`` ``cifar10`` ``folder``. See docs/data.md.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from pathlib import Path
from functools import lru_cache
from typing import Callable

from sinkflow.config.checks import shown
from sinkflow.data.base import Distribution
from sinkflow.data.images import DIGIT_SETS, IMAGE_SETS, ImageDistribution, build_image_distribution, source_split_info
from sinkflow.data.points import POINT_SUFFIXES, AbsentPointFile, PointFile
from sinkflow.data.toy2d import TOY2D, Checkerboard, EightGaussians, Moons, Normal, SCurve
from sinkflow.errors import SinkflowError

__all__ = [
    "Distribution", "build_distribution", "SPECS",
    "Normal", "EightGaussians", "Moons", "SCurve", "Checkerboard", "PointFile", "ImageDistribution",
    "distributions", "sample_shape", "substituted", "qmc_source", "qmc_twin", "iid_twin", "sampling_source",
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


def build_distribution(spec: str, *, data_cfg: dict | None = None) -> Distribution:
    """The distribution named by ``spec`` (a name, or a point file's path: a str or ``pathlib.Path``), configured by
    the ``data`` section."""
    if isinstance(spec, os.PathLike):  # every other entry point takes a Path
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:  # shown: an array's repr spans lines and thousands of characters
        points = hasattr(spec, "shape") or isinstance(spec, (list, tuple))  # a notebook's points, given as they are
        raise SinkflowError(f"data spec must be a name or a .npy path, got {shown(spec)}",
                            "save the points first, e.g. numpy.save('points.npy', points), and pass 'points.npy'"
                            if points else f"use one of {', '.join(SPECS)} or a path to an (N, 2) .npy file")
    data_cfg = data_cfg or {}
    if spec in ("normal", "normal-qmc"):
        return Normal(_shape(data_cfg), qmc=spec == "normal-qmc")
    if spec == "8gaussians-qmc":
        return EightGaussians(qmc=True)
    if spec in TOY2D:
        return TOY2D[spec]()
    if spec in IMAGE_SETS:
        return build_image_distribution(spec, data_cfg)
    if spec.lower().endswith(POINT_SUFFIXES) or os.sep in spec or "/" in spec or os.path.exists(spec):
        return PointFile(spec, test_rows=data_cfg.get("test_rows", 0))
    close = difflib.get_close_matches(spec, SPECS, n=1)
    hint = f"did you mean '{close[0]}'?" if close else (f"use one of {', '.join(SPECS)} or a path to a point file "
                                                        f"({', '.join(POINT_SUFFIXES)})")
    raise SinkflowError(f"unknown data spec '{spec}'", hint)


# ---- a config's (source, target) -------------------------------------------------------------------

def _data_key(cfg: dict) -> tuple:
    """The data section as a hashable key, ``root`` made absolute: a relative root (the default ``data``) names
    another folder after a chdir, which a key of the bare string would serve from the old one's cache. A point file
    that is there is named by its absolute path, as a run's config names it (``absolute_data_paths``): `train` checked
    the typed ``pts.csv`` and then built the run's ``/abs/pts.csv``, reading the file twice (40 s for a 10-million-row
    CSV) and saying its warnings twice. A missing one keeps the name typed, for that error's fix."""
    def value(k, v):
        if k == "root" and isinstance(v, str):
            return str(Path(v).expanduser().resolve())
        if k in ("source", "target") and isinstance(v, str) and v.lower().endswith(POINT_SUFFIXES) \
                and os.path.isfile(os.path.expanduser(v)):
            return os.path.abspath(os.path.expanduser(v))
        return tuple(v) if isinstance(v, list) else v
    return tuple(sorted((k, value(k, v)) for k, v in cfg["data"].items()))


def _files_key(cfg: dict) -> tuple:
    """(absolute path, mtime, size) of the point files a data section names: a file rewritten between two runs of
    one process (a notebook) is read again, and a relative name after a chdir is another file."""
    key = []
    for spec in (cfg["data"].get("source"), cfg["data"].get("target")):
        path = Path(spec).expanduser() if isinstance(spec, str) else None
        if path is not None and path.is_file():
            stat = path.stat()
            key.append((str(path.resolve()), stat.st_mtime_ns, stat.st_size))
    return tuple(key)


def reread_images() -> None:
    """The next ``distributions`` of an image set opens its files again, not this process's arrays: ``sinkflow.train``
    and ``resume`` call it first. A notebook that added images to its folder between two runs trained the second on
    the first run's images and recorded their hashes as its data (a new process then refused its eval and resume as
    "its data changed"). The arrays held are dropped, not kept beside the new ones (a key per call kept up to 8 decoded
    data sets alive: 0.6 GB each for CIFAR-10's train split); unchanged files are not decoded again (the cache under
    data.root is keyed by their fingerprint)."""
    _distributions.cache_clear()


@lru_cache(maxsize=8)
def _distributions(key: tuple, files: tuple = ()):
    """``files`` (``_files_key``) is part of the cache key only."""
    data_cfg = dict(key)
    target = build_distribution(data_cfg["target"], data_cfg=data_cfg)
    # data.test_rows holds out rows of the target only (a source file is drawn from whole)
    source = build_distribution(data_cfg["source"], data_cfg={**data_cfg, "shape": tuple(target.shape), "test_rows": 0})
    if tuple(source.shape) != tuple(target.shape):
        raise SinkflowError(
            f"data.source {data_cfg['source']} has samples of shape {tuple(source.shape)} but data.target "
            f"{data_cfg['target']} has {tuple(target.shape)}", "use a source and target of the same dimension")
    return source, target


_SUBSTITUTES: list[Callable] = []


def distributions(cfg: dict):
    """(source, target) for a config; built once per data section (validates the data up front).

    Inside ``substituted(builder)`` the builder is asked first (preflight's synthetic images)."""
    key = _data_key(cfg)
    for builder in reversed(_SUBSTITUTES):
        pair = builder(dict(key))
        if pair is not None:
            return pair
    return _distributions(key, _files_key(cfg))


def target_split_info(cfg: dict) -> dict:
    """What an image target's source records of its splits, from its files alone (``source_split_info``): checked
    against a run's record before ``distributions`` decodes anything. Empty for other targets, and inside
    ``substituted`` (the builder's data is not the files')."""
    name = cfg["data"]["target"]
    if name not in IMAGE_SETS or _SUBSTITUTES:
        return {}
    return source_split_info(name, cfg["data"])


def qmc_twin(dist: Distribution) -> Distribution:
    """``dist`` drawn by randomised quasi-Monte-Carlo (scrambled Sobol) where it has a twin (normal,
    8gaussians), else ``dist`` itself. A QMC draw covers the distribution evenly: evaluation uses it so that no
    i.i.d. floor sits under W2, and the NSGF pool (``pool.qmc``) so that each Sinkhorn batch splits the source
    as the whole distribution would."""
    if isinstance(dist, Normal) and not dist.qmc:
        return Normal(dist.shape, qmc=True)
    if isinstance(dist, EightGaussians) and not dist.qmc:
        return EightGaussians(dist.radius, dist.std, dist.stratified, qmc=True)
    return dist


def iid_twin(dist: Distribution) -> Distribution:
    """``dist`` drawn i.i.d.: no QMC, no stratified counts (the built-in 2D samplers stratify by default). A
    point file already draws i.i.d. rows. The ``iid`` evaluation protocol draws what a user's own sampling would."""
    if isinstance(dist, Normal):
        return Normal(dist.shape, qmc=False) if dist.qmc else dist
    if isinstance(dist, EightGaussians):
        return EightGaussians(dist.radius, dist.std, stratified=False, qmc=False)
    if isinstance(dist, Moons):
        return Moons(dist.noise, dist.scale, tuple(dist.shift.tolist()), stratified=False)
    if isinstance(dist, SCurve):
        return SCurve(dist.noise, dist.scale, stratified=False)
    if isinstance(dist, Checkerboard):
        return Checkerboard(dist.scale, stratified=False)
    return dist


def qmc_source(cfg: dict) -> Distribution:
    """The run's source, drawn by QMC where it has a twin (:func:`qmc_twin`)."""
    return qmc_twin(distributions(cfg)[0])


def sampling_source(cfg: dict, qmc: bool = False) -> Distribution:
    """The run's source as sampling draws it: i.i.d. (``iid_twin``: the default, what a user asking for samples
    expects), or with ``qmc`` its randomised-QMC twin (an evaluation protocol's choice: ``eval.protocol``,
    ``sample.qmc``). The built-in 2D samplers stratify their draws (the pool's); `sinkflow sample` said "an i.i.d.
    source draw" of an 8gaussians source and drew exactly n/8 points per centre."""
    source = distributions(cfg)[0]
    twin = qmc_twin(source) if qmc else source
    # a source without a scrambled-Sobol twin (moons, scurve, checkerboard) is drawn i.i.d. when QMC is asked for, as
    # ``source_protocol`` says: `sample --qmc` drew its stratified pool sampler and said "a QMC source draw"
    return twin if twin is not source else iid_twin(source)


def sample_shape(cfg: dict) -> tuple[int, ...]:
    return tuple(distributions(cfg)[1].shape)


@contextlib.contextmanager
def substituted(builder: Callable[[dict], tuple | None]):
    """Within the block, ``distributions`` serves ``builder(data_cfg)`` where it is not None: every caller
    (model building, phases, evaluation) sees the same substitute, without the real data being opened."""
    _SUBSTITUTES.append(builder)
    try:
        yield
    finally:
        _SUBSTITUTES.remove(builder)
