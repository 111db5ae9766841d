"""`sinkflow lr-find PRESET|RUN [--phase NAME] [--write RUN_OR_CONFIG]`: LR range test for one training phase."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from sinkflow.cli.common import add_config_args, resolve_args


def add_parser(sub):
    p = sub.add_parser(
        "lr-find", help="LR range test for a training phase (suggests rates, saves a plot)",
        description="Exponential LR sweep with the phase's own batches and loss; smoothed, NaN-robust, stops on "
                    "divergence; restores the model and optimizer afterwards. Earlier phases are built small in a "
                    "scratch run (or taken from RUN when a run folder is given).",
        epilog="examples:\n  sinkflow lr-find moons\n  sinkflow lr-find moons --steps 200 --write runs/moons-nsgf-x\n"
               "  sinkflow lr-find runs/moons-nsgf-x --phase velocity --choose moderate --write runs/moons-nsgf-x",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--phase", help="training phase (default: the first)")
    p.add_argument("--start-lr", type=float, default=1e-7)
    p.add_argument("--end-lr", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--diverge", type=float, default=4.0, help="stop when the smoothed loss exceeds this x best")
    p.add_argument("--out", default="lr_find.png", help="plot file (default lr_find.png)")
    p.add_argument("--choose", choices=("conservative", "moderate", "aggressive"), default="moderate")
    p.add_argument("--write", metavar="RUN_OR_CONFIG", help="write the chosen rate as train.<phase>.lr there")
    p.set_defaults(func=run, command_name="lr-find")


def run(args):
    from sinkflow.errors import SinkflowError
    from sinkflow.tools.lr_find import phase_lr_find, plot, write_lr
    from sinkflow.tools.phases import open_run_phase, workspace

    with tempfile.TemporaryDirectory(prefix="sinkflow-lrfind-") as tmp:
        if Path(args.preset).is_dir():
            run_, phase = open_run_phase(Path(args.preset), args.phase)
            label = args.preset
        else:
            cfg = resolve_args(args)
            run_, phase = workspace(cfg, args.phase, Path(tmp))
            label = cfg["experiment"]["preset"]
        res = phase_lr_find(phase, start_lr=args.start_lr, end_lr=args.end_lr, steps=args.steps, diverge=args.diverge)
        run_.logger.close()
    path = plot(res, Path(args.out), f"{label}: phase {phase.name}")
    print(f"lr-find {label}, phase {phase.name} (batch {phase.cfg['batch_size']}, {len(res.lrs)} steps)")
    print("  " + res.summary())
    print(f"  configured train.{phase.task.model_key}.lr = {phase.cfg['lr']:.2e}; plot: {path}")
    if args.write:
        if not res.suggestions:
            raise SinkflowError("the sweep gave no suggestion, nothing written",
                                "widen --start-lr/--end-lr or raise --steps")
        lr = res.suggestions[args.choose]
        where = write_lr(Path(args.write), f"train.{phase.task.model_key}.lr", lr)
        print(f"  wrote train.{phase.task.model_key}.lr={lr:.3g} ({args.choose}) to {where}")
    return 0
