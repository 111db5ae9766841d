"""SIGTERM/SIGINT become a polite request: the training loop checkpoints, then stops.

Kaggle, Colab and Slurm send SIGTERM before killing a job; Ctrl+C sends SIGINT. Either way the
current phase writes a checkpoint at the next step boundary and the process exits with 128+signum.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_requested: list[int] = []


class Interrupted(Exception):
    """Raised by a phase after it saved a checkpoint in answer to a signal."""

    def __init__(self, signum: int, phase: str, step: int):
        self.signum, self.phase, self.step = signum, phase, step
        super().__init__(f"stopped by signal {signum} in phase '{phase}' at step {step}; checkpoint saved")


def stop_requested() -> int | None:
    return _requested[0] if _requested else None


def _handler(signum, frame):
    if _requested:  # a second Ctrl+C means "now"
        raise KeyboardInterrupt
    _requested.append(signum)


@contextlib.contextmanager
def graceful_stop():
    """Install the handlers for the duration of a run (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested.clear()
    old = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _requested.clear()
