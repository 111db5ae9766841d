"""The NSGF trajectory pool (paper Algorithm 1, "experience replay"), built once, sampled by index.

Storage is three preallocated ``.npy`` files in ``RUN/pool/`` (x_t, v_t and t; memmap-able and
readable by numpy), filled chunk by chunk. After each chunk is flushed, ``progress.json`` is
rewritten atomically, so a killed build resumes at the first unfinished chunk. Pool batch ``b`` draws
its source and target points from a generator seeded by (seed, b): a resumed build is identical to
an uninterrupted one. Training then samples entries by index from one contiguous array: RAM-resident
(``storage=memory``) or memory-mapped from disk (``storage=disk``); never re-concatenated.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

from sinkflow.errors import SinkflowError
from sinkflow.runner import dist
from sinkflow.runner.checkpoint import atomic_write_bytes
from sinkflow.runner.phase import Phase, phase_generator, progress
from sinkflow.runner.signals import Interrupted, stop_requested

DTYPES = {"float32": np.float32, "float16": np.float16}


def pool_entries(pool_cfg: dict) -> int:
    return pool_cfg["batches"] * pool_cfg["steps"] * pool_cfg["batch_size"]


def pool_bytes(pool_cfg: dict, sample_shape: tuple[int, ...]) -> int:
    """Bytes of x, v (in the pool dtype) and t (float32) for the whole pool."""
    dim = math.prod(sample_shape)
    item = np.dtype(DTYPES[pool_cfg["dtype"]]).itemsize
    return pool_entries(pool_cfg) * (2 * dim * item + 4)


def check_pool_fits(pool_cfg: dict, sample_shape: tuple[int, ...], folder: Path) -> None:
    """Refuse before any work when the pool cannot fit the configured RAM / disk budget."""
    if pool_cfg["dtype"] not in DTYPES:
        raise SinkflowError(f"pool.dtype={pool_cfg['dtype']!r} is not supported", "use float32 or float16")
    if pool_cfg["storage"] not in ("memory", "disk"):
        raise SinkflowError(f"pool.storage={pool_cfg['storage']!r} is not supported", "use memory or disk")
    need = pool_bytes(pool_cfg, sample_shape)
    gib = need / 2**30
    half = "" if pool_cfg["dtype"] == "float16" else ", pool.dtype=float16 (halves it)"
    if pool_cfg["storage"] == "memory" and gib > pool_cfg["ram_gb"]:
        raise SinkflowError(
            f"the trajectory pool needs {gib:.1f} GiB of RAM but pool.ram_gb={pool_cfg['ram_gb']}",
            f"set pool.storage=disk{half}, fewer pool.batches, or a larger pool.ram_gb")
    disk_limit = pool_cfg["disk_gb"]
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free / 2**30
    if gib > min(disk_limit, free):
        raise SinkflowError(
            f"the trajectory pool needs {gib:.1f} GiB of disk but only {min(disk_limit, free):.1f} GiB is allowed/free",
            f"use fewer pool.batches{half}, or point experiment.runs_dir at a larger disk")


class TrajectoryPool:
    """Read side of a finished pool: ``sample(idx)`` -> (x_t, t, v_t) as float32 tensors."""

    def __init__(self, folder: Path, storage: str = "memory"):
        self.folder = Path(folder)
        mode = "r" if storage == "disk" else None
        arrays = [np.load(self.folder / f"{k}.npy", mmap_mode=mode) for k in ("x", "v", "t")]
        self.x, self.v, self.t = arrays if storage == "disk" else [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        self.on_disk = storage == "disk"

    def __len__(self) -> int:
        return self.x.shape[0]

    def sample(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.on_disk:
            order = np.sort(idx.numpy())  # sequential reads; the batch order is irrelevant to the loss
            x, v, t = (torch.from_numpy(np.asarray(a[order])) for a in (self.x, self.v, self.t))
        else:
            x, v, t = self.x[idx], self.v[idx], self.t[idx]
        return x.float(), t.float(), v.float()


class PoolPhase(Phase):
    """Simulate ``pool.batches`` Sinkhorn-flow trajectories of ``pool.steps`` Euler steps each."""

    name = "pool"

    def __init__(self, source, target, simulate):
        self.source, self.target, self.simulate = source, target, simulate

    def run(self, run) -> None:
        cfg = run.cfg["pool"]
        info = dist.current()
        folder = run.dir / "pool"
        shape = tuple(self.target.shape)
        check_pool_fits(cfg, shape, folder)
        n, steps, batches, chunk = cfg["batch_size"], cfg["steps"], cfg["batches"], max(1, cfg["chunk"])
        per_batch = steps * n
        total = batches * per_batch
        dtype = DTYPES[cfg["dtype"]]
        progress_file = folder / "progress.json"
        done = set(json.loads(progress_file.read_text())["chunks"]) if progress_file.exists() else set()
        if info.is_main and not (folder / "x.npy").exists():
            for key, shp, dt in (("x", (total, *shape), dtype), ("v", (total, *shape), dtype), ("t", (total,), np.float32)):
                np.lib.format.open_memmap(folder / f".{key}.npy.tmp", mode="w+", dtype=dt, shape=shp).flush()
                (folder / f".{key}.npy.tmp").rename(folder / f"{key}.npy")
        dist.barrier()
        arrays = {k: np.load(folder / f"{k}.npy", mmap_mode="r+") for k in ("x", "v", "t")}
        n_chunks = math.ceil(batches / chunk)
        bar = progress(n_chunks * chunk, len(done) * chunk, "pool")
        seed = run.cfg["experiment"]["seed"]
        todo = [c for c in range(n_chunks) if c not in done]
        for r in range(0, len(todo), info.world):  # each round, rank k builds the k-th chunk left
            c = todo[r + info.rank] if r + info.rank < len(todo) else None
            for b in range(c * chunk, min((c + 1) * chunk, batches)) if c is not None else ():
                gen = phase_generator(seed, "pool", b)
                x0 = self.source.sample(n, gen, run.device)
                y = self.target.sample(n, gen, run.device)
                xs, vs, ts = self.simulate(x0, y)
                lo = b * per_batch
                arrays["x"][lo : lo + per_batch] = xs.reshape(per_batch, *shape).cpu().numpy().astype(dtype)
                arrays["v"][lo : lo + per_batch] = vs.reshape(per_batch, *shape).cpu().numpy().astype(dtype)
                arrays["t"][lo : lo + per_batch] = ts.repeat_interleave(n).cpu().numpy()
                bar.update(1)
            for a in arrays.values():
                a.flush()
            if c is not None:
                done.add(c)
            if info.enabled:
                gathered: list = [None] * info.world
                torch.distributed.all_gather_object(gathered, sorted(done))
                done = set().union(*gathered)
            if info.is_main:
                atomic_write_bytes(progress_file, lambda f: f.write(json.dumps({"chunks": sorted(done)}).encode()))
                run.logger.heartbeat(phase="pool", step=len(done), total=n_chunks, state="running")
            signum = stop_requested()
            if signum is not None:
                bar.close()
                raise Interrupted(signum, self.name, len(done))
        bar.close()
        del arrays
        dist.barrier()
        if info.is_main:
            run.checkpoints(self.name).save_final({"pool": str(folder), "entries": total, "chunks": n_chunks})
        dist.barrier()
