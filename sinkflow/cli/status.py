"""`sinkflow status RUN`: phase, step, rate, ETA, heartbeat age, latest metrics, checkpoints, disk use."""

from __future__ import annotations

import json
import math


def add_parser(sub):
    p = sub.add_parser("status", help="where a run is, whether it is alive, what it has on disk",
                       description="Reads the run folder only (heartbeat, metrics log, checkpoints): works while the "
                                   "run is going, after it finished and after it died. Exit status 0 running, "
                                   "evaluating (the final report) or finished, 1 dead, stopped, failed, stale, "
                                   "unknown, incomplete or damaged.",
                       epilog="example: sinkflow status runs/moons-nsgf-20261122-120000")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--stale-after", type=float, default=300.0, metavar="S",
                   help="a heartbeat older than this many seconds marks the run stale (default 300)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func=run)


def run(args):
    from sinkflow.errors import SinkflowError
    from sinkflow.tools.status import format_status, read_status

    if not (math.isfinite(args.stale_after) and args.stale_after > 0):  # -5 made every live run stale
        raise SinkflowError(f"--stale-after {args.stale_after:g} must be a positive number of seconds",
                            "e.g. --stale-after 600 for a run that logs every few minutes")
    st = read_status(args.run_dir, stale_after=args.stale_after)
    print(json.dumps(strict_json(st), indent=2, default=str, allow_nan=False) if args.json else format_status(st))
    return 0 if st["state"] in ("running", "evaluating", "finished", "not started") else 1


def strict_json(value):
    """``value`` with every non-finite float as null: a skipped fp16 step's ``grad_norm: Infinity`` is not JSON, and
    JavaScript's (and every strict) parser refused the whole status. metrics.jsonl keeps them (Python and pandas
    read ``Infinity`` / ``NaN``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value
