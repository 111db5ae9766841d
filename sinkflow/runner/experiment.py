"""Run an experiment's phases in order: finished phases are skipped, the interrupted one continues."""

from __future__ import annotations

import logging
from typing import Iterable

from sinkflow.runner.callbacks import Callback
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
