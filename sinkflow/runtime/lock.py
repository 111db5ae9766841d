"""One writer per run folder: an exclusive ``fcntl.flock`` on ``RUN/.lock`` for as long as the process writes.

The kernel drops a flock when its holder exits or dies (even by SIGKILL), so a lock is never stale. The
holder writes ``PID@HOST`` into the file; a second process that cannot take the lock says which process holds it,
and where (a run folder on a shared disk is locked from any node).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from pathlib import Path

from sinkflow.errors import SinkflowError
from sinkflow.runtime.relaunch import recorded_resume

LOCK_NAME = ".lock"
_held: dict[str, int] = {}  # resolved run folder -> fd of its lock file (this process is the writer)


def _key(run_dir: Path) -> str:
    return str(Path(run_dir).resolve())


def holder(run_dir: Path) -> str:
    """The lock holder as it wrote itself: ``PID on HOST`` (a run folder on a shared disk is locked from any node),
    or a bare pid (a lock file from before the host was written)."""
    try:
        text = (Path(run_dir) / LOCK_NAME).read_text().strip()
    except OSError:
        return "unknown"
    pid, _, host = text.partition("@")
    return f"{pid} on {host}" if host else pid or "unknown"


def _stop_hint(who: str) -> str:
    """``kill PID`` where the holder (``holder``'s words) runs on this host; on another node a kill here would hit
    another process."""
    pid, _, host = who.partition(" on ")
    if host and host != socket.gethostname():
        return f"stop it on {host} (kill {pid} there)"
    return f"stop it (kill {pid})" if pid.isdigit() else "stop it"


def lock_run(run_dir: Path) -> None:
    """Take the run folder's lock (re-entrant within this process) or raise a one-line error naming the holder."""
    key = _key(run_dir)
    if key in _held:
        return
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        who = holder(run_dir)
        raise SinkflowError(
            f"run folder {run_dir} is in use by another sinkflow process (pid {who})",
            f"wait for it to finish or {_stop_hint(who)}; two writers would interleave checkpoints and metrics") \
            from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode())
    _held[key] = fd


def check_held(run_dir: Path) -> None:
    """Before a write that must be this process's alone (a checkpoint, the pool's progress): if this process holds
    the run's lock but ``RUN/.lock`` was deleted or replaced meanwhile, take the lock again, and stop in one line if
    another process has taken it (a second `train --resume` after the user deleted the file: both wrote every
    checkpoint and metrics line of the same steps). A no-op where this process holds no lock (a scratch run)."""
    key = _key(run_dir)
    fd = _held.get(key)
    if fd is None:
        return
    try:
        if os.stat(Path(run_dir) / LOCK_NAME).st_ino == os.fstat(fd).st_ino:
            return
    except FileNotFoundError:
        pass
    del _held[key]
    os.close(fd)
    lock_run(run_dir)  # the holder's one line if another process has it


def held(run_dir: Path) -> bool | None:
    """Does a process hold ``RUN/.lock`` now (this one included)? None where there is no lock file to probe. The
    probe is a shared flock taken and dropped at once: it never blocks, and the writer's exclusive lock makes it
    fail. A pid is not enough: after a kill -9 the kernel gives it to the next process, while the lock died with
    the writer."""
    if _key(run_dir) in _held:
        return True
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        return None
    finally:
        os.close(fd)
    return False


def finish_fix(run_dir: Path) -> str:
    """How an unfinished run gets finished: the resume command as it was launched (``runtime.relaunch``: its time
    limit, its processes), or, while another process is training it (its lock is held), waiting for that process:
    a resume would be refused by the lock."""
    if _key(run_dir) not in _held and held(run_dir):
        return (f"it is still training (pid {holder(run_dir)}): wait for it to finish (`sinkflow status "
                f"{run_dir}` shows its progress)")
    return f"finish it with `{recorded_resume(run_dir)}`"


def unlock_run(run_dir: Path) -> None:
    fd = _held.pop(_key(run_dir), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


def is_locked_here(run_dir: Path) -> bool:
    return _key(run_dir) in _held


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """Hold the lock for a block (released after it unless this process already held it)."""
    mine = not is_locked_here(run_dir)
    lock_run(run_dir)
    try:
        yield
    finally:
        if mine:
            unlock_run(run_dir)
