"""Stop a training phase whose loss has left the data's scale, before it reaches Inf or NaN.

The non-finite guards (``Trainer.train_step``) see a divergence only once it overflows; a run can train for
hours at a loss of 1e16 before that (or never, and exit 0 with garbage). ``DivergenceGuard`` compares the
loss the loop already logs (``on_log``: no extra host synchronisation per step) with a limit fixed at
the start of the phase from the data itself: ``LOSS_LIMIT`` x max(1, scale^2), where ``scale`` is the
largest absolute value in one batch of the phase's own inputs and targets (drawn from a throwaway
generator, with the global RNG states restored, so the run's random streams and a bit-equal resume are
untouched). Every loss sinkflow trains (velocity / time regression, flow bits per dimension) stays far
below it while training is sound; a diverged one passes it by orders of magnitude.

A runtime-layer ``Callback`` (torch and the runner's leaves only); the Trainer adds it to every training phase.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sinkflow.errors import SinkflowError
from sinkflow.runtime import dist
from sinkflow.runtime.callbacks import Callback
from sinkflow.runtime.checkpoint import rng_state, set_rng_state

LOSS_LIMIT = 1e6  # x max(1, scale^2): sound losses stay many orders of magnitude below


def _largest(batch: Any) -> float:
    """The largest absolute value of any floating-point tensor in a tensor / tuple / list / dict batch."""
    if isinstance(batch, torch.Tensor):
        return float(batch.detach().abs().max()) if batch.is_floating_point() and batch.numel() else 0.0
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return max((_largest(b) for b in batch), default=0.0)
    return 0.0


def probe_batch(trainer, seed: int, n: int | None = None) -> Any:
    """One batch of the phase (this rank's shard of the global batch of ``n`` rows, by default the training one)
    drawn from a throwaway generator seeded ``seed``, with the global RNG states restored: the run's random
    streams, and a bit-equal resume, are untouched."""
    saved = rng_state()
    try:
        n = trainer.cfg["batch_size"] * trainer.info.world if n is None else n
        return trainer.task.batch(torch.Generator().manual_seed(seed), n, trainer.device)
    finally:
        set_rng_state(saved)


class DivergenceGuard(Callback):
    """One-line stop when a logged training loss exceeds the limit set from the data's scale."""

    def __init__(self):
        self.limit: float | None = None
        self.scale: float | None = None

    def on_phase_start(self, trainer) -> None:
        scale = _largest(probe_batch(trainer, seed=0))
        self.scale = dist.mean_over_ranks(scale)  # the same limit on every rank: they stop together
        self.limit = LOSS_LIMIT * max(1.0, self.scale) ** 2

    def on_log(self, trainer, metrics: dict) -> None:
        loss = metrics.get("loss")
        if self.limit is None or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            return  # non-finite losses are the Trainer's own guard
        if abs(loss) > self.limit:
            key = f"train.{trainer.task.model_key}"
            steps = trainer.ckpts.steps() if trainer.ckpts is not None else []
            kept = f"its checkpoints up to step {steps[-1][0]} are kept" if steps else "no checkpoint of it was written"
            raise SinkflowError(
                f"training diverged in phase '{trainer.name}' at step {trainer.step}: loss {loss:.3g} is over "
                f"{LOSS_LIMIT:.0e} x the data's scale squared ({self.scale:.3g}^2); {kept}",
                f"lower {key}.lr (now {trainer.cfg['lr']:g}; `sinkflow lr-find` picks one) or set {key}.grad_clip: "
                f"start a new run with it, or resume with it after deleting the checkpoints written after the loss "
                f"grew (metrics.jsonl)", every_rank=True)  # the loss and scale are every rank's: one line
