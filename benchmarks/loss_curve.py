"""Does the fast default train what fp32 trains? The loss curve of a fixed-seed run against fp32's seed spread.

Issue 23 asks that the `mnist` preset's default config (on CUDA: bf16 autocast + the step graph) reach the speed
target "with the loss curve of a fixed-seed 2,000-step run matching fp32's within its seed spread". This runs the
preset's first UNet phase (cut to ``--steps``; the other phases too, as a run would, but only the first is read)
with fp32 NCHW for ``--seeds`` training seeds (the spread: each seed draws its own init and batches) and each of
``--candidates`` (the default config; bf16 or fp16 one key away) for seeds 0..``--candidate-seeds``-1, and prints
the mean training loss of every ``--log-every`` steps: the fp32 band (min..max over seeds), each candidate's seed-0
value, and whether it lies inside the band widened by half its width. Then the paired view: a candidate at seed s
sees fp32 seed s's init and batches, so (candidate - fp32) at the same seed is what the arithmetic alone moves,
printed beside fp32's seed-to-seed spread (both on the mean of the last 5 log steps).

    python benchmarks/loss_curve.py                           # GPU: mnist, FM, 2000 steps, 3 fp32 seeds
    python benchmarks/loss_curve.py --reference graphs        # the fp32 band with CUDA graphs: one device call
    python benchmarks/loss_curve.py --reference step --seeds 5 --candidates default fp16 --candidate-seeds 3
    python benchmarks/loss_curve.py --smoke                   # CPU: tiny UNet on synthetic digits
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from sinkflow import config
from sinkflow.tools.bench import run_cut
from sinkflow.runtime.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from preset_throughput import SMOKE_MODEL, UNET_PHASES  # noqa: E402
from _args import checked_device, one_line_errors, positive_int  # noqa: E402
from results_md import machine  # noqa: E402

FP32 = {"eager": ["precision=fp32", "channels_last=false", "compile=false", "graph=none"],
        # fp32 with CUDA graphs: the same arithmetic as eager (timed-window loss equal to four decimals on an H100,
        # docs/gpu_results/h100_2026-11-26.md) at 2.5x the speed, for a band that fits one device call
        "graphs": ["precision=fp32", "channels_last=false", "compile=true", "compile_mode=reduce-overhead",
                   "graph=none"],
        # fp32 with the whole step one CUDA graph (the default's own path, fp32 arithmetic)
        "step": ["precision=fp32", "channels_last=false", "graph=step"]}
# the configs a band can judge: the default (on an H100 fp16 + the step graph since 2026-11-27, bf16 before) and
# the precisions one key away
CANDIDATES = {"default": [], "bf16": ["precision=bf16"], "fp16": ["precision=fp16"]}
LATE = 5  # the paired summary averages the last LATE log steps (steps 1,600-2,000 of the default 2,000)


class LossLog(Callback):
    """(step, mean loss since the last log) of the first UNet phase, from the Trainer's own log steps."""

    def __init__(self):
        self.points: list[tuple[int, float]] = []
        self.phase: str | None = None

    def on_log(self, trainer, metrics: dict) -> None:
        if trainer.name in UNET_PHASES and self.phase in (None, trainer.name):
            self.phase = trainer.name
            self.points.append((trainer.step, float(metrics["loss"])))


def curve(preset: str, method: str, seed: int, setting: list[str], base: list[str], steps: int,
          log_every: int) -> list[tuple[int, float]]:
    cfg = config.resolve(preset, [f"experiment.method={method}", f"experiment.seed={seed}", *base], unread="ignore")
    cfg = config.apply_overrides(cfg, [f"train.{p}.{kv}" for p in cfg["train"] if p in UNET_PHASES for kv in setting])
    log = LossLog()
    run_cut(cfg, steps, [log], log_every)
    return log.points


def compare(reference: list[list[tuple[int, float]]], candidate: list[tuple[int, float]]) -> list[dict]:
    """Per log step: the reference band over seeds, the candidate's loss, and whether it is inside the band
    widened by half its width on each side (a band of 2-3 seeds understates the spread)."""
    rows = []
    for i, (step, loss) in enumerate(candidate):
        values = [r[i][1] for r in reference]
        lo, hi = min(values), max(values)
        pad = (hi - lo) / 2
        rows.append({"step": step, "lo": lo, "hi": hi, "loss": loss, "inside": lo - pad <= loss <= hi + pad})
    return rows


def late_mean(points: list[tuple[int, float]], late: int = LATE) -> float:
    return statistics.fmean(loss for _, loss in points[-late:])


def paired(reference: list[list[tuple[int, float]]], candidate: dict[int, list[tuple[int, float]]],
           late: int = LATE) -> dict:
    """The candidate's shift against fp32 at the same seeds (same init draw, same batches: only the arithmetic
    differs) beside fp32's own seed-to-seed spread, both on the mean loss of the last ``late`` log steps.
    ``candidate`` maps a seed to its run."""
    ref = [late_mean(r, late) for r in reference]
    diffs = [late_mean(points, late) - ref[seed] for seed, points in sorted(candidate.items())]
    return {"diffs": diffs, "mean_diff": statistics.fmean(diffs), "ref_mean": statistics.fmean(ref),
            "ref_sd": statistics.stdev(ref) if len(ref) > 1 else float("nan"), "ref_range": max(ref) - min(ref)}


def report(records: list[dict], preset: str, method: str, where: str) -> None:
    """The band table (each candidate's lowest seed against fp32's seeds), the paired view and the timings of the
    runs in ``records`` ({"name", "seed", "seconds", "points", "setting", "machine"} each; fp32's are the band)."""
    by_seed: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for r in records:
        by_seed.setdefault(r["name"], {})[r["seed"]] = [tuple(p) for p in r["points"]]
    seeds = len(by_seed.get("fp32", {}))
    if not seeds or sorted(by_seed["fp32"]) != list(range(seeds)):
        raise SystemExit(f"the fp32 runs are seeds {sorted(by_seed.get('fp32', {}))}: the band needs seeds 0..N-1")
    reference = [by_seed["fp32"][s] for s in range(seeds)]
    runs = {name: {s: v for s, v in runs.items() if s < seeds} for name, runs in by_seed.items() if name != "fp32"}
    steps, every = reference[0][-1][0], reference[0][0][0]
    fp32 = next(r for r in records if r["name"] == "fp32")
    shown = {name: min(r) for name, r in runs.items()}
    print(f"loss_curve: {preset} --method {method}, {steps} steps, mean loss per {every} steps; fp32 "
          f"({' '.join(fp32.get('setting', []))}) over seeds 0-{seeds - 1} vs "
          f"{', '.join(f'{n} (seed {s} in the table)' for n, s in shown.items())}, {where}, "
          f"on {fp32.get('machine', '?')}")
    tables = {name: compare(reference, runs[name][seed]) for name, seed in shown.items()}
    print(f"{'step':>6} {'fp32 min':>9} {'fp32 max':>9} " + " ".join(f"{c:>9}  inside" for c in tables))
    for i, r in enumerate(next(iter(tables.values()))):
        cells = " ".join(f"{t[i]['loss']:>9.4f}  {'yes' if t[i]['inside'] else 'NO':>6}" for t in tables.values())
        print(f"{r['step']:>6} {r['lo']:>9.4f} {r['hi']:>9.4f} {cells}")
    for c, t in tables.items():
        print(f"{c}: inside the fp32 band (widened by half its width): {sum(r['inside'] for r in t)} of {len(t)} "
              f"log steps")
    late = min(LATE, len(reference[0]))
    print(f"paired, mean loss of the last {late} log steps (steps {reference[0][-late][0]}-{reference[0][-1][0]}), "
          f"candidate minus fp32 at the same seed:")
    for c, r in runs.items():
        p = paired(reference, r, late)
        print(f"{c}: per seed {' '.join(f'{d:+.5f}' for d in p['diffs'])}, mean {p['mean_diff']:+.5f}; fp32 over "
              f"{seeds} seeds {p['ref_mean']:.5f}, sd {p['ref_sd']:.5f}, range {p['ref_range']:.5f}")
    seconds = {}
    for r in records:
        seconds.setdefault(r["name"], []).append(r["seconds"])
    print("seconds per run (compile and capture included): " + ", ".join(
        f"{name} {statistics.fmean(v):.0f}" for name, v in seconds.items()))


@one_line_errors
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mnist")
    ap.add_argument("--method", default="fm", help="fm: the preset's UNet on the data alone (no pool to build)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=positive_int, default=None, help="default 2000 (smoke 12)")
    ap.add_argument("--log-every", type=positive_int, default=None, help="default 100 (smoke 4)")
    ap.add_argument("--seeds", type=int, default=3, help="fp32 training seeds for the band (smoke 2)")
    ap.add_argument("--reference", choices=list(FP32), default="eager", help="how the fp32 band is trained")
    ap.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=["default"],
                    help="the configs judged against the band (default: the default config)")
    ap.add_argument("--candidate-seeds", type=int, default=1,
                    help="seeds 0..N-1 of each candidate, each paired with fp32's run at the same seed")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="start at this seed (a second device call goes on where the first stopped: --save, --load)")
    ap.add_argument("--save", metavar="FILE", help="append each run's curve to FILE as it ends (JSON lines)")
    ap.add_argument("--load", nargs="+", metavar="FILE",
                    help="train nothing: judge the runs saved in these files (e.g. two device calls' runs together)")
    ap.add_argument("--smoke", action="store_true", help="tiny UNet on synthetic digits, batch 8 (CPU check)")
    args = ap.parse_args(argv)
    checked_device(args.device, ap.error)
    steps = args.steps if args.steps is not None else (12 if args.smoke else 2000)
    every = args.log_every if args.log_every is not None else (4 if args.smoke else 100)
    seeds = 2 if args.smoke and args.seeds == 3 else args.seeds
    if args.candidate_seeds > seeds:
        ap.error(f"--candidate-seeds {args.candidate_seeds} > --seeds {seeds}: each candidate seed is paired with "
                 f"fp32's run at that seed; raise --seeds")
    base = [f"experiment.device={args.device}", "pool.batches=4"]
    ctx = contextlib.nullcontext()
    if args.smoke:
        from sinkflow.tools.data import real_or_synthetic

        base += [*SMOKE_MODEL, "train.velocity.batch_size=8", "train.nsf.batch_size=8"]
        ctx = real_or_synthetic(config.resolve(args.preset), force=True)
    records = []  # {"name", "seed", "seconds", "points"} per run

    def timed(name: str, seed: int, setting: list[str]) -> None:
        start = time.perf_counter()
        points = curve(args.preset, args.method, seed, setting, base, steps, every)
        records.append({"name": name, "seed": seed, "seconds": time.perf_counter() - start, "points": points,
                        "setting": setting, "machine": machine(args.device)})
        # each run's curve as it ends: a device call cut short by its time limit keeps the runs it finished
        print(f"run {name} seed {seed} ({records[-1]['seconds']:.0f} s): " + " ".join(f"{v:.4f}" for _, v in points),
              flush=True)
        if args.save:
            with open(args.save, "a") as f:
                f.write(json.dumps(records[-1]) + "\n")

    if args.load:
        records = [json.loads(line) for path in args.load for line in Path(path).read_text().splitlines() if line]
        report(records, args.preset, args.method, f"runs of {', '.join(args.load)}")
        return
    with ctx:  # seed by seed, so a cut-short call still holds pairs
        for s in range(args.first_seed, seeds):
            timed("fp32", s, FP32[args.reference])
            for c in args.candidates if s < args.candidate_seeds else ():
                timed(c, s, CANDIDATES[c])
    if not args.first_seed:  # otherwise the runs are saved; --load judges them with the earlier seeds'
        report(records, args.preset, args.method, "one process")

if __name__ == "__main__":
    main()
