"""The command that continues a run as it was launched, from what the run recorded.

The CLI prints it when a run stops; `sinkflow status` and every command that finds a phase unfinished (`sample`,
`eval`, `tune` ...) give the same one: a plain `--resume` dropped the time limit (a Kaggle session then overran and
lost its work) and resumed a torchrun job on one process."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from sinkflow.runtime.signals import format_duration


def resume_command(run_dir, world: int = 1, no_report: bool = False, time_limit: float | None = None,
                   per_node: int | None = None) -> str:
    """The command that continues a run as it was launched: torchrun with its process count (and node count, when
    ``per_node`` processes ran on each of several nodes: the ``...`` is your rendezvous flags), ``--no-report`` and
    the session's ``--time-limit`` where it had them. The CLI prints it when a run stops, and `sinkflow status`
    gives the same one (``resume_for``): status gave a plain resume, which dropped the time limit (a Kaggle session
    then overran and lost its work) and resumed a torchrun job on one process."""
    if world > 1 and per_node and per_node < world and world % per_node == 0:
        launch = f"torchrun --nnodes {world // per_node} --nproc_per_node {per_node} ... -m sinkflow"
    else:
        launch = f"torchrun --nproc_per_node {world} -m sinkflow" if world > 1 else "sinkflow"
    return (f"{launch} train --resume {shlex.quote(str(run_dir))}" + (" --no-report" if no_report else "")
            + (f" --time-limit {format_duration(time_limit)}" if time_limit else ""))


def resume_for(run_dir: Path, hb: dict) -> str:
    """``resume_command`` from what the run recorded: every heartbeat of a run holds its launch (world, processes a
    node, report, time limit: a torchrun job killed as a phase started, or failed on a lost rank, was told to resume
    as one process); a run from before, its heartbeat's world and meta.json's first argv."""
    if "no_report" in hb:
        no_report = bool(hb["no_report"])
    else:
        try:
            argv = json.loads((Path(run_dir) / "meta.json").read_text()).get("argv") or []
        except (OSError, ValueError, AttributeError):
            argv = []
        no_report = "--no-report" in argv
    world, per_node, time_limit = hb.get("world"), hb.get("per_node"), hb.get("time_limit")
    return resume_command(run_dir, world if isinstance(world, int) and world > 0 else 1, no_report,
                          time_limit if isinstance(time_limit, (int, float)) and time_limit > 0 else None,
                          per_node if isinstance(per_node, int) and per_node > 0 else None)


def read_heartbeat(run_dir) -> dict:
    """``RUN/status.json``, or {} where it is missing, unreadable, or JSON that is no heartbeat (`null`, a list, a
    time or pid of text: a traceback in `sinkflow status` before)."""
    try:
        hb = json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    fine = isinstance(hb, dict) and isinstance(hb.get("time", 0.0), (int, float)) and isinstance(hb.get("pid", 0), int)
    return hb if fine else {}


def recorded_resume(run_dir) -> str:
    """``resume_for`` the heartbeat on disk (none readable: the defaults and meta.json's argv)."""
    return resume_for(Path(run_dir), read_heartbeat(run_dir))
