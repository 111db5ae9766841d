"""Say so when a training phase ends without its loss having fallen: a run that silently did not learn.

A learning rate far too low (or a frozen network, or a pipeline that never reaches the weights) trains for hours,
exits 0 and leaves a model that samples noise; nothing diverged, so ``DivergenceGuard`` and the non-finite guards
stay silent. ``LearningCheck`` computes the phase's loss on one fixed probe batch through the network as the
phase received it (initialised, or warm-started) and again through the trained network at the end, and warns when
the loss fell by less than ``1 - FELL_LESS_THAN`` (phases of at least ``MIN_STEPS`` steps).

Why one fixed batch, before and after: a flow-matching loss in 2D keeps a large irreducible part (the conditional
variance of its target) and is noisy from batch to batch: FM on moons at batch 64 read 5.56, 3.18, 5.00, 3.26, 2.91
at its first five steps and ~3.8 from then on (2026-11-29), so neither its first steps' mean nor its first logged
window tells a learning run from a frozen one (a learning FM run's first-steps mean read 98 % of its last window,
a frozen one's 99-105 %). On the same batch the comparison is paired: the frozen network reads exactly its initial
loss, FM on moons 0.484 of it after 4,000 steps at the preset's batch (docs/reliability.md has the other presets').

Both losses go through ``Trainer.probe_forward`` (eval mode, no gradient, the phase's autocast): the initial one
when the phase starts (after ``on_setup``, where a Glow's ActNorm is initialised from the first training batch, so
the probe initialises nothing), the final one after the last step. The probe batch comes from its own generator
with the global RNG states restored (``probe_batch``): the training is bit-equal with or without the check
(tested at (N, 2), on a Glow, and with a dropout UNet at (N, 1, 28, 28) and (N, 3, 32, 32): NSGF++'s velocity and
NSF phases, OT-CFM). The initial value is kept in the phase's checkpoints with the probe's global batch size, so
a resumed phase is judged against where it began, on the same batch whatever the number of processes (under DDP
the loss is the whole probe batch's: each rank's shard weighted by its rows). Both values and the verdict
are recorded in metrics.jsonl (``probe_loss_start``, ``probe_loss_end``, ``learned``: `sinkflow status` says a phase
that did not learn after the run). The warning goes to
``LEARNING_LOG``, which the tools' few-step scratch runs mute (``quiet``). A task with a sharper check of its own
(NSGF++'s time predictor: its MSE against a constant guess) sets ``TrainingStep.learning_check = False``.
"""

from __future__ import annotations

import logging
from typing import Any

from sinkflow.engine.divergence import probe_batch
from sinkflow.runtime import dist
from sinkflow.runtime.callbacks import LEARNING_LOG, Callback

MIN_STEPS = 100  # shorter phases (smoke tests, tools' cut runs) are not judged
FELL_LESS_THAN = 0.95  # warn when the trained network's loss is at least this fraction of the initial one's
PROBE_SEED = 1  # the probe batch's throwaway generator (DivergenceGuard's scale batch is seed 0)

learning = logging.getLogger(LEARNING_LOG)


def checks(task, iters: int) -> bool:
    """Does a training phase of ``task`` with ``iters`` steps get judged (and hold the probe batch on its device for
    the whole phase)? The one rule the callback and the memory planner both read."""
    return task.learning_check and iters >= MIN_STEPS


class LearningCheck(Callback):
    """Warns at the end of a training phase whose loss on a fixed batch did not fall below ``FELL_LESS_THAN`` x the
    initial network's."""

    def __init__(self):
        self.initial: float | None = None
        self.rows: int | None = None  # the probe's global batch, kept with ``initial``
        self._batch: Any = None

    def on_phase_start(self, trainer) -> None:
        if not checks(trainer.task, trainer.total):
            return
        if trainer.step == 0 or self.rows is None:
            self.rows = trainer.cfg["batch_size"] * trainer.info.world
        self._batch = probe_batch(trainer, PROBE_SEED, self.rows)
        if trainer.step == 0:
            self.initial = self.probe_loss(trainer, self._batch)

    def probe_loss(self, trainer, batch) -> float:
        """The loss on the whole probe batch: each rank's shard's mean, weighted by its rows, over ranks. Rank 0's
        shard alone was another batch after a resume on another number of processes (the global batch and its
        shards change with the world), so the phase was judged on two batches: a frozen network started on 2
        processes and resumed on 1 read 6.73 -> 5.47 and passed, one started on 1 and resumed on 2 warned at 123 %."""
        info = trainer.info
        rows = len(range(info.rank, self.rows, info.world))
        return dist.mean_over_ranks(float(trainer.probe_forward(batch)) * rows) * info.world / self.rows

    def on_phase_end(self, trainer) -> None:
        batch, self._batch = self._batch, None
        if batch is None or self.initial is None or self.initial <= 0:
            return
        final = self.probe_loss(trainer, batch)
        learned = final < FELL_LESS_THAN * self.initial
        # recorded, as the time predictor's check is (t_mse): the warning was the console's alone, so once the run
        # was over (`sinkflow status`: FINISHED, metrics.jsonl, TensorBoard) nothing said the phase had not learned
        trainer.run.logger.log(trainer.name, trainer.step, {"probe_loss_start": self.initial,
                                                             "probe_loss_end": final, "learned": learned,
                                                             "final": True})
        if not learned and dist.current().is_main:
            key = f"train.{trainer.task.model_key}"
            learning.warning(
                "%s: the loss did not fall (%.4g on a fixed batch through the network it started from, %.4g through "
                "the one trained to step %d: %.0f%%): the phase may not have learned; check %s.lr (now %g; `sinkflow "
                "lr-find --phase %s` picks one) and run `sinkflow doctor` on the config", trainer.name, self.initial,
                final, trainer.step, 100 * final / self.initial, key, trainer.cfg["lr"], trainer.task.model_key)

    def teardown(self, trainer) -> None:
        self._batch = None

    def state_dict(self) -> dict:
        return {"initial": self.initial, "rows": self.rows} if self.initial is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.initial, self.rows = state.get("initial"), state.get("rows")
