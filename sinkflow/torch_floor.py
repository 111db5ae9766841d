"""The oldest torch and torchvision sinkflow runs on, checked by ``import sinkflow`` without loading torch."""

from __future__ import annotations

import re
import sys
from importlib import metadata

from sinkflow.errors import SinkflowError

# The oldest torch and torchvision sinkflow runs on: the oldest the whole CPU test suite passed on (README, "Install";
# torch 2.4.1 / torchvision 0.19.1 on 2026-12-01). Keep equal to pyproject.toml's torch>= and torchvision>=.
TORCH_MINIMUM = {"torch": (2, 4), "torchvision": (0, 19)}


class TorchTooOld(SinkflowError, ImportError):
    """The installed torch or torchvision is older than ``TORCH_MINIMUM``: raised by ``import sinkflow``."""


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string, compared as numbers (2.10 is newer than 2.4); a local or pre-release tail
    is ignored ("2.4.1+cu121", NGC's "2.6.0a0+ecf3bae" count as 2.4 and 2.6). None if it does not start so."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def installed(name: str) -> str | None:
    """The version of ``name`` this Python uses: the loaded module's ``__version__`` (a notebook that imported torch
    first), else the installed package's metadata, so the check loads no torch (``import sinkflow``, ``sinkflow
    --help`` and ``status`` stay light); None where neither says (not installed, a source tree without metadata)."""
    version = getattr(sys.modules.get(name), "__version__", None)
    if version is not None:
        return str(version)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def torch_too_old() -> TorchTooOld | None:
    """The error for an installed torch or torchvision older than ``TORCH_MINIMUM``, else None (one that is not
    installed is left to its own ImportError where it is imported)."""
    old = [f"{name} {version}" for name, floor in TORCH_MINIMUM.items()
           if (version := installed(name)) is not None and (have := release(version)) is not None and have < floor]
    if not old:
        return None
    need = {name: f"{name}>={'.'.join(map(str, floor))}" for name, floor in TORCH_MINIMUM.items()}
    return TorchTooOld(f"sinkflow needs {' and '.join(need.values())}, this Python has {' and '.join(old)}",
                       f"pip install -U {' '.join(repr(n) for n in need.values())}, then restart Python (a notebook: "
                       "its kernel)")


def _one_line(kind, exc, tb) -> None:
    """``sys.excepthook`` of a process stopped by ``TorchTooOld``: one line, as the ``sinkflow`` command prints its
    other errors; anything else as Python prints it."""
    if isinstance(exc, TorchTooOld):
        print(f"sinkflow: error: {exc}", file=sys.stderr)
    else:
        sys.__excepthook__(kind, exc, tb)


def check_torch() -> None:
    """Raise ``TorchTooOld`` if torch or torchvision is older than ``TORCH_MINIMUM`` (``import sinkflow`` calls it).

    A preinstalled torch (Kaggle, Colab), ``pip install --no-deps``, a ``PYTHONPATH`` checkout or a later downgrade can
    leave one older than pyproject.toml asks for. On torch 2.2 a run got as far as its first training step and died
    there in a traceback (``torch.amp.GradScaler``: torch 2.3; ``torch.OutOfMemoryError``, the CPU's fused Adam:
    2.4). A script or the ``sinkflow`` command stopped by this prints its one line with no traceback (exit status 1:
    the import fails before the command's own handling); a notebook shows the line as the ImportError's message."""
    error = torch_too_old()
    if error is not None:
        if sys.excepthook is sys.__excepthook__:  # IPython's or an IDE's own hook is left alone
            sys.excepthook = _one_line
        raise error
