"""`sinkflow bench --profile PRESET [overrides]`: is each training phase data-bound or compute-bound?

Runs every phase of the experiment in a throw-away run folder, with each training phase cut to
``--steps`` optimizer steps, and times each step in two parts (a ``StepTimer`` callback of the engine): the
data part (from the end of one step to the start of the next: batch creation, gathers, host-to-device
copies) and the compute part (forward, backward, optimizer, EMA; the device is synchronised at the end so
queued kernels are counted). The
pool is built small (``pool.batches`` cut to 4; with ``--throughput`` to two of its chunks, the second solved in the
real run's groups, so that the last line can project the whole pool) unless ``--pool-batches`` says otherwise.
``--throughput`` ends with the run's own budget at the measured rates (``tools.bench.projected_run``).
"""

from __future__ import annotations

import sys

from sinkflow import config
from sinkflow.cli.common import add_config_args, resolve_args
from sinkflow.config import schema
from sinkflow.config.schema import IMAGE_TARGETS, MAX_EULER_STEPS
from sinkflow.errors import SinkflowError


def add_parser(sub):
    p = sub.add_parser("bench", help="profile training steps (data wait vs compute) or measure throughput",
                       description="Run N steps of every training phase and report the fraction of step time spent "
                                   "waiting for data (batch creation + host-to-device copy) versus compute.",
                       epilog="examples: sinkflow bench mnist --throughput (steps/s, images/s, busy share, share of "
                              "the card's peak per phase); sinkflow bench moons --profile")
    add_config_args(p)
    mode = p.add_mutually_exclusive_group()  # one measurement per call: each is its own set of timed steps
    mode.add_argument("--profile", action="store_true", help="split each step into data wait and compute, with a "
                      "device sync per step (the default)")
    mode.add_argument("--throughput", action="store_true", help="steps/s, samples/s, data wait, device busy and "
                      "the fraction of the device's peak FLOP/s per phase, with no per-step sync")
    p.add_argument("--steps", type=int, default=30, help="timed steps per training phase (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocation, compile; default 5)")
    p.set_defaults(func=run)


def run(args):
    if args.steps < 1 or not 0 <= args.warmup <= MAX_EULER_STEPS:  # a typo'd 10^12 warm-up ran for ever
        raise SinkflowError(f"--steps {args.steps} --warmup {args.warmup} is not a valid budget",
                            f"use --steps >= 1 and --warmup from 0 to {MAX_EULER_STEPS:,}")
    from sinkflow import data, methods
    from sinkflow.tools.bench import format_table, profile, throughput

    unused = (["--name"] if getattr(args, "name", None) else []) + [
        o.split("=")[0] for o in args.overrides if o.startswith(("experiment.name=", "experiment.runs_dir="))]
    if unused:  # they were dropped without a word: a user looked for a run folder bench never kept
        print(f"note: {' and '.join(unused)} not used: bench trains in a scratch folder it deletes (its numbers are "
              "printed here, nothing is saved)", file=sys.stderr)
    pool_set = args.pool_batches is not None or any(o.startswith("pool.batches=") for o in args.overrides)
    cfg = full = resolve_args(args)
    if not pool_set:  # --throughput: two chunks, the second solved as the real run solves its chunks
        keep = 2 * max(1, cfg["pool"]["chunk"]) if args.throughput else 4
        cfg = config.apply_overrides(cfg, [f"pool.batches={min(cfg['pool']['batches'], keep)}"])
    data.distributions(cfg)  # validate the data before any work
    name = f"{cfg['experiment']['preset']} ({methods.of(cfg).name})"
    if args.throughput:
        from sinkflow.tools.bench import PhaseClock, projected_run
        from sinkflow.tools.throughput import format_rows

        clock = PhaseClock()
        rows = throughput(cfg, args.steps, args.warmup, callbacks=[clock])
        device = rows[0]["device"] if rows else cfg["experiment"]["device"]
        print(f"sinkflow bench --throughput {name} on {device}: {args.steps} steps per phase after {args.warmup} "
              f"warm-up, synchronised only at both ends; wait = between steps (data, callbacks); busy = kernels "
              f"running (CUDA); % peak = model FLOP/s over this device's measured matrix-product peak")
        print(format_rows(rows))
        print(projected_run(rows, full, cfg, clock))
        return 0
    rows = profile(cfg, args.steps, args.warmup)
    device = rows[0]["device"] if rows else cfg["experiment"]["device"]
    print(f"sinkflow bench --profile {name} on {device}: "
          f"data = batch creation + host-to-device copy between steps; compute = forward/backward/optimizer")
    print(format_table(rows))
    phases = schema.METHOD_PHASES[methods.of(cfg).name]  # what the run trains, not the method's name: a new one too
    # only levers the run can still pull: pool.storage=memory was advised to pools already in RAM (the default), and
    # "keep the image cache in RAM" named no key (the cache is a memmap in data.root, read through the page cache)
    on_disk = "pool" in phases and cfg["pool"]["storage"] == "disk"
    levers = (["set pool.storage=memory (the pool in RAM, not memory-mapped)"] if on_disk else []) + \
        (["put data.root on a local disk (the image cache is memory-mapped from it)"]
         if cfg["data"]["target"] in IMAGE_TARGETS else []) + ["use fewer but larger batches"]
    invertible = "flow" in phases and cfg["model"]["flow"].get("memory") == "invertible"
    # keys a user can paste: `train.*.precision=bf16` was advised, which no override reads (a shorthand does)
    compiles = " ".join(f"{k}=true" for k in schema.used(cfg) if k.startswith("train.") and k.endswith(".compile"))
    half = ("a flow in model.flow.memory=invertible trains in fp32 (its inverse recomputes the activations, which "
            "half precision would not reproduce): model.flow.memory=checkpoint can try train.flow.precision=bf16, "
            f"and {compiles}" if invertible else  # the advice named bf16, which that mode refuses
            f"other networks can try --precision bf16 (every training phase), {compiles}")
    print(f"data-bound (> 30 % waiting): {', '.join(levers[:-1]) + ', or ' if len(levers) > 1 else ''}{levers[-1]}"
          "; compute-bound: a UNet on CUDA already runs fp16 with the whole step one CUDA "
          f"graph (the phase's first line says what ran); {half}")
    return 0
