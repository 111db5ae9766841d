"""Run an experiment's phases in order: finished phases are skipped, the interrupted one continues."""

from __future__ import annotations

import logging

from sinkflow.runner.signals import graceful_stop

log = logging.getLogger("sinkflow")


def run_phases(run, phases) -> None:
    with graceful_stop():
        for phase in phases:
            if run.phase_done(phase.name):
                log.info("phase %s already finished: skipped", phase.name)
                continue
            run.logger.heartbeat(phase=phase.name, step=0, state="starting")
            phase.run(run)
            phase.__dict__.clear()  # drop the phase's model, optimizer and buffers before the next one
            run.release()
        run.logger.heartbeat(phase="done", state="finished")
        run.logger.flush()
