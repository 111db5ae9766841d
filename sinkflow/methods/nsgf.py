"""Neural Sinkhorn Gradient Flow (paper Algorithms 1-2): a trajectory pool, then velocity matching.

The pool holds the states x_k of the empirical Sinkhorn flow and their velocities v_k (Euler steps of
size eta_k). How the network reads it is ``nsgf.time`` (docs/nsgf.md):

- ``flow``: network time t_k = eta_0 + ... + eta_{k-1} (the pool's flow time), target v_k; sampling
  integrates dx/dt = v over [0, t_end].
- ``fraction``: network time s_k = k / T, target dx/ds = T eta_k v_k; sampling integrates over [0, 1],
  so T uniform Euler steps land exactly on the pool's grid. With the harmonic schedule the targets are
  ~ the remaining displacement divided by the remaining time: a constant-speed path, as in OT-CFM.

With ``nsgf.segment`` = p, a training point is, with probability p, a uniform point of its Euler segment
x_k + u eta_k v_k (time shifted by u of the step) instead of the grid point x_k: the piecewise-linear
path the Euler flow really takes, so a fine sampler integrates the same field the pool moved along.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sinkflow.data import qmc_twin
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import Method, TrainingStep, checkpoint_bytes
from sinkflow.methods.flow_matching import velocity_loss
from sinkflow.methods.ode import count_nfe, euler
from sinkflow.methods.pool import PoolTask, TrajectoryPool, check_free_disk, check_pool_fits, step_sizes
from sinkflow.ot.velocity import check_backend_installed
from sinkflow.runtime import dist


# arXiv:2401.14069v1 Table 1, NSGF row: W2 on 1024 test samples, {task: {euler_steps: w2}}.
PAPER_W2 = {
    "8gaussians": {10: 0.285, 100: 0.278},
    "8gaussians-moons": {10: 0.144, 100: 0.144},
    "moons": {10: 0.077, 100: 0.067},
    "scurve": {10: 0.117, 100: 0.110},
    "checkerboard": {10: 0.252, 100: 0.147},
}


def flow_times(pool_cfg: dict) -> torch.Tensor:
    """t_k at the start of each Euler step, and t_end as the last element: shape (T + 1,)."""
    return torch.cat([torch.zeros(1), torch.cumsum(step_sizes(pool_cfg), 0)])


def network_grid(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(times (T + 1,), steps (T,)): the pool's grid in the network's time, and the Euler step in that time.

    ``x_{k+1} = x_k + steps[k] * net(x_k, times[k])`` replays the pool's own flow."""
    grid = PoolGrid.from_config(cfg)
    return grid.times, grid.steps


def make_simulator(cfg: dict, device):
    """(x0, y) -> (xs, vs, ts): one trajectory of the empirical Sinkhorn flow (float32, outside autocast)."""
    from sinkflow.ot import simulate_sinkhorn_flow

    sk, pool = cfg["sinkhorn"], cfg["pool"]
    times = flow_times(pool)[:-1]

    def simulate(x0, y, batched=False, diameter=None):  # batched: x0, y (B, n, *) -> xs, vs (steps, B, n, *)
        xs, vs = simulate_sinkhorn_flow(
            x0, y, steps=pool["steps"], eta=pool["eta"], eta_growth=pool["eta_growth"] or None,
            schedule=pool.get("schedule"), blur=sk["blur"], scaling=sk["scaling"],
            diameter=sk["diameter"] if diameter is None else diameter, backend=sk["backend"], batched=batched,
            solver=sk["solver"], max_iters=sk["max_iters"], tol=sk["tol"], landing=pool["landing"])
        return xs, vs, times

    return simulate


def check(cfg: dict, sample_shape: tuple[int, ...] | None = None) -> None:
    """Refuse, before any work, an NSGF config that cannot run (one line naming the key)."""
    if cfg["nsgf"]["time"] not in ("flow", "fraction"):
        raise SinkflowError(f"nsgf.time={cfg['nsgf']['time']!r} is not one of flow, fraction", "set nsgf.time=fraction")
    if not 0.0 <= float(cfg["nsgf"]["segment"]) <= 1.0:
        raise SinkflowError(f"nsgf.segment={cfg['nsgf']['segment']!r} is not a probability", "use a value in [0, 1]")
    step_sizes(cfg["pool"])  # the schedule's own checks (unknown name, eta_growth)
    # before the run folder exists: the pool failed on a missing pykeops after config.yaml was written
    check_backend_installed(cfg["sinkhorn"]["backend"], cfg["sinkhorn"]["solver"])
    if cfg["pool"]["landing"] == "exact" and cfg["pool"]["schedule"] != "harmonic":
        raise SinkflowError(f"pool.landing=exact lands the flow's last step, which only pool.schedule=harmonic takes "
                            f"the whole remaining way (pool.schedule={cfg['pool']['schedule']})",
                            "set pool.schedule=harmonic, or pool.landing=sinkhorn")
    bins = cfg["model"]["velocity"].get("time_bins", 0)
    if bins and (bins != cfg["pool"]["steps"] or cfg["nsgf"]["time"] != "fraction"):
        raise SinkflowError(f"model.velocity.time_bins={bins} does not match the pool's grid (pool.steps="
                            f"{cfg['pool']['steps']}, nsgf.time={cfg['nsgf']['time']})",
                            f"set model.velocity.time_bins={cfg['pool']['steps']} with nsgf.time=fraction, or 0")


def pool_task(cfg, source, target) -> PoolTask:
    """The pool phase. With ``pool.qmc`` each batch's source points are a randomised-QMC draw (``qmc_twin``):
    the pool is a finite set reused for every training step, so it keeps its sampling noise (docs/nsgf.md)."""
    return PoolTask(qmc_twin(source) if cfg["pool"]["qmc"] else source, target, make_simulator(cfg, None))


@dataclass(frozen=True)
class PoolGrid:
    """How a velocity network reads a pool of T Euler steps, as plain tensors: ``etas`` (T,) the pool's step
    sizes, ``times`` (T + 1,) the network time of each grid point, ``steps`` (T,) each Euler step in network
    time and ``scale`` (T,) the factor from the pool's velocity v_k to the network's target."""

    etas: torch.Tensor
    times: torch.Tensor
    steps: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, etas: torch.Tensor, time: str = "flow") -> "PoolGrid":
        """``time="flow"``: t_k = eta_0 + ... + eta_{k-1}, target v_k; ``"fraction"``: s_k = k / T, target
        T eta_k v_k (docs/nsgf.md)."""
        etas = torch.as_tensor(etas, dtype=torch.float32)
        T = len(etas)
        if time == "fraction":
            return cls(etas, torch.arange(T + 1, dtype=torch.float32) / T, torch.full((T,), 1.0 / T), etas * T)
        return cls(etas, torch.cat([torch.zeros(1), torch.cumsum(etas, 0)]), etas, torch.ones_like(etas))

    @classmethod
    def from_config(cls, cfg: dict) -> "PoolGrid":
        return cls.of(step_sizes(cfg["pool"]), cfg["nsgf"]["time"])


def pool_batch(x: torch.Tensor, v: torch.Tensor, k: torch.Tensor, u: torch.Tensor, grid: PoolGrid):
    """(x, network time, target) of pool entries ``x``, ``v`` at steps ``k``, moved ``u`` in [0, 1) of the way
    along their Euler segment (u = 0: the grid point): what NSGF's velocity network regresses on."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    dev = x.device
    u = u.to(dev)
    x = x + (u * grid.etas.to(dev)[k]).view(shape) * v
    return x, grid.times.to(dev)[k] + u * grid.steps.to(dev)[k], v * grid.scale.to(dev)[k].view(shape)


def sample_pool(xs: torch.Tensor, vs: torch.Tensor, n: int, grid: PoolGrid, segment: float = 0.0,
                generator: torch.Generator | None = None):
    """A training batch of ``n`` entries drawn from a pool held as tensors ``xs``, ``vs`` (T, M, *): the step,
    the particle and (with probability ``segment``) a point along the Euler segment, then ``pool_batch``."""
    T, M = xs.shape[:2]
    k = torch.randint(T, (n,), generator=generator)
    i = torch.randint(M, (n,), generator=generator)
    u = torch.rand(n, generator=generator) * (torch.rand(n, generator=generator) < segment)
    k, i = k.to(xs.device), i.to(xs.device)
    return pool_batch(xs[k, i], vs[k, i], k, u, grid)


def pool_loss(model, x: torch.Tensor, v: torch.Tensor, k: torch.Tensor, u: torch.Tensor, grid: PoolGrid):
    """NSGF's training loss on pool entries (see ``pool_batch``)."""
    return velocity_loss(model, pool_batch(x, v, k, u, grid))


def pool_batches(run):
    """Training batches (x, network time, target) drawn by index from the finished pool.

    The step index k of an entry is recovered from its stored flow time (disk storage returns rows in
    file order, not in draw order). Every batch draws the same amount of randomness, whatever
    ``nsgf.segment`` is, so resume stays bit-for-bit."""
    cfg = run.cfg
    pool = TrajectoryPool(run.dir / "pool", cfg["pool"]["storage"])
    t_flow = flow_times(cfg["pool"])
    mids = (t_flow[1:-1] + t_flow[:-2]) / 2  # bucket boundaries between consecutive grid times
    grid = PoolGrid.from_config(cfg)
    segment = float(cfg["nsgf"]["segment"])

    def make_batch(gen, n, device):
        idx = torch.randint(len(pool), (n,), generator=gen)
        u = torch.rand(n, generator=gen)
        on_segment = torch.rand(n, generator=gen) < segment
        idx, u = dist.shard(idx), dist.shard(torch.where(on_segment, u, torch.zeros_like(u)))
        x, t, v = pool.batch(idx, device)  # pinned, non-blocking copies on CUDA
        k = torch.bucketize(t.cpu(), mids).to(x.device)
        return pool_batch(x, v, k, u, grid)

    return make_batch


class PoolVelocityStep(TrainingStep):
    """Velocity matching on the pool; the pool is opened only when this phase actually runs."""

    def __init__(self):
        super().__init__("velocity")
        self._batches = None

    def open(self, run) -> None:
        self._batches = pool_batches(run)

    def batch(self, generator, n, device):
        return self._batches(generator, n, device)

    def loss(self, model, batch):
        return velocity_loss(model, batch)


class NSGF(Method):
    """Neural Sinkhorn Gradient Flow: the trajectory pool, then velocity matching; Euler sampling."""

    name = "nsgf"
    paper, paper_label = PAPER_W2, "NSGF"

    def check(self, cfg: dict, sample_shape: tuple[int, ...]) -> None:
        check(cfg)
        check_pool_fits(cfg["pool"], sample_shape)

    def check_machine(self, cfg: dict, sample_shape: tuple[int, ...]) -> None:
        check_free_disk(cfg["pool"], sample_shape, Path(cfg["experiment"]["runs_dir"]).expanduser(),
                        {"checkpoints": checkpoint_bytes(cfg, sample_shape)})

    def phases(self, cfg, source, target):
        check(cfg)
        return [pool_task(cfg, source, target), PoolVelocityStep()]

    def sample_nets(self, nets, cfg, x0, steps=None, record=False):
        model = nets["velocity"]
        t_end = float(network_grid(cfg)[0][-1])
        with count_nfe(model) as nfe:
            x, path = euler(model, x0, 0.0, t_end, steps or self.default_steps(cfg), record,
                            cfg["sample"]["time_warp"])
        return x, {"nfe": nfe.count, "path": path}

    def sampler_candidates(self, cfg, total):
        return None  # `sinkflow tune` chooses no NSGF sampler (its steps follow the pool's grid; NSGF++'s it does)

    def describe(self, cfg: dict) -> str:
        pool = cfg["pool"]
        return (f"nsgf: a pool of {pool['batches']} x {pool['batch_size']} Sinkhorn-flow trajectories of "
                f"{pool['steps']} steps, velocity matching on it (nsgf.time={cfg['nsgf']['time']}), Euler sampling")


METHOD = NSGF()
