"""The NSGF trajectory pool (paper Algorithm 1, "experience replay"), built once, sampled by index.

Storage is three preallocated ``.npy`` files in ``RUN/pool/`` (x_t, v_t and t; memmap-able and
readable by numpy), filled chunk by chunk. After each chunk is flushed, ``progress.json`` is
rewritten atomically, so a killed build resumes at the first unfinished chunk. Pool batch ``b`` draws
its source and target points from a generator seeded by (seed, b): a resumed build is identical to
an uninterrupted one. Training then samples entries by index from one contiguous array: RAM-resident
(``storage=memory``) or memory-mapped from disk (``storage=disk``); never re-concatenated.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch

from sinkflow.data.atomic_write import atomic_path, atomic_write_text, create_array
from sinkflow.errors import SinkflowError, human_bytes
from sinkflow.methods.base import ChunkedTask, check_disk_room
from sinkflow.ot.sinkhorn import SolveStats, solve_stats
from sinkflow.runtime import dist
from sinkflow.runtime.identity import first_difference, identity
from sinkflow.runtime.lock import check_held
from sinkflow.runtime.rng import phase_generator
from sinkflow.runtime.signals import signalled

log = logging.getLogger("sinkflow")

DTYPES = {"float32": np.float32, "float16": np.float16}


def pool_entries(pool_cfg: dict) -> int:
    return pool_cfg["batches"] * pool_cfg["steps"] * pool_cfg["batch_size"]


def pool_bytes(pool_cfg: dict, sample_shape: tuple[int, ...]) -> int:
    """Bytes of x, v (in the pool dtype) and t (float32) for the whole pool."""
    dim = math.prod(sample_shape)
    item = np.dtype(DTYPES[pool_cfg["dtype"]]).itemsize
    return pool_entries(pool_cfg) * (2 * dim * item + 4)


def check_pool_fits(pool_cfg: dict, sample_shape: tuple[int, ...]) -> None:
    """Refuse a pool the config's own budgets (``pool.ram_gb``, ``pool.disk_gb``) cannot hold. A property of the
    config alone: the memory plan and every machine give the same answer (the free disk is ``check_free_disk``)."""
    if pool_cfg["dtype"] not in DTYPES:
        raise SinkflowError(f"pool.dtype={pool_cfg['dtype']!r} is not supported", "use float32 or float16")
    if pool_cfg["storage"] not in ("memory", "disk"):
        raise SinkflowError(f"pool.storage={pool_cfg['storage']!r} is not supported", "use memory or disk")
    need = pool_bytes(pool_cfg, sample_shape)
    half = _halves(pool_cfg)
    if pool_cfg["storage"] == "memory" and need / 2**30 > pool_cfg["ram_gb"]:
        raise SinkflowError(
            f"the trajectory pool needs {human_bytes(need)} of RAM but pool.ram_gb={pool_cfg['ram_gb']}",
            f"set pool.storage=disk{half}, fewer pool.batches, or a larger pool.ram_gb")
    if need > pool_cfg["disk_gb"] * 2**30:
        raise SinkflowError(
            f"the trajectory pool needs {human_bytes(need)} of disk but pool.disk_gb={pool_cfg['disk_gb']}",
            f"use fewer pool.batches{half}, or a larger pool.disk_gb")


def check_free_disk(pool_cfg: dict, sample_shape: tuple[int, ...], folder: Path, others: dict | None = None) -> None:
    """Refuse, before any work, a pool the disk under ``folder`` cannot hold, with ``others`` (bytes by what else the
    run writes there: a new run's checkpoints). The blocks the pool's arrays already reserve there (a resumed build:
    ``reserve_disk``) count as the pool's own, not as space it still needs. Creates nothing."""
    held = sum(f.stat().st_blocks * 512 for f in (folder / f"{k}.npy" for k in ("x", "v", "t")) if f.is_file())
    check_disk_room({"the trajectory pool": pool_bytes(pool_cfg, sample_shape), **(others or {})}, folder,
                    f"use fewer pool.batches{_halves(pool_cfg)}{', a lower checkpoint.keep' if others else ''}, or "
                    "point experiment.runs_dir at a larger disk", held)


def _halves(pool_cfg: dict) -> str:
    return "" if pool_cfg["dtype"] == "float16" else ", pool.dtype=float16 (halves it)"


def pool_seed(cfg: dict) -> int:
    """The seed of the pool's draws: ``pool.seed``, or the run's ``experiment.seed`` when it is null. Apart, they
    tell a velocity network's luck with its pool (which trajectories) from its luck with its init and batch order."""
    seed = cfg["pool"].get("seed")
    return cfg["experiment"]["seed"] if seed is None else seed


def load_pool_array(path: Path, mmap_mode: str | None):
    """One of the pool's .npy files (never unpickled); a missing or damaged one is a one-line error."""
    try:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, FileNotFoundError):
            raise  # a full disk, a permission problem: the CLI reports the OSError itself
        raise SinkflowError(f"pool file {path} is missing or damaged ({type(exc).__name__})", rebuild_fix(path.parent)) from None


def rebuild_fix(folder: Path) -> str:
    """How to rebuild a run's pool: its arrays and its final checkpoint go; the later phases' checkpoints stay (the
    same config and seed rebuild the same pool: a test compares a rebuilt pool and the phase resumed on it)."""
    return (f"delete {folder} and {folder.parent / 'checkpoints' / 'pool'} and resume: the pool is rebuilt from the "
            "same seed and the later phases' checkpoints are kept")


def check_progress(saved: dict, ours: dict, path: Path) -> None:
    """Refuse to go on with a half-built pool whose recorded keys (``built_with``: the pool's frozen keys and
    pool.chunk, which numbers the chunks) differ from the run's config: a hand-edited config.yaml got past the
    resume's override check, and finished chunks were left as zeros (pool.chunk 2 -> 4) or a later chunk failed
    with a broadcast error (pool.batches 32 -> 64)."""
    diff = first_difference(saved.get("built_with"), ours)  # a progress file without it (older sinkflow): unchecked
    if diff:
        key, was, now = diff
        raise SinkflowError(f"the pool in {path.parent} was built with {key}={was!r} but the run's config.yaml has "
                            f"{key}={now!r}", f"set {key} back to {was!r} in config.yaml to finish this pool, or "
                            f"{rebuild_fix(path.parent)}")


class TrajectoryPool:
    """Read side of a finished pool: ``sample(idx)`` -> (x_t, t, v_t) as float32 tensors."""

    def __init__(self, folder: Path, storage: str = "memory"):
        self.folder = Path(folder)
        mode = "r" if storage == "disk" else None
        arrays = [load_pool_array(self.folder / f"{k}.npy", mode) for k in ("x", "v", "t")]
        self.x, self.v, self.t = arrays if storage == "disk" else [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        self.on_disk = storage == "disk"

    def __len__(self) -> int:
        return self.x.shape[0]

    def sample(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.on_disk:  # read in file order (sequential reads), then put back in the batch's order: the loss sums
            # the rows in that order (and accumulation splits them by it), so rows left sorted trained other bits than
            # a pool in memory gives, and a run resumed with pool.storage=disk (a runtime key) was not the run it
            # continued
            pos = np.argsort(idx.numpy(), kind="stable")
            back = np.empty_like(pos)
            back[pos] = np.arange(len(pos))
            order = idx.numpy()[pos]
            x, v, t = (torch.from_numpy(np.asarray(a[order])[back]) for a in (self.x, self.v, self.t))
        else:
            x, v, t = self.x[idx], self.v[idx], self.t[idx]
        return x.float(), t.float(), v.float()

    def batch(self, idx: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``sample(idx)`` on ``device``. On CUDA the rows go through two alternating page-locked
        staging slots, so the host-to-device copy is truly asynchronous (a copy from pageable memory
        is not); a slot is refilled only after the copy that last read it has finished."""
        device = torch.device(device)
        rows = self.sample(idx)
        if device.type != "cuda":
            return rows
        if not hasattr(self, "_slots"):
            self._slots, self._events, self._turn = [None, None], [None, None], 0
        k, self._turn = self._turn, self._turn ^ 1
        slot = self._slots[k]
        if slot is None or any(s.shape != r.shape for s, r in zip(slot, rows)):
            slot = self._slots[k] = tuple(torch.empty(r.shape, dtype=r.dtype).pin_memory() for r in rows)
        if self._events[k] is not None:
            self._events[k].synchronize()
        for s, r in zip(slot, rows):
            s.copy_(r)
        out = tuple(s.to(device, non_blocking=True) for s in slot)
        self._events[k] = torch.cuda.Event()
        self._events[k].record()
        return out


DIVERGED_RADII = 10  # pool particles beyond this multiple of the data's radius: the flow diverged
BLUR_SPAN_WARN = 1e4  # Sinkhorn diameter / blur above which the pool warns (PoolTask.warn_scale)
CAPPED_WARN_SHARE = 0.10  # a pool build warns when more of its Sinkhorn solves than this stopped at max_iters
CPU_BUDGET_BYTES = 1 << 30  # pool batches in flight on CPU: a modest fixed budget (1 GiB)
CUDA_BUDGET_FRACTION = 0.5  # ... on CUDA: this fraction of the memory free when the pool phase starts


def choose_in_flight(pool_cfg: dict, sample_shape: tuple[int, ...], device: torch.device) -> int:
    """Pool batches solved by one batched Sinkhorn call: ``pool.in_flight``, or (0) from a memory budget.

    The budget covers GeomLoss's working set (``sinkflow.ot.max_batches_in_flight``) plus the group's
    float32 trajectory (x_t and v_t for every step) kept on the device until it is copied out.
    """
    batches = pool_cfg["batches"]
    if pool_cfg["in_flight"] > 0:
        return max(1, min(int(pool_cfg["in_flight"]), batches))
    from sinkflow.ot import max_batches_in_flight

    n, dim, steps = pool_cfg["batch_size"], math.prod(sample_shape), pool_cfg["steps"]
    if device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * CUDA_BUDGET_FRACTION)
    else:
        budget = CPU_BUDGET_BYTES
    by_ot = max_batches_in_flight(n, dim, budget // 2)
    by_storage = (budget // 2) // max(1, 2 * steps * n * dim * 4)
    return int(max(1, min(batches, by_ot, by_storage)))


def _accepts(simulate, arg: str) -> bool:
    try:
        return arg in inspect.signature(simulate).parameters
    except (TypeError, ValueError):
        return False


def step_sizes(pool_cfg: dict) -> torch.Tensor:
    """eta_k for k = 0..T-1 (``pool.schedule``: constant, incremental or harmonic)."""
    from sinkflow.ot import eta_schedule

    return torch.tensor(eta_schedule(pool_cfg["eta"], pool_cfg["steps"], pool_cfg["eta_growth"] or None,
                                     pool_cfg.get("schedule")))


class PoolTask(ChunkedTask):
    """Simulate ``pool.batches`` Sinkhorn-flow trajectories of ``pool.steps`` Euler steps each.

    ``simulate(x0, y, batched=True)`` with x0, y shaped (B, n, *) returns (xs, vs, ts) with xs, vs
    (steps, B, n, *): up to ``in_flight`` pool batches go through one batched Sinkhorn solve. Pool
    batch b always draws from its own generator seeded by (seed, b), so the pool does not depend on
    in_flight beyond float rounding and the shared annealing diameter (see docs/performance.md).
    A simulator without a ``batched`` argument is called one pool batch at a time.

    A task of the engine (``sinkflow.engine.trainer.Trainer``) whose unit is a round of chunks: in each
    round rank k builds the k-th chunk left, then ``progress.json`` is rewritten atomically, so a stopped or
    killed build resumes at the first unfinished chunk.
    """

    name = "pool"

    def __init__(self, source, target, simulate):
        self.source, self.target, self.simulate = source, target, simulate

    def pool_diameter(self, run) -> float | None:
        """One Sinkhorn diameter for the whole build (``sinkhorn.diameter``, or null: the bounding-box
        diagonal of every pool batch's source and target samples), so the annealing schedule, and hence
        the pool, does not depend on which batches share a solve. Streamed: nothing is kept."""
        fixed = run.cfg.get("sinkhorn", {}).get("diameter")
        if fixed is not None:
            return float(fixed)
        cfg, lo, hi = run.cfg["pool"], None, None
        for b in range(cfg["batches"]):
            gen = phase_generator(pool_seed(run.cfg), "pool", b)
            pts = torch.cat([self.source.sample(cfg["batch_size"], gen, "cpu").flatten(1),
                             self.target.sample(cfg["batch_size"], gen, "cpu").flatten(1)])
            lo = pts.amin(0) if lo is None else torch.minimum(lo, pts.amin(0))
            hi = pts.amax(0) if hi is None else torch.maximum(hi, pts.amax(0))
        return max(float((hi - lo).float().norm()), 1e-6)

    def warn_scale(self, blur: float | None) -> None:
        """Warn, before any solve, when the data spans far more than ``sinkhorn.blur``: blur is a length in the
        data's units, and points at a scale of 1e6 with the default 0.2 left every solve at max_iters and the flow
        untrained, with only the max_iters warning's advice. The presets span 53 (scurve) to 206 (mnist, on synthetic
        images of its shape) blurs: the warning is at 10^4. Its fix is to standardise: moons x 100 with blur 20
        scored W2 / scale 1.59 (1.29 at the default blur), x 1e4 with blur 2000 3.09, no learning (audit T,
        2026-11-30)."""
        if blur and self.diameter and self.diameter / blur > BLUR_SPAN_WARN and self.info.is_main:
            log.warning("pool: the data spans %.3g (the Sinkhorn diameter), %.2g x sinkhorn.blur=%g: blur is a length "
                        "in the data's units, so the solves will not converge; standardise the data (points - mean, "
                        "/ std; map the samples back): the recipes are set for a spread of about 1, and a blur raised "
                        "in proportion did not make such a run learn", self.diameter,
                        self.diameter / blur, blur)

    def _simulate_group(self, batch_ids: list[int], seed: int, n: int, device) -> tuple:
        """(xs, vs, ts) on the CPU for the pool batches ``batch_ids``: xs, vs (steps, B, n, *).
        Sets ``self.data_radius``: the largest coordinate of the group's source and target samples."""
        x0s, ys = [], []
        for b in batch_ids:
            gen = phase_generator(seed, "pool", b)
            x0s.append(self.source.sample(n, gen, "cpu"))
            ys.append(self.target.sample(n, gen, "cpu"))
        self.data_radius = max(float(torch.stack(x0s).abs().max()), float(torch.stack(ys).abs().max()), 1e-6)
        kw = {"diameter": self.diameter} if self.diameter is not None and _accepts(self.simulate, "diameter") else {}
        if len(batch_ids) > 1 and _accepts(self.simulate, "batched"):
            x0 = torch.stack(x0s).to(device, non_blocking=True)
            y = torch.stack(ys).to(device, non_blocking=True)
            xs, vs, ts = self.simulate(x0, y, batched=True, **kw)
            return xs.cpu(), vs.cpu(), ts.cpu()
        outs = [self.simulate(x0.to(device), y.to(device), **kw) for x0, y in zip(x0s, ys)]
        return (torch.stack([o[0].cpu() for o in outs], 1), torch.stack([o[1].cpu() for o in outs], 1),
                outs[0][2].cpu())

    # ---- the engine's protocol ------------------------------------------------------------------
    def check_done(self, run) -> None:
        """The finished pool's arrays load (headers only: memory-mapped), so a resume whose pool file was deleted
        or damaged is refused before the run folder changes, not after ``run.start()``."""
        self.load_arrays(run.dir / "pool", self.layout(run.cfg["pool"]), "r")

    def layout(self, pool_cfg: dict) -> dict:
        """{name: (shape, dtype)} of the pool's arrays x, v (in pool.dtype) and t (float32)."""
        entries, shape, dtype = pool_entries(pool_cfg), tuple(self.target.shape), DTYPES[pool_cfg["dtype"]]
        return {"x": ((entries, *shape), dtype), "v": ((entries, *shape), dtype), "t": ((entries,), np.float32)}

    @staticmethod
    def load_arrays(folder: Path, layout: dict, mode: str) -> dict:
        """The pool's arrays, memory-mapped; one that is missing, damaged or of another shape or dtype than
        ``layout`` (a pool copied in from another run) is refused in one line."""
        arrays = {}
        for key, (shape, dtype) in layout.items():
            a = arrays[key] = load_pool_array(folder / f"{key}.npy", mode)
            if a.shape != shape or a.dtype != dtype:
                raise SinkflowError(f"pool file {folder / (key + '.npy')} holds {a.dtype} {a.shape} but this run's "
                                    f"pool needs {np.dtype(dtype)} {shape}", rebuild_fix(folder))
        return arrays

    def check_resume(self, run) -> int:
        """A half-built pool's progress: readable, built with the run's keys, its arrays there (``read_progress``);
        returns its finished chunks (``position`` once it opens)."""
        return len(self.read_progress(run).get("chunks", []))

    def read_progress(self, run) -> dict:
        """progress.json of ``run``'s pool ({} before the first write), refused in one line when it is damaged,
        was built with other keys than the run's config (``check_progress``) or records finished chunks whose
        arrays are gone."""
        folder, cfg = run.dir / "pool", run.cfg["pool"]
        path = folder / "progress.json"
        try:
            saved = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            saved = None
        chunks = saved.get("chunks", []) if isinstance(saved, dict) else None
        if not (isinstance(chunks, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in chunks)):
            # JSON that is no progress record (`null`, a list, chunks of text) is damaged too: it was a traceback
            raise SinkflowError(f"{path} is damaged", "delete it to rebuild the pool from scratch")
        check_progress(saved, self.built_with_keys(run.cfg), path)
        missing = [k for k in ("x", "v", "t") if not (folder / f"{k}.npy").exists()]
        if saved.get("chunks") and missing:
            raise SinkflowError(f"pool file {folder / (missing[0] + '.npy')} is missing but {len(saved['chunks'])} "
                                f"chunk(s) are recorded as built in {path}", rebuild_fix(folder))
        return saved

    @staticmethod
    def built_with_keys(cfg: dict) -> dict:
        """The keys a pool's arrays depend on: its frozen keys, and pool.chunk (it numbers the finished chunks)."""
        return {**identity(cfg, "pool")["frozen"], "pool.chunk": max(1, cfg["pool"]["chunk"])}

    def open(self, run) -> None:
        """Check the budget, read the progress, create the arrays once, and plan the rounds left."""
        cfg = run.cfg["pool"]
        self.run, self.info = run, dist.current()
        folder = self.folder = run.dir / "pool"
        shape = self.shape = tuple(self.target.shape)
        check_pool_fits(cfg, shape)
        check_free_disk(cfg, shape, folder)
        self.n, self.steps, self.batches, self.chunk = cfg["batch_size"], cfg["steps"], cfg["batches"], max(1, cfg["chunk"])
        self.per_batch = self.steps * self.n
        self.entries = self.batches * self.per_batch
        self.dtype = DTYPES[cfg["dtype"]]
        self.progress_file = folder / "progress.json"
        saved = self.read_progress(run)
        self.done = set(saved.get("chunks", []))
        self.built_with = self.built_with_keys(run.cfg)
        # the diameter is fixed once per build and kept with the progress, so a resumed build matches
        self.diameter = saved["diameter"] if saved.get("diameter") is not None else self.pool_diameter(run)
        self.warn_scale(run.cfg.get("sinkhorn", {}).get("blur"))
        layout = self.layout(cfg)

        def create() -> None:  # rank 0; its failure (a full disk) is every rank's one line (dist.on_main)
            if any(not (folder / f"{k}.npy").exists() for k in layout):  # no chunk built yet
                for key, (shp, dt) in layout.items():  # nothing built yet (a build killed while creating them): anew
                    with atomic_path(folder / f"{key}.npy") as tmp:
                        create_array(tmp, dt, shp, folder / f"{key}.npy").flush()
                self.write_progress()

        dist.on_main(create)
        self.arrays = self.load_arrays(folder, layout, "r+")
        self.total = math.ceil(self.batches / self.chunk)
        self.seed = pool_seed(run.cfg)
        # a chunk is the unit of resume: a group never spans chunks, so in_flight is at most pool.chunk
        self.in_flight = min(choose_in_flight(cfg, shape, run.device), self.chunk)
        self.groups = [[c] for c in range(self.total) if c not in self.done]
        self.round = 0
        self.progress_total = self.batches
        self.progress_done = sum(len(_chunk_batches(c, self.chunk, self.batches)) for c in self.done)
        self.solves = SolveStats()  # this build's converged-solver problems, reported at close
        log.info("pool: %d batches of %d particles x %d steps, %d in flight, %d process(es)",
                 self.batches, self.n, self.steps, self.in_flight, self.info.world)

    @property
    def position(self) -> int:
        return len(self.done)

    def finished(self) -> bool:
        return self.round >= len(self.groups)

    def next_unit(self) -> list[int]:
        """This rank's chunks of the next round (each round, rank k builds the k-th group of chunks left)."""
        r, info = self.round, self.info
        self.round += info.world
        return self.groups[r + info.rank] if r + info.rank < len(self.groups) else []

    def run_unit(self, mine: list[int]) -> int:
        """Build the chunks ``mine``, flush them, agree on what is done, write the progress (main).

        A signal stops the build before its next group of batches: a preempted job has seconds (torchrun SIGKILLs a
        worker 30 s after its SIGTERM, and a 50-batch chunk on a slow card can outlast that). The unit is abandoned
        unrecorded (redone on resume) and the Trainer stops after it. Under DDP the rank still joins the unit's
        gather, so every rank makes the same collectives whichever groups each had left (the others abandon theirs
        too: torchrun signals every worker).

        A group whose flow diverged (``diverged``) is not written and ends the rank's unit the same way; the error
        is raised after the gather, on every rank alike (the first diverged rank's), so torchrun prints one line
        where each diverging rank printed its own and the others the lost-peer line; the chunks the other ranks
        finished are recorded first."""
        ids = [b for c in mine for b in _chunk_batches(c, self.chunk, self.batches)]
        shape, per_batch, arrays = self.shape, self.per_batch, self.arrays
        abandoned, diverged = False, None
        for g in range(0, len(ids), self.in_flight):
            if g and signalled() is not None:
                abandoned = True
                break
            group = ids[g : g + self.in_flight]
            with solve_stats(self.solves):
                xs, vs, ts = self._simulate_group(group, self.seed, self.n, self.run.device)
            diverged = self.diverged(xs, vs, group)
            if diverged is not None:
                break
            t_rows = ts.repeat_interleave(self.n).numpy()
            for j, b in enumerate(group):
                lo = b * per_batch
                arrays["x"][lo : lo + per_batch] = xs[:, j].reshape(per_batch, *shape).numpy().astype(self.dtype)
                arrays["v"][lo : lo + per_batch] = vs[:, j].reshape(per_batch, *shape).numpy().astype(self.dtype)
                arrays["t"][lo : lo + per_batch] = t_rows
        if diverged is not None and not self.info.enabled:
            raise SinkflowError(*diverged, every_rank=True)
        if abandoned and not self.info.enabled:
            return 0
        for a in arrays.values():
            a.flush()
        if not abandoned and diverged is None:
            self.done.update(mine)
        if self.info.enabled:  # (problem, fix) strings travel, not an exception object
            gathered: list = [None] * self.info.world
            torch.distributed.all_gather_object(gathered, (sorted(self.done), diverged))
            self.done = set().union(*(set(done) for done, _ in gathered))
            diverged = next((why for _, why in gathered if why is not None), None)
        dist.on_main(self.write_progress)
        if diverged is not None:
            raise SinkflowError(*diverged, every_rank=True)  # every rank raises it: rank 0 says it
        self.progress_done = sum(len(_chunk_batches(c, self.chunk, self.batches)) for c in self.done)  # every rank's
        return 0 if abandoned else len(ids)

    def write_progress(self) -> None:
        """progress.json: the finished chunks, the build's diameter and the keys it was built with (checked when
        the build resumes: ``check_progress``)."""
        check_held(self.run.dir)
        atomic_write_text(self.progress_file, json.dumps({"chunks": sorted(self.done), "diameter": self.diameter,
                                                          "built_with": self.built_with}, default=str))

    def diverged(self, xs: torch.Tensor, vs: torch.Tensor, group: list[int]) -> tuple[str, str] | None:
        """(problem, fix) of the stop before writing a group whose particles left ``DIVERGED_RADII`` x the data's
        radius, else None: the flow diverged while staying finite (pool.eta=100 with the harmonic schedule reaches
        |x| ~ 1e5-1e6 at its first chunk; a sound pool stays within ~1.2 x the radius on every 2D preset and digits,
        measured). The states looked at are xs (those before each step) and the end point x_T = xs[-1] + eta_{T-1}
        vs[-1], which the pool does not store but trains on (the last velocity target is the step to it, and
        nsgf.segment > 0 draws points along it) and the sampler ends at: looking at xs alone passed a flow whose last
        step alone left the data (pool.steps=1, pool.eta=100, landing=sinkhorn on moons: x_T at ~130 radii, velocity
        loss 1.2e4, built in silence; audit RR)."""
        cfg = self.run.cfg["pool"]
        last = float(step_sizes(cfg)[-1])
        tops = torch.stack([x.abs().max() for x in xs] + [(xs[-1] + last * vs[-1]).abs().max()]).tolist()  # one read
        bound = DIVERGED_RADII * self.data_radius
        out = next((k for k, top in enumerate(tops) if not top <= bound), None)  # NaN is out too
        if out is None:
            return None
        where = " (its end point x_T)" if out == len(xs) else ""
        return (f"the pool's Sinkhorn flow diverged: particles reached |x| = {tops[out]:.3g} after step {out} of "
                f"{len(xs)}{where} in pool batch {group[0]}, more than {DIVERGED_RADII} x the data's radius "
                f"({self.data_radius:.3g}); this chunk was not written",
                f"start a new run with a lower pool.eta (this one has pool.eta={cfg['eta']:g} with "
                f"pool.schedule={cfg['schedule']}; 1 lands on the target with the harmonic schedule)")

    def close(self) -> None:
        self.arrays = None
        self.report_solves()

    def report_solves(self) -> None:
        """One line on the converged solver's problems of this build (the health of the pool's velocities),
        instead of a warning per call: how many stopped at ``sinkhorn.max_iters`` before ``sinkhorn.tol``. A
        warning above ``CAPPED_WARN_SHARE``; below it the capped ones are nearly converged (a 192-batch pool of the
        suite's `spiral` with the 2D recipe caps 3.5 % of its solves, and the recipe's 200-iteration cap leaves end
        points within 3e-4 of converged: docs/nsgf.md, benchmarks/pool_convergence.py)."""
        st = self.solves
        if self.info.enabled:  # each rank solved its own chunks: the line is about the whole pool (a collective)
            shares: list = [None] * self.info.world
            torch.distributed.all_gather_object(shares, st)
            st = SolveStats()
            for share in shares:
                st.merge(share)
        if not st.problems or not self.info.is_main:
            return
        share = st.capped / st.problems
        its = sorted(st.iterations)
        line = (f"pool: {st.capped:,} of {st.problems:,} Sinkhorn solves ({share:.1%}) stopped at sinkhorn.max_iters="
                f"{st.max_iters} before sinkhorn.tol={st.tol:g}; median {its[len(its) // 2]} iterations at the final "
                f"epsilon")
        if share > CAPPED_WARN_SHARE:
            log.warning("%s: the pool's velocities are not converged; raise sinkhorn.max_iters (or sinkhorn.blur: a "
                        "larger epsilon converges faster)", line)
        else:
            log.info("%s", line)

    def final_state(self) -> dict:
        return {"pool": str(self.folder), "entries": self.entries, "chunks": self.total, "step": self.total}

    def memory(self, cfg: dict, shape: tuple[int, ...]) -> dict:
        """GeomLoss's working set for ``in_flight`` pool batches (``sinkflow.ot.sinkhorn_peak_bytes``, calibrated
        against measured allocations) + the group's float32 trajectory (x_t, v_t for every step) kept on the
        device until it is copied to the pool, which lives in host RAM or on disk (``pool_bytes``)."""
        from sinkflow.ot import sinkhorn_peak_bytes

        p, dim = cfg["pool"], math.prod(shape)
        flight = max(1, p["in_flight"])
        stored = pool_bytes(p, shape)
        return {"terms": {"sinkhorn": sinkhorn_peak_bytes(flight, p["batch_size"], dim),
                          "trajectory": 2 * p["steps"] * flight * p["batch_size"] * dim * 4},
                "host_bytes": 0 if p["storage"] == "disk" else stored,
                "disk_bytes": stored if p["storage"] == "disk" else 0,
                "note": f"{flight} batch(es) of {p['batch_size']} in flight"
                        + (" (pool.in_flight=0 adapts to the card; this is the minimum)" if p["in_flight"] == 0 else "")}

    def fit_memory(self, cfg: dict, shape: tuple[int, ...], device_bytes: int) -> tuple[dict, list[str]]:
        """One pool batch in flight, then halve the Sinkhorn batch (doubling pool.batches: the same trajectories)
        until one batch fits (none proposed when not even a batch of 2 does); float16, then disk, when the pool
        exceeds pool.ram_gb, decided by ``pool_bytes`` of the proposed pool itself (float16 halves x and v, not
        the float32 t of every entry)."""
        from sinkflow.ot import sinkhorn_peak_bytes

        p, dim = dict(cfg["pool"]), math.prod(shape)
        overrides, reasons = {}, []
        mem = self.memory(cfg, shape)

        def one_batch(n: int) -> int:
            return sinkhorn_peak_bytes(1, n, dim) + 8 * p["steps"] * n * dim

        if sum(mem["terms"].values()) > device_bytes:
            if one_batch(min(2, p["batch_size"])) > device_bytes:
                reasons.append(f"pool: does not fit at any Sinkhorn batch: one batch of 2 needs "
                               f"{human_bytes(one_batch(2))}, {human_bytes(max(device_bytes, 0))} are left beside "
                               "the CUDA workspaces; use a larger card")
            else:
                if p["in_flight"] > 1:
                    p["in_flight"] = 0
                    overrides["pool.in_flight"] = 0
                while one_batch(p["batch_size"]) > device_bytes and p["batch_size"] > 2:
                    p["batch_size"] //= 2
                    p["batches"] *= 2
                if p["batch_size"] != cfg["pool"]["batch_size"]:
                    overrides["pool.batch_size"] = p["batch_size"]
                    overrides["pool.batches"] = p["batches"]
                    reasons.append(f"pool: Sinkhorn batch {cfg['pool']['batch_size']} -> {p['batch_size']} with "
                                   f"{p['batches']} pool batches (same {p['batches'] * p['batch_size']} trajectories)")
        reasons += self._fit_storage(p, shape, overrides)
        return overrides, reasons

    @staticmethod
    def _fit_storage(p: dict, shape: tuple[int, ...], overrides: dict) -> list[str]:
        """Where the proposed pool ``p`` is kept: in RAM while it fits ``pool.ram_gb`` (float16 first: it halves x
        and v), else on disk, in float32 (exact) while that fits ``pool.disk_gb``, else in float16. ``p`` and
        ``overrides`` take the changes; the reasons say why, or that not even a float16 pool on disk fits."""
        def need() -> int:
            return pool_bytes(p, shape)

        def halved() -> int:
            return pool_bytes({**p, "dtype": "float16"}, shape)

        def change(key: str, value) -> None:
            p[key] = overrides[f"pool.{key}"] = value

        reasons = []
        ram, disk = p["ram_gb"] * 2**30, p["disk_gb"] * 2**30
        if p["storage"] != "disk" and need() > ram:
            first = need()
            change(*(("dtype", "float16") if p["dtype"] != "float16" and halved() <= ram else ("storage", "disk")))
            reasons.append(f"pool: {human_bytes(first)} of RAM > pool.ram_gb={p['ram_gb']}: "
                           + ", ".join(f"{k}={v}" for k, v in overrides.items() if k in ("pool.dtype", "pool.storage")))
        if p["storage"] == "disk" and need() > disk:
            first = need()
            if p["dtype"] != "float16" and halved() <= disk:
                change("dtype", "float16")
                reasons.append(f"pool: {human_bytes(first)} of disk > pool.disk_gb={p['disk_gb']}: pool.dtype=float16")
            else:
                reasons.append(f"pool: does not fit pool.disk_gb={p['disk_gb']} on disk even in float16 "
                               f"({human_bytes(halved())}); use fewer pool.batches or a larger pool.disk_gb")
        return reasons

    def output(self, run) -> np.ndarray | None:
        """The pool's particle positions as written so far (rows of unfinished chunks are zero)."""
        path = run.dir / "pool" / "x.npy"
        return np.array(np.load(path, mmap_mode="r", allow_pickle=False)) if path.exists() else None


def _chunk_batches(c: int, chunk: int, batches: int) -> range:
    return range(c * chunk, min((c + 1) * chunk, batches))
