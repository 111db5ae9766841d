"""Training health while it runs: a JSONL log, TensorBoard events and a heartbeat file.

``metrics.jsonl`` is one JSON object per logged step (easy to grep, load with pandas, or tail);
TensorBoard gets the same scalars, one event folder per phase (``tb/<phase>``, so a resumed phase can purge what
a killed process logged past its checkpoint without touching the other phases); ``status.json`` is rewritten
atomically on every log so ``sinkflow status RUN`` can tell a live run from a dead one by the heartbeat's age.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import numbers
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from sinkflow.data.atomic_write import atomic_write_text, named
from sinkflow.data.base import warn_once

log = logging.getLogger("sinkflow")

# seconds of work between two heartbeats where nothing else writes one (a training phase with a log_every longer than
# minutes of steps, NSGF++'s states): `sinkflow status` says STALE after its 300 s of silence while the process worked
HEARTBEAT_EVERY_S = 60.0


class MetricsLogger:
    """``best_effort`` (``sinkflow eval``): a run folder that cannot be written (read-only, another owner)
    does not stop the caller; the first ``OSError`` is kept in ``failed`` and nothing more is attempted
    (TensorBoard's writer thread is never started there, so nothing is printed from it)."""

    def __init__(self, run_dir: Path, enabled: bool = True, best_effort: bool = False):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.best_effort = best_effort
        self.failed: OSError | None = None
        self._tbs: dict = {}  # phase -> SummaryWriter, created on the phase's first scalar
        self._purge: dict[str, int] = {}  # phase -> the first step its next writer hides (``rewind``)
        self._tb_step: dict[str, int] = {}  # tag -> the step this process last wrote it at
        self._jsonl = None  # opened on the first record: creating a logger writes nothing
        self._launch: dict[str, Any] = {}  # how the run was launched, in every heartbeat (``record_launch``)

    @property
    def jsonl(self):
        if self._jsonl is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open_lines(self.run_dir / "metrics.jsonl", buffering=1)
        return self._jsonl

    def tb(self, phase: str):
        """The phase's TensorBoard writer, created lazily (importing tensorboard costs ~1 s); None where TensorBoard
        cannot be imported (a broken install, a protobuf clash): said once, and the run goes on with metrics.jsonl,
        where a traceback at the first log step had failed it (and every resume, and eval after its record)."""
        if phase not in self._tbs:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as exc:  # ImportError, or what a half-installed package raises while importing
                warn_once(log, "tensorboard", "TensorBoard cannot be imported (%s: %s): metrics go to metrics.jsonl "
                          "only; `pip install tensorboard` to get its events again", type(exc).__name__, exc)
                return None
            _quiet_tensorboard_threads()
            with naming(self.run_dir / "tb" / phase):
                self._tbs[phase] = SummaryWriter(str(self.run_dir / "tb" / phase),
                                                 purge_step=self._purge.pop(phase, None))
        return self._tbs[phase]

    def rewind(self, phase: str, step: int) -> list[dict]:
        """``phase`` (re)starts at ``step`` (its checkpoint's): move what a killed process logged for it after that
        step out of metrics.jsonl, so each step is logged once there. The moved records are appended to
        metrics.rewound.jsonl, never deleted (with its checkpoints gone a phase restarts at 0: its whole history had
        been dropped), and returned; metrics.jsonl is rewritten without them (atomically); the phase's TensorBoard
        events past ``step`` are purged (``SummaryWriter(purge_step=)``, TensorBoard's own way of hiding a crashed
        run's tail). A kill -9 after step 250 and a resume from the step-210 checkpoint logged step 250 twice."""
        if not self.enabled:
            return []
        path = self.run_dir / "metrics.jsonl"
        try:
            lines = path.read_text().splitlines(keepends=True)
        except FileNotFoundError:
            return []
        keep, moved = [], []
        for line in lines:
            (moved if _logged_after(line, phase, step) else keep).append(line)
        for record in map(json.loads, moved):  # a phase's end record at ``step`` itself (its final.pt was deleted and
            # it resumes from a step file at its last step): TensorBoard's purge cannot hide one step of one tag, so its
            # point there stays, and the record written again goes to metrics.jsonl alone (each tag one point a step)
            if record["step"] == step:
                self._tb_step.update({f"{phase}/{k}": step for k in record if k not in ("time", "phase", "step")})
        if (self.run_dir / "tb" / phase).is_dir():
            # always, not only when rows moved: a process that moved them and died before its first log step
            # never wrote the purge, and its successor, finding nothing to move, kept the stale events in view
            self._purge[phase] = step + 1
            if phase in self._tbs:
                self._tbs.pop(phase).close()
        if not moved:
            return []
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        with open_lines(self.run_dir / "metrics.rewound.jsonl") as f:  # first: a crash between the two loses nothing
            f.write("".join(line if line.endswith("\n") else line + "\n" for line in moved))
        atomic_write_text(path, "".join(keep))
        return [json.loads(line) for line in moved]

    def log_evaluation(self, values: dict[str, Any]) -> None:
        """An evaluation's record, phase ``eval``, at step k for the run's k-th evaluation: TensorBoard draws each
        as its own point (all at step 0, three evaluations were three values on one step it cannot tell apart).
        Scores against the validation split (``split: val``) go to TensorBoard as ``eval/val/<key>``: under the test
        scores' own tags (``eval/fd_cnn_3``) a validation score was a point on the test curve, and TensorBoard,
        which shows no ``split``, could not tell them apart."""
        path = self.run_dir / "metrics.jsonl"
        try:
            done = sum(_phase_of(line) == "eval" for line in path.read_text().splitlines())
        except OSError:
            done = 0
        self.log("eval", done + 1, values, tb_prefix="val/" if values.get("split") == "val" else "")

    def log(self, phase: str, step: int, values: dict[str, Any], tb_prefix: str = "") -> None:
        """One record in metrics.jsonl and its numbers in TensorBoard as ``<phase>/<tb_prefix><key>``."""
        if not self.enabled:
            return
        record = {"time": time.time(), "phase": phase, "step": step}
        for key, value in values.items():
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                value = int(value)  # a count stays a count (n, seeds were written as 64.0)
            elif hasattr(value, "__float__") and not isinstance(value, (str, bool)):
                value = float(value)
            record[key] = value
        try:
            if self.best_effort:
                self._check_writable()
            with naming(self.run_dir / "metrics.jsonl"):  # first: a folder we cannot write fails here, synchronously
                self.jsonl.write(json.dumps(record) + "\n")
            for key, value in record.items():
                tag = f"{phase}/{tb_prefix}{key}"
                if key not in ("time", "phase", "step") and isinstance(value, (int, float)) and \
                        not isinstance(value, bool) and math.isfinite(value) and self._tb_step.get(tag) != step \
                        and (tb := self.tb(phase)) is not None:
                    with naming(self.run_dir / "tb" / phase):  # its writer thread's error, raised here
                        tb.add_scalar(tag, value, step)
                    self._tb_step[tag] = step  # a phase's final record at its last log step: one point there
        except OSError as exc:
            if not self.best_effort:
                raise
            self.failed, self.enabled = exc, False

    def _check_writable(self) -> None:
        """Raise the OSError a write would meet, before TensorBoard's writer thread could meet it."""
        for path in (self.run_dir, self.run_dir / "metrics.jsonl", self.run_dir / "tb"):
            if path.exists() and not os.access(path, os.W_OK):
                if os.statvfs(path).f_flag & os.ST_RDONLY:  # a read-only mount (a Kaggle input), not a permission
                    raise OSError(errno.EROFS, "Read-only file system", str(path))
                raise PermissionError(errno.EACCES, "Permission denied", str(path))

    def histogram(self, tag: str, values, step: int) -> None:
        """``tag`` begins with the phase (``velocity/weights/...``): it goes to that phase's event folder. Only the
        finite values: TensorBoard's histogram of a tensor holding Inf fails ("The histogram is empty"), which
        ended the run at fp16's first skipped step (its gradients are Inf by design) or hid a diverged one's line."""
        if not self.enabled:
            return
        values = values[torch.isfinite(values)] if torch.is_tensor(values) else values
        if (not torch.is_tensor(values) or values.numel()) and (tb := self.tb(tag.split("/")[0])) is not None:
            with naming(self.run_dir / "tb" / tag.split("/")[0]):
                tb.add_histogram(tag, values, step)

    def record_launch(self, **launch: Any) -> None:
        """How the run was launched (``run_phases``: processes, processes a node, report, time limit), written into
        every heartbeat from here on, from which `sinkflow status` builds the resume command."""
        self._launch = dict(launch)

    def heartbeat(self, **status: Any) -> None:
        """Rewrite ``status.json`` (phase, step, total, rate, eta, state) with the current time and ``launch`` (the
        processes, report and time limit `sinkflow status` builds the resume command from, whatever the state: a
        torchrun job killed or failed was told to resume as one process, without its time limit)."""
        if not self.enabled:
            return
        status = {"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),  # "dir": the folder the
                  "dir": str(self.run_dir.resolve()), **self._launch, **status}  # pid writes: a copy is told apart
        atomic_write_text(self.run_dir / "status.json", json.dumps(status))

    def flush(self) -> None:
        for phase, writer in self._tbs.items():
            with naming(self.run_dir / "tb" / phase):
                writer.flush()

    def close(self) -> None:
        tbs, self._tbs = self._tbs, {}
        for phase, writer in tbs.items():
            with naming(self.run_dir / "tb" / phase):
                writer.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


@contextlib.contextmanager
def naming(path: Path):
    """An ``OSError`` raised inside without a file name gets ``path`` as its own: a text file's write and TensorBoard's
    writer say none, and a full disk was "EFBIG File too large" in one line naming no file."""
    try:
        yield
    except OSError as exc:
        raise named(exc, path) from None


def _quiet_tensorboard_threads() -> None:
    """TensorBoard writes its events on a thread; a write that fails there (a full disk) ends that thread, which
    prints its traceback, and the error is raised again in the process's next ``add_scalar`` (named by ``naming``).
    That thread's traceback is left out: the error's one line says it."""
    if getattr(threading.excepthook, "sinkflow", False):
        return
    default = threading.excepthook

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and getattr(args.thread, "exception", None) is not None:
            return
        default(args)

    hook.sinkflow = True
    threading.excepthook = hook


def open_lines(path: Path, buffering: int = -1):
    """``path`` opened to append lines: a killed writer's partial last line stays a line of its own (the next record
    joined to it was lost to every reader, a resume's rewind too)."""
    cut = path.is_file() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
    f = open(path, "a", buffering=buffering)
    if cut:
        f.write("\n")
    return f


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def _phase_of(line: str) -> str | None:
    """The phase of a metrics.jsonl line (None for a line that is not a record)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("phase") if isinstance(record, dict) else None


def _logged_after(line: str, phase: str, step: int) -> bool:
    """Is this metrics.jsonl line a record of ``phase`` past ``step``, or the phase's end record (``final``, written
    after its final.pt) at ``step``: a phase that resumes has not ended, and logs its end again (a run whose final.pt
    was deleted, resumed from the step file of its last step, had two end records at that step). A line that is not
    a record is kept."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    if not (isinstance(record, dict) and record.get("phase") == phase and isinstance(record.get("step"), (int, float))):
        return False
    return record["step"] > step or (record["step"] == step and record.get("final") is True)
