"""The exact minibatch OT coupling: OT-CFM's pairs and the NSGF pool's exact landing step.

Between two equal-size batches with uniform weights the exact OT plan is a permutation (a vertex of the Birkhoff
polytope), so the problem is a linear assignment. Two exact solvers, chosen by batch size from a side-by-side
measurement (``benchmarks/ot_coupling.py``, RESULTS.md, 2026-11-27, measured again 2026-11-30 with a warm-up, this
project's CPU box), both returning the same permutation on every batch pair tried:

* up to ``ASSIGNMENT_MAX_N`` rows, SciPy's ``linear_sum_assignment``: 1.35-1.8x faster than POT's ``ot.emd`` at batch
  128-256 (0.76 against 1.29 ms at 128 x 784, an ``mnist`` batch), 1.8x at 1024 x 784, as fast at 1024 x 2; and its
  import takes 0.2 s against POT's 1.2 s (POT loads scikit-learn), which every process that pairs by OT paid;
* above it, POT's network simplex (``ot.emd``): 1.3x faster at 2048 x 2 (and 1.6x at 4096 x 2, two pairs).

Both release the GIL while they solve, so the prefetch thread's plan does not hold up the training thread.
POT computes every W2 (``sinkflow.ot.metrics``), whose weights need not be uniform."""

from __future__ import annotations

import numpy as np
import torch

from sinkflow.config.checks import float_tensor
from sinkflow.errors import require
from sinkflow.ot.precision import centred

ASSIGNMENT_MAX_N = 1024  # the largest batch solved by SciPy's assignment; larger ones go to POT's EMD


def ot_permutation(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """Indices j(i), on ``x1``'s device, such that (x0[i], x1[j(i)]) is an exact OT matching (squared Euclidean
    cost): the minimum-cost assignment, which for two equal-size uniform batches is the EMD plan.

    The cost matrix is computed in float64 where the batches are: on a GPU that is one small kernel, where on the
    host the float64 copies and the distance product took 2.1 ms of the 7.7 ms an `mnist` OT-CFM batch cost the
    prefetch thread (H100 host, cProfile, 2026-11-26): only the n x n cost goes to the host for the solver.

    ``x0``, ``x1``: tensors or numpy arrays (their indices come back on the CPU) of any floating dtype, as ``w2``
    takes them; a batch that requires grad is read detached (a matching has no gradient), where the cost's
    ``.numpy()`` used to fail."""
    x0, x1 = float_tensor(x0, "x0").detach(), float_tensor(x1, "x1").detach()
    require(x0.ndim >= 2 and x0.shape[1:] == x1.shape[1:], f"ot_permutation pairs batches shaped (N, *) of one "
            f"sample shape; got {tuple(x0.shape)} and {tuple(x1.shape)}", "add a feature axis, e.g. x[..., None] "
            "for 1-D points, and pair samples of the same shape")
    require(x0.shape[0] == x1.shape[0], f"ot_permutation pairs equal-size batches; got {x0.shape[0]} and "
            f"{x1.shape[0]} rows", "draw as many target as source samples")
    where = x0.device if x0.device.type in ("cpu", "cuda") else torch.device("cpu")  # MPS has no float64
    a, b = (x.flatten(1).to(where, torch.float64)[None] for x in (x0, x1))
    a, b = centred(a, b)  # far from the origin the float64 cost lost the batches' spread to cancellation
    cost = _to_host(torch.cdist(a[0], b[0]) ** 2)
    require(bool(np.isfinite(cost.numpy()).all()), "a batch paired by exact OT holds NaN/Inf values",
            "check the data, or the step that produced the batch")
    n = x0.shape[0]
    if n <= ASSIGNMENT_MAX_N:
        from scipy.optimize import linear_sum_assignment

        cols = linear_sum_assignment(cost.numpy())[1]  # the rows come back as 0..n-1, in order
    else:
        import ot  # POT: imported here so the velocity code does not pay for it

        c = cost.numpy()  # on cost / max, in place: POT's simplex stops short on tiny costs (w2); assignment does not
        c /= c.max() or 1.0
        cols = ot.emd(np.full(n, 1.0 / n), np.full(n, 1.0 / n), c, numItermax=int(1e7)).argmax(axis=1)
    return torch.from_numpy(cols.astype(np.int64)).to(x1.device, non_blocking=True)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, waiting for this thread's stream only: a copy into pinned memory and an event. A plain
    ``.cpu()`` is a stream sync, which ``torch.cuda.set_sync_debug_mode`` (process-wide) flags when the prefetch
    worker makes it while the training thread is checked for syncs (benchmarks/gpu_checks.py)."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host
