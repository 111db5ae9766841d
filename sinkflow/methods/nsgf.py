"""Neural Sinkhorn Gradient Flow (paper Algorithms 1-2): a trajectory pool, then velocity matching.

The network sees continuous time t_k = eta_0 + ... + eta_{k-1} (the pool's flow time), so sampling
with any number of Euler steps integrates the same ODE over [0, t_end].
"""

from __future__ import annotations

import torch

from sinkflow.methods.flow_matching import velocity_loss
from sinkflow.methods.ode import count_nfe, euler
from sinkflow.methods.pool import PoolPhase, TrajectoryPool
from sinkflow.runner import dist
from sinkflow.runner.phase import TrainPhase


def step_sizes(pool_cfg: dict) -> torch.Tensor:
    """eta_k for k = 0..T-1 (constant, or the paper's 'incremental' schedule when eta_growth > 0)."""
    from sinkflow.ot import eta_schedule

    return torch.tensor(eta_schedule(pool_cfg["eta"], pool_cfg["steps"], pool_cfg["eta_growth"] or None))


def flow_times(pool_cfg: dict) -> torch.Tensor:
    """t_k at the start of each Euler step, and t_end as the last element: shape (T + 1,)."""
    return torch.cat([torch.zeros(1), torch.cumsum(step_sizes(pool_cfg), 0)])


def make_simulator(cfg: dict, device):
    """(x0, y) -> (xs, vs, ts): one trajectory of the empirical Sinkhorn flow (float32, outside autocast)."""
    from sinkflow.ot import simulate_sinkhorn_flow

    sk, pool = cfg["sinkhorn"], cfg["pool"]
    times = flow_times(pool)[:-1]

    def simulate(x0, y, batched=False, diameter=None):  # batched: x0, y (B, n, *) -> xs, vs (steps, B, n, *)
        xs, vs = simulate_sinkhorn_flow(
            x0, y, steps=pool["steps"], eta=pool["eta"], eta_growth=pool["eta_growth"] or None, blur=sk["blur"],
            scaling=sk["scaling"], diameter=sk["diameter"] if diameter is None else diameter, backend=sk["backend"],
            batched=batched)
        return xs, vs, times

    return simulate


def pool_phase(cfg, source, target):
    return PoolPhase(source, target, make_simulator(cfg, None))


def pool_batches(run):
    """Training batches drawn by index from the finished pool."""
    pool = TrajectoryPool(run.dir / "pool", run.cfg["pool"]["storage"])

    def make_batch(gen, n, device):
        idx = dist.shard(torch.randint(len(pool), (n,), generator=gen))
        return pool.batch(idx, device)  # pinned, non-blocking copies on CUDA

    return make_batch


class VelocityPhase(TrainPhase):
    """Velocity matching on the pool; the pool is opened only when this phase actually runs."""

    def __init__(self):
        super().__init__("velocity", None, velocity_loss)

    def run(self, run) -> None:
        self.make_batch = pool_batches(run)
        super().run(run)


def phases(cfg, source, target):
    return [pool_phase(cfg, source, target), VelocityPhase()]


def sample(run, x0, steps, record=False):
    model = run.model("velocity")
    t_end = float(flow_times(run.cfg["pool"])[-1])
    with count_nfe(model) as nfe:
        x, path = euler(model, x0, 0.0, t_end, steps, record)
    return x, {"nfe": nfe.count, "path": path}
