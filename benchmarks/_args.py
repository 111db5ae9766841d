"""Argument checks the benchmark scripts share: bad input ends in ONE line that names the problem and the fix, before
any work starts, never in a traceback minutes into a run (or in a default silently taken for a 0).

``positive_int`` / ``at_least(n)`` are argparse ``type=`` functions (argparse then says ``argument --x: ...`` and
exits 2). ``checked_device`` runs in a script's ``main`` right after parsing, not inside ``parse_args``:
benchmarks/gpu_session.py checks a GPU plan's arguments with ``parse_args`` on a machine without CUDA.
``one_line_errors`` turns a ``SinkflowError`` raised mid-run into the same one line (exit 2) as the CLI does.
torch and sinkflow are imported only where used: ot_coupling.py keeps its start-up free of torch until main.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, NoReturn


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on stderr and exit 2, as argparse's ``ap.error`` does (without its usage line)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}: give a whole number >= {low}")
        return value
    parse.__name__ = f"int>={low}"  # what argparse names in its message
    return parse


positive_int = at_least(1)


def checked_device(name: str, error: Callable[[str], NoReturn] = fail):
    """``torch.device(name)``, refused in one line where it names no device or CUDA where there is none (torch's
    own error would come as a traceback at the first tensor moved there)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        error(f"--device {name}: not a device torch knows; use --device cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        error(f"--device {name}: no CUDA device here; use --device cpu")
    return device


def one_line_errors(main: Callable) -> Callable:
    """Wrap a script's ``main``: a ``SinkflowError`` (a problem the user can fix, already worded as one) ends the
    script in its one line and exit 2 instead of a traceback."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        from sinkflow.errors import SinkflowError

        try:
            return main(*args, **kwargs)
        except SinkflowError as exc:
            fail(str(exc))
    return wrapped
