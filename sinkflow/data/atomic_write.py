"""Atomic file writes: a file appears under its real name only once it is complete and on disk.

Every writer of a file that a later process reads (checkpoints, status.json, config.yaml, meta.json, the pool's
progress and arrays, the decoded image cache, the unpacked MNIST files, the classifier cache) writes a temporary
``.NAME.tmp-PID`` next to it, fsyncs it, renames it over ``NAME`` and fsyncs the folder. A killed or failing
write leaves the old file (or none), never a half-written one; a failing write removes its temp file, and
``sinkflow.runtime.checkpoint.remove_orphans`` deletes those a killed process left in a run folder; elsewhere (a
`sample --out` file killed mid-write) the next write of the same file deletes them (``remove_stale_temps``). It
lives in the data layer, the lowest one that writes files.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from sinkflow.processes import orphaned


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def named(error: OSError, path: Path) -> OSError:
    """``error`` with ``path`` as its file name if it has none (os.fsync's, torch.save's say no file)."""
    if isinstance(error.filename, bytes):  # TensorBoard's: b'/runs/...' in the message and in status.json
        return type(error)(error.errno, error.strerror or str(error), os.fsdecode(error.filename))
    if error.filename:
        return error
    return type(error)(error.errno, error.strerror or str(error), str(path))


def temp_beside(path: Path) -> Path:
    """A temp name next to ``path``, ``.NAME.tmp-PID-RANDOM``, no other writer's: two ranks of a multi-node job
    writing one shared image cache can have the same pid (a container per node), and one truncated the memmap the
    other was filling (SIGBUS). ``runtime.checkpoint.remove_orphans`` knows the form."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


_TEMP = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}")  # temp_beside's names


def remove_stale_temps(path: Path) -> None:
    """Delete the temp files of ``path`` that killed writes left beside it (``sinkflow sample --out s.npy`` killed
    with -9 left ``.s.npy.tmp-PID-RANDOM``, which nothing removed outside a run folder)."""
    try:
        siblings = list(path.parent.glob(f".{glob.escape(path.name)}.tmp-*"))
    except OSError:
        return
    for p in siblings:
        m = _TEMP.fullmatch(p.name)
        if m and m["name"] == path.name and orphaned(p, int(m["pid"])):
            with contextlib.suppress(OSError):
                p.unlink()


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_path(path) as tmp:`` write the whole file at ``tmp``; at the end of the block it is fsynced
    and renamed over ``path``. If the block raises, ``path`` is left as it was and ``tmp`` is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = temp_beside(path)
    try:
        yield tmp
        try:
            _fsync(tmp, os.O_RDWR)
        except OSError as exc:
            raise named(exc, path) from None
        os.replace(tmp, path)
        _fsync(path.parent, os.O_RDONLY)
    finally:
        tmp.unlink(missing_ok=True)


class _Recording:
    """A file wrapper that remembers the first OSError (errno, path) of the real file: torch.save turns
    it into a RuntimeError without either."""

    def __init__(self, f):
        self._f, self.error = f, None

    def write(self, data):
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self):
        try:
            self._f.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name):
        return getattr(self._f, name)


def atomic_write_bytes(path: str | os.PathLike, write) -> None:
    """Call ``write(fileobj)`` on a temp file next to ``path``, fsync it, then rename it into place.

    A failing write (a full disk...) raises the file's own ``OSError``, named after ``path``, and leaves no
    temp file behind."""
    path = Path(path)
    with atomic_path(path) as tmp:
        raw = open(tmp, "wb")
        f = _Recording(raw)
        try:
            write(f)
            f.flush()
            raw.close()
        except Exception as exc:
            # closed here, quietly: its flush of the bytes a full disk refused raised again, unnamed, over this error
            # (a status.json on a full disk was "ENOSPC No space left on device", no file named)
            with contextlib.suppress(OSError):
                raw.close()
            error = f.error if f.error is not None and not isinstance(exc, OSError) else exc  # torch wraps it
            if isinstance(error, OSError) and not error.filename:  # name the file it was writing
                raise named(error, path) from None
            if error is not exc:
                raise error from None
            raise


def write_refused(folder: Path) -> str | None:
    """Why ``folder`` takes no new file (a probe file created and removed there: read-only, no permission, a folder
    that takes none such as /proc), or None. Checked before work that would write there at its end."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """``atomic_write_bytes`` for a text file (UTF-8): status.json, progress.json, config.yaml, meta.json..."""
    data = text.encode()
    atomic_write_bytes(path, lambda f: f.write(data))


def reserve_disk(path: Path) -> None:
    """Allocate the blocks of ``path``'s full length now: a memory-mapped array file is created sparse, and a disk
    that fills while it is written into kills the process with SIGBUS (no message, exit 135) instead of
    raising ENOSPC. A file system that cannot preallocate is left as it is."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise OSError(exc.errno, exc.strerror, str(path)) from None
    finally:
        os.close(fd)


def create_array(tmp: Path, dtype, shape: tuple[int, ...], name: Path) -> np.memmap:
    """A new ``.npy`` array file at ``tmp`` (an ``atomic_path``), opened for writing through a memory map, its blocks
    reserved (``reserve_disk``); an error names ``name``, the file it becomes (numpy's own names none: EFBIG, ENOSPC).
    The trajectory pool's arrays and the decoded image cache are written this way."""
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(name)) from None
    reserve_disk(tmp)
    return out
