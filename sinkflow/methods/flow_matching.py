"""Flow-matching baselines in the same runner: FM (independent pairs) and OT-CFM (exact minibatch OT pairs).

Both regress u(x_t, t) onto x1 - x0 along x_t = t x1 + (1 - t) x0, t ~ U(0, 1), sigma = 0, with the
same network, budget and sampler as NSGF, so every comparison is like for like. OT-CFM pairs the
minibatch by POT's exact EMD plan (a permutation for equal uniform batches).
"""

from __future__ import annotations

import numpy as np
import ot
import torch

from sinkflow.methods.ode import count_nfe, euler
from sinkflow.runner import dist
from sinkflow.runner.phase import TrainPhase


def ot_permutation(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """Indices j(i) such that (x0[i], x1[j(i)]) is an exact OT matching (squared Euclidean cost)."""
    a, b = x0.flatten(1).double().cpu(), x1.flatten(1).double().cpu()
    cost = torch.cdist(a, b) ** 2
    n = a.shape[0]
    plan = ot.emd(np.full(n, 1.0 / n), np.full(n, 1.0 / n), cost.numpy(), numItermax=int(1e7))
    return torch.from_numpy(plan.argmax(axis=1))


def interpolant_batch(source, target, generator, n, device, ot_pairs=False):
    """(x_t, t, target velocity) for the straight noise-data path; the global batch, then this rank's shard."""
    x0 = source.sample(n, generator, "cpu")
    x1 = target.sample(n, generator, "cpu")
    t = torch.rand(n, generator=generator)
    if ot_pairs:
        x1 = x1[ot_permutation(x0, x1)]
    x0, x1, t = (dist.shard(v).to(device, non_blocking=True) for v in (x0, x1, t))
    tb = t.view(-1, *([1] * (x0.ndim - 1)))
    return tb * x1 + (1 - tb) * x0, t, x1 - x0


def velocity_loss(model, batch):
    x, t, v = batch
    return (model(x, t).float() - v).pow(2).mean()


def phases(cfg, source, target):
    ot_pairs = cfg["experiment"]["method"] == "otcfm"

    def make_batch(gen, n, device):
        return interpolant_batch(source, target, gen, n, device, ot_pairs=ot_pairs)

    return [TrainPhase("velocity", make_batch, velocity_loss)]


def sample(run, x0, steps, record=False):
    model = run.model("velocity")
    with count_nfe(model) as nfe:
        x, path = euler(model, x0, 0.0, 1.0, steps, record)
    return x, {"nfe": nfe.count, "path": path}
