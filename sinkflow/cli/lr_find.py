"""`sinkflow lr-find PRESET|RUN [--phase NAME] [--write RUN_OR_CONFIG]`: LR range test for one training phase."""

from __future__ import annotations

import argparse
from pathlib import Path

from sinkflow.cli.common import add_config_args, resolve_args, run_folder_arg
from sinkflow.runtime.scratch import scratch_dir


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
    p.add_argument("--write", metavar="RUN_OR_CONFIG", help="write the chosen rate as train.<phase>.lr into a run "
                   "folder whose phase has not finished, or a .yaml file")
    p.set_defaults(func=run, command_name="lr-find")


def check_args(args) -> Path | None:
    """The sweep range, the plot file and where --write goes, checked before torch loads or a pool is built (each
    used to fail with a traceback, the plot file only after the whole sweep); returns the --write run folder."""
    from sinkflow.tools.lr_find import check_plot_path, check_sweep, write_target

    check_sweep(args.start_lr, args.end_lr, args.steps, args.diverge, flags=True)
    check_plot_path(Path(args.out))
    if args.write:
        target, is_run = write_target(Path(args.write))
        return target if is_run else None
    return None


def start_of(trainer, run_dir: Path | None) -> str:
    """Where the sweep's network started: the phase's initial weights, or a run's at its step. Why: `lr-find RUN` of a
    finished phase sweeps its trained weights, whose best rate (to train on from there) is not a fresh run's, and
    the output named neither."""
    if trainer.step == 0:
        return "step 0 (the phase's initial weights)"
    from sinkflow.runtime.run_folder import read_config

    iters = read_config(run_dir)["train"][trainer.task.model_key]["iters"]  # the trainer's own is cut to FOREVER
    done = " (finished: rates for training on from its weights, not for a fresh start)" if trainer.step >= iters else ""
    return f"the run's weights at step {trainer.step:,} of {iters:,}{done}"


def run(args):
    write_run = check_args(args)
    from_run = run_folder_arg(args, "lr-find") is not None  # before torch loads: a folder that is no run is one line
    cfg = None if from_run else resolve_args(args)  # so is a preset, key or path that is wrong (runs/typo)
    from sinkflow.errors import SinkflowError
    from sinkflow.runtime.run_folder import read_config
    from sinkflow.tools.lr_find import (phase_lr_find, plot, refuse_finished_phase, refuse_other_recipe, step_path,
                                        write_lr)
    from sinkflow.tools.phases import open_run_phase, training_phase, workspace

    if args.write:  # before the pool and the sweep: another batch's rate, a finished phase's rate, a locked run
        swept_cfg = cfg or read_config(Path(args.preset))
        swept = training_phase(swept_cfg, args.phase)
        if write_run is not None:
            refuse_finished_phase(write_run, f"train.{swept.model_key}.lr", swept.name)
            from sinkflow.runtime.lock import run_lock

            with run_lock(write_run):  # a run another process trains: its holder's one line now, not after the sweep
                pass
        refuse_other_recipe(Path(args.write), swept_cfg, swept.model_key)
    from sinkflow.runtime.callbacks import progress_mode, quiet

    shown = progress_mode()  # the sweep's own steps are the user's: shown as a phase's, though quiet() mutes the rest
    with scratch_dir("lrfind") as tmp, quiet():  # the sweep's scratch run, unshown
        if from_run:
            run_, phase = open_run_phase(Path(args.preset), args.phase, args.device)
            label = args.preset
        else:
            run_, phase = workspace(cfg, args.phase, Path(tmp))
            label = cfg["experiment"]["preset"]
        res = phase_lr_find(phase, shown, start_lr=args.start_lr, end_lr=args.end_lr, steps=args.steps,
                            diverge=args.diverge)
        run_.logger.close()
    # the default --out is one name in the working folder: a second phase's sweep replaced the first's plot unsaid
    replaced = " (replacing the earlier file: --out NAME keeps both)" if Path(args.out).exists() else ""
    path = plot(res, Path(args.out), f"{label}: phase {phase.name}")
    print(f"lr-find {label}, phase {phase.name} (batch {phase.cfg['batch_size']}, {len(res.lrs)} steps) from "
          f"{start_of(phase, Path(args.preset) if from_run else None)}")
    print("  step: " + step_path(phase, res))
    print("  " + res.summary())
    print(f"  configured train.{phase.task.model_key}.lr = {phase.cfg['lr']:.2e}; plot: {path}{replaced}")
    if args.write:
        if not res.suggestions:
            raise SinkflowError("the sweep gave no suggestion, nothing written",
                                "widen --start-lr/--end-lr or raise --steps")
        lr = res.suggestions[args.choose]
        where = write_lr(Path(args.write), f"train.{phase.task.model_key}.lr", lr, phase.task.name, swept_cfg)
        print(f"  wrote train.{phase.task.model_key}.lr={lr:.3g} ({args.choose}) to {where}")
    return 0
