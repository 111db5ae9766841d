"""`sinkflow preflight PRESET|RUN [overrides] [--gpu NAME|--gpu-mem GiB] [--fit] [--all]`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from sinkflow import config
from sinkflow.cli.common import add_config_args, preset_given, refuse_plain_folder, shorthands, split_preset
from sinkflow.errors import SinkflowError


def add_parser(sub):
    p = sub.add_parser(
        "preflight",
        help="run every phase tiny on CPU with the real shapes; estimate GPU memory (of a preset or a run)",
        description="Runs every phase with tiny counts but the real data shapes and model config on CPU, stops and "
                    "resumes each phase once, samples and evaluates, checks that every flag reached the phases it "
                    "names, and estimates each phase's peak GPU memory for the real config. Given a run folder, its "
                    "own config.yaml, with the phases it finished left out of the memory verdict and the fit (a "
                    "resume does not run them again) and a fit printed as `sinkflow train --resume RUN ...`. Exit "
                    "status 1 on any failure.",
        epilog="examples:\n  sinkflow preflight moons\n  sinkflow preflight cifar10 --gpu T4 --fit\n"
               "  sinkflow preflight runs/cifar10-nsgfpp-20261201-010203 --gpu T4 --fit\n"
               "  sinkflow preflight --all",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu", help="card to check the memory against: T4, L4, A100-40GB, A100-80GB, H100-80GB, H200")
    g.add_argument("--gpu-mem", type=float, metavar="GiB", help="... or its memory in GiB")
    p.add_argument("--fit", action="store_true", help="apply the proposed changes and print the resulting command")
    p.add_argument("--all", action="store_true", help="every preset (overrides apply to each)")
    p.add_argument("--world", type=int, default=1, help="processes (GPUs) the real run will use (default 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory estimate")
    p.set_defaults(func=run)


def _one(preset, args, card, run_dir: Path | None = None) -> bool:
    from sinkflow.tools import memory_plan
    from sinkflow.tools.preflight import fit_command, format_report, preflight

    sh = shorthands(args)
    report = preflight(preset, args.overrides, sh, gpu=card, world=args.world, memory=not args.no_memory,
                       run_dir=run_dir)
    print(format_report(report))
    if report.memory:
        cards = {card[0]: card[1]} if card else None
        print(f"\npeak GPU memory per phase for the real config ({args.world} process(es); "
              f"'ok' = fits 90% of (the card minus 1 GiB); {memory_plan.planned_for(card[0] if card else None)}):")
        print(memory_plan.format_table(report.memory, cards))
    ok = report.ok
    if card and report.fit_reasons:
        print(f"\nto fit {card[0]}:")
        for r in report.fit_reasons:
            print(f"  - {r}")
        if report.fit_overrides:
            print("  overrides: " + " ".join(report.fit_overrides))
            print("  command:   " + fit_command(preset, args.overrides, sh, report.fit_overrides, run_dir))
        if args.fit and report.fit_overrides:
            cfg = config.resolve(preset, [*args.overrides, *report.fit_overrides], sh)
            mems = memory_plan.estimate(cfg, world=args.world, bf16=memory_plan.card_bf16(card[0]))
            if run_dir is not None:
                mems = memory_plan.finished_in(mems, run_dir)
            print("\nwith --fit applied:")
            print(memory_plan.format_table(mems, {card[0]: card[1]}))
            others = all(c.ok is not False for c in report.checks if not c.name.startswith("fits "))
            over = memory_plan.over_budget(cfg, mems, card[1])  # the same checks as before the fit, pool RAM included
            print(f"  {'FAIL' if over else 'PASS'}  fits {card[0]} with --fit applied: "
                  + (f"too large: {', '.join(over)}" if over else "every phase fits"))
            ok = others and not over
    return ok


def check_args(args) -> None:
    """``--gpu-mem`` and ``--world``, checked before torch loads or any phase runs: a NaN card size used to end in a
    traceback, a 0 was ignored in silence, a negative gave absurd advice, and ``--world 0`` failed after every
    phase had run."""
    if args.gpu_mem is not None and not (math.isfinite(args.gpu_mem) and args.gpu_mem > 0):
        raise SinkflowError(f"--gpu-mem must be a positive number of GiB, got {args.gpu_mem:g}",
                            "e.g. --gpu-mem 16, or name the card: --gpu T4")
    if args.world < 1:
        raise SinkflowError(f"--world must be >= 1, got {args.world}",
                            "give the number of processes (GPUs) the run will use, e.g. --world 4 (default 1)")
    memory_flags = [f for f, on in (("--gpu", args.gpu is not None), ("--gpu-mem", args.gpu_mem is not None),
                                    ("--fit", args.fit)) if on]
    if args.no_memory and memory_flags:  # each was ignored in silence
        acts = "acts" if len(memory_flags) == 1 else "act"
        raise SinkflowError(f"{' / '.join(memory_flags)} {acts} on the memory estimate, which --no-memory skips",
                            f"drop --no-memory, or {' and '.join(memory_flags)}")
    if args.all and preset_given(args):
        raise SinkflowError(f"--all checks every preset, so the preset '{args.preset}' beside it would be ignored",
                            f"drop '{args.preset}' or --all")


def run_folder(args) -> Path | None:
    """The run folder preflight was pointed at (``sinkflow preflight RUN --gpu T4``: do the phases a resume still
    runs fit a smaller card?), or None for a preset / config file. Its own ``config.yaml`` is planned, as ``train
    --resume`` would run it: a key or shorthand beside it is refused in one line (``--device`` too: preflight runs
    on the CPU), since it would be dropped. Until 2026-12-01 a run folder failed "config resolves" as an unknown
    preset, and its ``config.yaml``, the way out it named, planned the finished phases too and printed a ``sinkflow
    train RUN/config.yaml`` that train refuses (the folder exists)."""
    if not preset_given(args) or not Path(str(args.preset)).is_dir():
        return None
    run_dir = Path(str(args.preset))
    refuse_plain_folder(run_dir, "preflight")
    if not (run_dir / "config.yaml").is_file():  # a run that lost it (refuse_plain_folder let meta.json pass)
        raise config.lost_run_config(run_dir)
    given = [*args.overrides, *(f"--{k.replace('_', '-')}" for k, v in shorthands(args).items() if v is not None)]
    if given:
        raise SinkflowError(f"`sinkflow preflight RUN` plans the run's own config.yaml; {given[0]} would be ignored",
                            "drop it (a fit's changes are printed as a `sinkflow train --resume RUN key=value`), "
                            f"or check a new config: `sinkflow preflight PRESET {given[0]} ...`")
    return run_dir


def run(args):
    check_args(args)
    from sinkflow.tools.cards import gpu_bytes

    card = None
    if args.gpu is not None or args.gpu_mem is not None:
        card = gpu_bytes(args.gpu, args.gpu_mem)  # a misspelt card: one line before torch loads
    split_preset(args)
    run_dir = run_folder(args)
    presets = config.preset_names() if args.all else [str(run_dir / "config.yaml") if run_dir else args.preset]
    results = {}
    for preset in presets:
        results[preset] = _one(preset, args, card, run_dir)
        print()
    if len(presets) > 1:
        print("preflight --all: " + ", ".join(f"{p} {'OK' if ok else 'FAILED'}" for p, ok in results.items()))
    return 0 if all(results.values()) else 1
