"""`sinkflow status RUN`: phase, step, rate, ETA, heartbeat age, latest metrics, checkpoints, disk use."""

from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("status", help="where a run is, whether it is alive, what it has on disk",
                       description="Reads the run folder only (heartbeat, metrics log, checkpoints): works while the "
                                   "run is going, after it finished and after it died. Exit status 0 running or "
                                   "finished, 1 dead, stopped, failed or stale.",
                       epilog="example: sinkflow status runs/moons-nsgf-20261122-120000")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--stale-after", type=float, default=300.0, metavar="S",
                   help="a heartbeat older than this many seconds marks the run stale (default 300)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func=run)


def run(args):
    from sinkflow.tools.status import format_status, read_status

    st = read_status(args.run_dir, stale_after=args.stale_after)
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 0 if st["state"] in ("running", "finished", "not started") else 1
