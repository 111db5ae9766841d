"""Is the process that wrote a file still there? For what a killed process left: temp files, scratch folders,
heartbeats. No torch and no other sinkflow module: `sinkflow status` asks it before torch loads."""

from __future__ import annotations

import os
import time
from pathlib import Path


ORPHAN_AGE_S = 3600.0  # a temp file or scratch folder untouched this long, its writer's pid gone: an orphan


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` running on this machine (a zombie, killed and not yet reaped, is not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def orphaned(path: Path, pid: int, now: float | None = None) -> bool:
    """Was ``path`` (a temp file, a scratch folder) left by a writer that is gone: its pid not running here and the
    path untouched for ``ORPHAN_AGE_S`` (a writer on another machine of a shared disk is never that quiet)?"""
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except OSError:
        return False
    return age > ORPHAN_AGE_S and not pid_alive(pid)
