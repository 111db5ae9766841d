"""`sinkflow train [PRESET] [overrides]` and `sinkflow train --resume RUN`."""

from __future__ import annotations

import logging

from sinkflow import data, methods
from sinkflow.cli.common import add_config_args, preset_given, resolve_args, shorthands, split_preset
from sinkflow.errors import SinkflowError
from sinkflow.runner import dist
from sinkflow.runner.experiment import run_phases, verify
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
        named = args.preset if preset_given(args) else None
        split_preset(args)  # with --resume, positional arguments are overrides (and a preset must be the run's)
        run_ = Run.open(args.resume, args.overrides, shorthands(args))  # frozen keys, device: no writes
        if named is not None and named != run_.cfg["experiment"]["preset"]:
            raise SinkflowError(f"cannot resume {args.resume} as preset '{named}': it is a run of preset "
                                f"'{run_.cfg['experiment']['preset']}'",
                                f"drop the preset name (`sinkflow train --resume {args.resume}`) or start a new run "
                                f"with `sinkflow train {named}`")
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
            verify(run_, phases)  # finished phases' final.pt and the newest step checkpoint: safe, this run's
        run_.start()  # the lock (one writer per run folder), the resumed config, orphaned temp files
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


def _check(cfg: dict) -> None:
    data.distributions(cfg)
    methods.of(cfg).check(cfg, data.sample_shape(cfg))  # e.g. NSGF++: T <= 5, pool size
