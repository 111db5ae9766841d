"""`sinkflow train [PRESET] [overrides]` and `sinkflow train --resume RUN`: argument handling over
``sinkflow.engine.experiment.train_run``, the entry point ``sinkflow.train`` shares."""

from __future__ import annotations

import signal
import sys
import threading

from sinkflow.cli.common import add_config_args, preset_given, resolve_args, shorthands, split_preset


def add_parser(sub):
    p = sub.add_parser(
        "train", help="train an experiment (every phase, resumable)",
        description="Train every phase of an experiment. Checkpoints at the end of every phase and every "
                    "train.*.ckpt_every steps; SIGTERM/SIGINT (and --time-limit) checkpoint before exiting.",
        epilog="examples:\n  sinkflow train                       # NSGF, 8gaussians -> moons\n"
               "  sinkflow train moons --train-iters 2000 pool.eta=0.05\n"
               "  sinkflow train --resume runs/moons-nsgf-20261122-120000\n"
               "  sinkflow train mnist --time-limit 8h30m    # stop with a checkpoint before a 9-hour session ends",
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run: finished phases are skipped")
    p.add_argument("--no-report", action="store_true", help="skip the evaluation and plots after training")
    p.add_argument("--time-limit", metavar="DURATION",
                   help="stop with a checkpoint once this session has trained this long (8h30m, 90m, 2.5h, "
                        "08:30:00; exit status 124), then --resume continues: set it below a platform's session "
                        "limit (Kaggle) by the time a checkpoint and your other cells take")
    p.set_defaults(func=run)


def run(args):
    from sinkflow.errors import SinkflowError
    from sinkflow.runtime.signals import parse_duration

    remember = lambda r: setattr(args, "run_dir_used", str(r.dir))  # noqa: E731  (the Interrupted hint)
    try:
        time_limit = None if args.time_limit is None else parse_duration(args.time_limit)  # before torch loads
    except SinkflowError as exc:  # torchrun: every rank parses the same --time-limit before the ranks connect, and
        exc.every_rank = True  # each printed the same line (8 on 8 processes): rank 0 says it, all exit 2
        raise
    kw = dict(device=getattr(args, "device", None), on_open=remember, then=None if args.no_report else report,
              time_limit=time_limit)
    if args.resume:
        from sinkflow.engine.experiment import train_run

        named = args.preset if preset_given(args) else None
        split_preset(args)  # with --resume, positional arguments are overrides (and a preset must be the run's)
        train_run(resume=args.resume, overrides=args.overrides, shorthands=shorthands(args), preset=named, **kw)
    else:
        cfg = resolve_args(args)  # a bad key or value fails here, before torch loads (seconds)
        from sinkflow.engine.experiment import train_run

        train_run(cfg, **kw)
    return 0


class ReportStopped(Exception):
    """A SIGTERM while the final report runs (the training is finished and saved)."""


def _stop_report(signum, frame):
    raise ReportStopped


def report(run) -> None:
    """The evaluation and plots `sinkflow train` prints when it finishes (main process). A SIGTERM or Ctrl+C during
    it (minutes on images) ends it with one line saying the run is finished and how to get the report, not in
    silence (SIGTERM's default) or with a traceback (Ctrl+C's)."""
    from sinkflow.runtime import dist

    if not dist.current().is_main:
        return
    from sinkflow.eval.report import final_report

    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _stop_report) if main_thread else None
    # `status` says EVALUATING while this runs (it said FINISHED: a user shut the machine down before the report),
    # and, once the process is gone, whether the report was written
    run.logger.heartbeat(phase="report", state="evaluating")
    try:
        print(final_report(run))
        run.logger.heartbeat(phase="done", state="finished", report="written")
        from sinkflow.tools.tune import hint

        if line := hint(run.cfg):
            print(line.format(run=run.dir))
    except (ReportStopped, KeyboardInterrupt) as exc:
        signum = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
        run.logger.heartbeat(phase="done", state="finished", report="stopped")
        print(f"sinkflow: the evaluation report was stopped by signal {int(signum)}; training is finished and saved: "
              f"`sinkflow eval {run.dir}` reports it", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
