"""SIGTERM/SIGINT and a time limit become a polite request: the training loop checkpoints, then stops.

Kaggle, Colab and Slurm send SIGTERM before killing a job; Ctrl+C sends SIGINT. Either way the
current phase writes a checkpoint at the next step boundary and the process exits with 128+signum.

A time limit (``sinkflow train --time-limit 8h30m``) is the same request made by the clock, for platforms
that end a session without a signal, or whose end loses what the session wrote (a Kaggle notebook past its
session limit saves no output): once ``graceful_stop``'s deadline has passed, ``stop_requested`` answers
``TIME_LIMIT`` and the run stops at the next step boundary exactly as on SIGTERM, exiting with 124 (GNU
``timeout``'s status). Unlike a signal, it never hurries a unit of work: a pool chunk in progress is finished
(``signalled`` tells the two apart), so every session with a time limit makes progress.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time

from sinkflow.errors import SinkflowError

# Stop codes that are no signal the runner handles. Under torchrun the ranks agree on the first of a real signal
# (SIGTERM, SIGINT), the time limit, a callback's request_stop(), a callback's stop(), in that order
# (``dist.stop_rank``): by the bare numbers SIGINT's 2 lost to the others.
TIME_LIMIT = int(signal.SIGALRM)  # an expired time limit: the alarm clock's number
TIME_LIMIT_EXIT = 124  # GNU timeout's exit status for "the command timed out"
QUIET = 1  # a callback's ``trainer.stop()`` under torchrun (never shown: the ranks that agree on it end the phase,
# writing nothing)
REQUESTED = int(signal.SIGUSR1)  # a callback's ``trainer.request_stop()``; its exit status is a SIGTERM's, as the stop
# itself is ("stopped by signal 15" was said of it)

_requested: list[int] = []
_deadline: list[float] = []  # time.monotonic() at which the time limit expires (empty: none)


class Interrupted(Exception):
    """Raised by a phase after it saved a checkpoint in answer to a signal or the time limit."""

    def __init__(self, signum: int, phase: str, step: int, done: int | None = None, of: int | None = None):
        """``done`` of ``of``: a chunked phase's (the pool's) batches, as its bar counts them; its ``step`` counts
        chunks, and "at step 4" was said of a pool whose bar stood at 40/60 batches."""
        self.signum, self.phase, self.step, self.done, self.of = signum, phase, step, done, of
        at = f"after {done}/{of} batches" if of else f"at step {step}"
        super().__init__(f"stopped {stop_reason(signum)} in phase '{phase}' {at}; checkpoint saved")

    @property
    def exit_status(self) -> int:
        if self.signum == TIME_LIMIT:
            return TIME_LIMIT_EXIT
        return 128 + (int(signal.SIGTERM) if self.signum == REQUESTED else self.signum)


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT during a run: stop at once, without a step checkpoint. A ``KeyboardInterrupt``, so
    whatever stops on Ctrl+C stops on it; ``signum`` is the second signal's (the exit status is 128 + it)."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = int(signum)


def stop_reason(signum: int) -> str:
    """'by signal 15', 'at the time limit' or 'by trainer.request_stop()' (``Interrupted``'s message, ``sinkflow
    status``)."""
    if signum == TIME_LIMIT:
        return "at the time limit"
    return "by trainer.request_stop()" if signum == REQUESTED else f"by signal {signum}"


def signalled() -> int | None:
    """The first SIGTERM/SIGINT received during the run, if any (the time limit is not one)."""
    return _requested[0] if _requested else None


def stop_requested() -> int | None:
    """A signal received, or ``TIME_LIMIT`` once the deadline has passed: the loops stop at their next boundary."""
    if _requested:
        return _requested[0]
    return TIME_LIMIT if _deadline and time.monotonic() >= _deadline[0] else None


def _handler(signum, frame):
    if _requested:  # a second Ctrl+C or SIGTERM means "now"
        raise StopNow(signum)
    _requested.append(signum)


def _stop_now(signum, frame):
    raise StopNow(signum)


@contextlib.contextmanager
def unwind_on_sigterm():
    """Outside training (preflight, lr-find, bench, eval ...), a SIGTERM stops at once as Ctrl+C does, by unwinding
    (``StopNow``): temporary folders and the run lock are released on the way out. SIGTERM's default ends the process
    where it stands: a preflight stopped by `timeout` left its scratch run under /tmp. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _stop_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def graceful_stop(deadline: float | None = None):
    """Install the handlers for the duration of a run (main thread only) and the ``time.monotonic()``
    ``deadline`` of its time limit (any thread)."""
    _deadline[:] = [] if deadline is None else [deadline]
    if threading.current_thread() is not threading.main_thread():
        try:
            yield
        finally:
            _deadline.clear()
        return
    _requested.clear()
    old = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _requested.clear()
        _deadline.clear()


_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def format_duration(seconds: float) -> str:
    """``parse_duration``'s inverse, compact: 30600 -> ``8h30m``, 9 -> ``9s``, 0.5 -> ``0.5`` (seconds, written
    out: parse_duration reads no exponent) (a resume line's ``--time-limit``)."""
    if seconds != int(seconds):
        return f"{seconds:.9f}".rstrip("0").rstrip(".")
    rest, out = int(seconds), ""
    for unit in "dhm":
        n, rest = divmod(rest, _UNITS[unit])
        out += f"{n}{unit}" if n else ""
    return out + (f"{rest}s" if rest or not out else "")


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``8h30m``, ``90m``, ``2.5h``, ``45s``, ``3600`` (seconds), ``HH:MM:SS``, ``D-HH:MM:SS`` (Slurm's
    ``--time``) or ``DD:HH:MM:SS`` (Lightning's ``max_time``); a clear error
    otherwise (``--time-limit``, ``sinkflow.train(time_limit=...)``)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower()
        clock = re.fullmatch(r"(?:(\d+)-)?((?:\d+:){2,3}\d+)", s)
        units = re.findall(r"(\d+(?:\.\d+)?)([dhms])", s)
        minutes_seconds = [int(v) for v in clock[2].split(":")[-2:]] if clock else []
        if clock and not (clock[1] and clock[2].count(":") == 3) and max(minutes_seconds) < 60:  # 99:99:99 is no time
            *days, h, m, sec = map(int, clock[2].split(":"))  # HH:MM:SS, D-HH:MM:SS, DD:HH:MM:SS
            seconds = float((int(clock[1] or 0) + sum(days)) * 86400 + h * 3600 + m * 60 + sec)
        elif re.fullmatch(r"\d+(?:\.\d+)?", s):
            seconds = float(s)
        elif units and "".join(n + u for n, u in units) == s and len({u for _, u in units}) == len(units):
            seconds = sum(float(n) * _UNITS[u] for n, u in units)
        else:
            raise SinkflowError(f"time limit {text!r} is not a duration",
                                "write it like 8h30m, 90m, 2.5h, 45s, 3600 (seconds) or 08:30:00")
    if not 0 < seconds < float("inf"):  # NaN fails too
        raise SinkflowError(f"time limit {text!r} must be a positive, finite duration",
                            "give the time this session may train, e.g. 8h30m for a 9-hour Kaggle session")
    return seconds
