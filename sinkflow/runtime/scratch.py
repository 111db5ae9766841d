"""The scratch folders of the tools that train a throw-away run (preflight, doctor, lr-find, bench).

Each is a ``tempfile.TemporaryDirectory`` removed on the way out, a SIGTERM or Ctrl+C included; a ``kill -9``
cannot be answered, and left ``/tmp/sinkflow-preflight-*`` (3.4 MB for moons, more for an image preset) that
nothing removed. Their names now hold the pid that made them, and the next tool run deletes those whose process
is gone and which nobody touched for an hour (``sinkflow.processes.orphaned``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from sinkflow.processes import orphaned

_SCRATCH = re.compile(r"sinkflow-[a-z]+-(?P<pid>\d+)-.+")


def scratch_dir(kind: str) -> tempfile.TemporaryDirectory:
    """``TemporaryDirectory`` named ``sinkflow-KIND-PID-...``, after removing the orphaned ones of any kind."""
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for p in root.glob("sinkflow-*-*"):
            m = _SCRATCH.fullmatch(p.name)
            if m and p.is_dir() and not p.is_symlink() and orphaned(p, int(m["pid"])):
                shutil.rmtree(p, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"sinkflow-{kind}-{os.getpid()}-")
