"""`sinkflow doctor PRESET|RUN`: can the loop learn, is it wired right, is the data what the model expects."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from sinkflow.cli.common import add_config_args, resolve_args, run_folder_arg
from sinkflow.errors import SinkflowError
from sinkflow.runtime.scratch import scratch_dir


def add_parser(sub):
    p = sub.add_parser(
        "doctor", help="overfit one batch, wiring and data checks for every training phase",
        description="For every training phase (of a scratch run of PRESET, or of the run folder RUN): overfit one "
                    "fixed batch with the phase's own train_step, check that every trainable parameter is in the "
                    "optimizer, the loss has a graph, weights change after a step, modules are in train mode while "
                    "training and eval mode while sampling, frozen phases stay frozen, the data is finite float32 "
                    "in range, consecutive batches differ, no batch of 1 reaches BatchNorm. One line per finding: "
                    "symptom, cause, fix. Exit status 1 on any failure.",
        epilog="examples:\n  sinkflow doctor moons\n  sinkflow doctor runs/moons-nsgf-x --phase velocity",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--phase", action="append", help="only this training phase (repeatable)")
    # 300 = sinkflow.tools.doctor.OVERFIT_STEPS, not imported here: that module loads torch (--help stays fast)
    p.add_argument("--steps", type=int, default=300, help="overfit-one-batch steps (default 300)")
    p.add_argument("--overfit-batch", type=int, default=16, help="samples in the fixed batch (default 16)")
    p.add_argument("--factor", type=float, default=10.0, help="the loss must fall by this factor (default 10)")
    p.set_defaults(func=run)


def run(args):
    if args.phase is not None:  # `--phase ''` checked every phase and named "only phase(s)  checked"; a repeat twice
        if not all(p.strip() for p in args.phase):
            raise SinkflowError("--phase '' names no phase", "name a training phase, e.g. --phase velocity")
        args.phase = list(dict.fromkeys(p.strip() for p in args.phase))
    if not (math.isfinite(args.factor) and args.factor > 1):  # nan never fails a comparison; <= 1 never fails at all
        raise SinkflowError(f"--factor {args.factor} must be a number > 1 (how many times the loss must fall)",
                            "e.g. --factor 10 (the default)")
    run_dir = run_folder_arg(args, "doctor")  # before torch loads: a folder that is no run is one line
    cfg = resolve_args(args) if run_dir is None else None  # so is a preset, key or path that is wrong (runs/typo)
    from sinkflow.tools.data import real_or_synthetic
    from sinkflow.tools.doctor import doctor_run

    from sinkflow.runtime.callbacks import quiet

    with scratch_dir("doctor") as tmp, quiet():
        if run_dir is not None:
            findings = doctor_run(None, tmp, run_dir=run_dir, overfit_steps=args.steps,
                                  overfit_batch=args.overfit_batch, factor=args.factor, phases=args.phase,
                                  device=args.device)
            label = args.preset
        else:
            label = cfg["experiment"]["preset"]
            with real_or_synthetic(cfg) as reason:
                if reason:
                    print(f"data: synthetic {cfg['data']['target']} images of the real shape ({reason})")
                findings = doctor_run(cfg, tmp, overfit_steps=args.steps, overfit_batch=args.overfit_batch,
                                      factor=args.factor, phases=args.phase)
    print(f"doctor {label}")
    for f in findings:
        print("  " + f.line())
    bad = sum(f.ok is False for f in findings)
    print(f"  {'OK' if not bad else 'PROBLEMS'}: {sum(f.ok is True for f in findings)} ok, {bad} failed, "
          f"{sum(f.ok is None for f in findings)} not applicable")
    return 1 if bad else 0
