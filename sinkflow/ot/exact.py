"""The exact minibatch OT coupling (POT's EMD): OT-CFM's pairs and the NSGF pool's exact landing step."""

from __future__ import annotations

import numpy as np
import torch


def ot_permutation(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """Indices j(i) such that (x0[i], x1[j(i)]) is an exact OT matching (squared Euclidean cost).

    For two equal-size uniform batches the EMD plan is a permutation (a vertex of the Birkhoff polytope)."""
    import ot  # POT: imported here so the velocity code does not pay for it

    a, b = x0.flatten(1).double().cpu(), x1.flatten(1).double().cpu()
    cost = torch.cdist(a, b) ** 2
    n = a.shape[0]
    plan = ot.emd(np.full(n, 1.0 / n), np.full(n, 1.0 / n), cost.numpy(), numItermax=int(1e7))
    return torch.from_numpy(plan.argmax(axis=1))
