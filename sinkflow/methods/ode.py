"""Euler integration with per-sample time spans and NFE counted by instrumentation."""

from __future__ import annotations

import contextlib

import torch


class NFECounter:
    """Counts forward calls of the given modules through forward hooks (not inferred from settings)."""

    def __init__(self, *modules: torch.nn.Module):
        self.count = 0
        self._handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module, args, output):
        self.count += 1

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def count_nfe(*modules: torch.nn.Module):
    counter = NFECounter(*modules)
    try:
        yield counter
    finally:
        counter.close()


def _expand(t, x: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    return t.expand(x.shape[0]).clone() if t.ndim == 0 else t


@torch.no_grad()
def euler(model, x: torch.Tensor, t0, t1, steps: int, record: bool = False):
    """Integrate dx/dt = model(x, t) from t0 to t1 (scalars or per-sample (N,) tensors) in ``steps`` steps."""
    t0, t1 = _expand(t0, x), _expand(t1, x)
    h = (t1 - t0) / steps
    shape = (-1,) + (1,) * (x.ndim - 1)
    path = [x.cpu()] if record else []
    for k in range(steps):
        t = t0 + k * h
        x = x + h.view(shape) * model(x, t).float()
        if record:
            path.append(x.cpu())
    return x, path
