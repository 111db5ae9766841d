"""`sinkflow train [PRESET] [overrides]` and `sinkflow train --resume RUN`."""

from __future__ import annotations

import json
import logging

from sinkflow import data, methods
from sinkflow.cli.common import add_config_args, resolve_args, shorthands, split_preset
from sinkflow.data.atomic_write import atomic_write_text
from sinkflow.errors import SinkflowError
from sinkflow.runner import dist
from sinkflow.runner.experiment import run_phases
from sinkflow.runner.lock import unlock_run
from sinkflow.runner.run import Run

log = logging.getLogger("sinkflow")


def add_parser(sub):
    p = sub.add_parser(
        "train", help="train an experiment (every phase, resumable)",
        description="Train every phase of an experiment. Checkpoints at the end of every phase and every "
                    "train.*.ckpt_every steps; SIGTERM/SIGINT checkpoint before exiting.",
        epilog="examples:\n  sinkflow train                       # NSGF, 8gaussians -> moons\n"
               "  sinkflow train moons --train-iters 2000 pool.eta=0.05\n"
               "  sinkflow train --resume runs/moons-nsgf-20261122-120000",
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run: finished phases are skipped")
    p.add_argument("--no-report", action="store_true", help="skip the evaluation and plots after training")
    p.set_defaults(func=run)


def run(args):
    info = dist.init(getattr(args, "device", None) or "auto")
    # every check comes first; nothing is written into a run folder before run_.start() (docs/reliability.md)
    if args.resume:
        split_preset(args)  # with --resume, positional arguments are overrides only
        run_ = Run.open(args.resume, args.overrides, shorthands(args))  # frozen keys, device: no writes
    else:
        cfg = resolve_args(args)
        _check(cfg)  # the data and the method's limits before the run folder exists
        run_ = Run.create(cfg)
    args.run_dir_used = str(run_.dir)
    try:
        cfg = run_.cfg
        if args.resume:
            _check(cfg)
        source, target = data.distributions(cfg)
        method = methods.of(cfg)
        phases = method.phases(cfg, source, target)
        if args.resume:
            run_.verify(phases)  # finished phases' final.pt and the newest step checkpoint: safe, this run's
        run_.start()  # the lock (one writer per run folder), the resumed config, orphaned temp files
        record_split(run_, target)
        if info.is_main:
            log.info("run folder: %s", run_.dir)
            log.info("method %s", method.describe(cfg))
        run_phases(run_, phases)
        if info.is_main and not args.no_report:
            from sinkflow.eval.report import final_report

            print(final_report(run_))
    finally:
        run_.logger.close()
        unlock_run(run_.dir)
    return 0


def record_split(run_, target) -> None:
    """RUN/data_split.json: which images trained and which are held out (image sets only), so a result can
    be traced to its split; rewritten identically on resume."""
    info = getattr(target, "split_info", None)
    if info and run_.dist.is_main:
        atomic_write_text(run_.dir / "data_split.json", json.dumps(info, indent=1))


def _check(cfg: dict) -> None:
    _, target = data.distributions(cfg)
    held = getattr(target, "test_rows", 0)  # a point file's held-out rows are the only test points
    if held and cfg["eval"]["n"] > held:
        raise SinkflowError(f"eval.n={cfg['eval']['n']} test points, but data.test_rows holds out only {held}",
                            f"set eval.n={held} (or less), or hold out more rows")
    methods.of(cfg).check(cfg, data.sample_shape(cfg))  # e.g. NSGF++: T <= 5, pool size
