"""Run an experiment's phases in order: finished phases are skipped, the interrupted one continues."""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from sinkflow.data import sample_shape
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import TrainingStep
from sinkflow.runner.callbacks import Callback
from sinkflow.runner.rng import phase_generator
from sinkflow.runner.run import build_phase_model
from sinkflow.runner.state_check import check_final, check_step_state
from sinkflow.runner.signals import graceful_stop
from sinkflow.runner.trainer import Trainer

log = logging.getLogger("sinkflow")


def run_phases(run, phases, callbacks: Iterable[Callback] = ()) -> None:
    """Each unfinished task through its own ``Trainer`` (``callbacks`` go to every one of them)."""
    callbacks = list(callbacks)
    with graceful_stop():
        for task in phases:
            if run.phase_done(task.name):
                log.info("phase %s already finished: skipped", task.name)
                continue
            run.logger.heartbeat(phase=task.name, step=0, state="starting")
            Trainer(run, task, callbacks).fit()  # the trainer (model, optimizer, buffers) is dropped here
            run.release()
        run.logger.heartbeat(phase="done", state="finished")
        run.logger.flush()


def verify(run, phases) -> None:
    """Everything a resume will read, checked before anything in the run folder changes (docs/reliability.md).

    Every finished phase's ``final.pt`` loads, belongs to the run and holds weights of the configured
    model's names, shapes and dtypes; the first unfinished phase's newest step checkpoint holds everything
    the Trainer restores (weights, Adam moments, schedule, generator and RNG states); and no override changes
    a training key of a phase that has already finished (it would have no effect, so config.yaml would lie).
    Records where the run resumes (``run.resume_at``) for the change log ``Run.start`` writes."""
    changed = run.changes()
    at = None
    for task in phases:
        training = isinstance(task, TrainingStep)
        if training:
            run.phase_keys[task.name] = task.model_key
        content = (lambda state, where, task=task: check_final(state, _meta_model(run, task), where)) if training else None
        if run.phase_done(task.name, check=content):
            if training:
                prefix = f"train.{task.model_key}."
                for key, (old, new) in changed.items():
                    if key.startswith(prefix):
                        raise SinkflowError(
                            f"cannot resume {run.dir} with {key}={new!r}: phase '{task.name}' has finished (trained "
                            f"with {key}={old!r}), so the change would have no effect",
                            "drop that override, or start a new run with it")
            continue
        if at is None:
            step = 0
            if training:
                ckpts = run.checkpoints(task.name)
                latest = ckpts.latest()
                if latest is not None:
                    step = latest["step"]
                    generator = phase_generator(run.cfg["experiment"]["seed"], "train", task.name)
                    train = run.cfg["train"][task.model_key]
                    check_step_state(latest, _meta_model(run, task), generator, str(ckpts.steps()[-1][1]),
                                     ema=train["ema"] > 0, scaler=train["precision"] == "fp16")
            at = (task.name, step)
    run.resume_at = at or ("done", None)


def _meta_model(run, task) -> torch.nn.Module:
    """The phase's network on the meta device: its names, shapes and dtypes without allocating it."""
    with torch.device("meta"):
        return build_phase_model(run.cfg, task.model_key, sample_shape(run.cfg))
