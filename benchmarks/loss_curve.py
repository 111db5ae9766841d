"""Does the fast default train what fp32 trains? The loss curve of a fixed-seed run against fp32's seed spread.

Issue 23 asks that the `mnist` preset's default config (on CUDA: bf16 autocast + CUDA graphs) reach the speed
target "with the loss curve of a fixed-seed 2,000-step run matching fp32's within its seed spread". This runs the
preset's first UNet phase (cut to ``--steps``; the other phases too, as a run would, but only the first is read)
with fp32 eager NCHW for ``--seeds`` training seeds (the spread: each seed draws its own init and batches) and
with the default config for seed 0, and prints the mean training loss of every ``--log-every`` steps: the fp32
band (min..max over seeds), the default's value, and whether it lies inside the band widened by half its width.

    python benchmarks/loss_curve.py                           # GPU: mnist, FM, 2000 steps, 3 fp32 seeds
    python benchmarks/loss_curve.py --reference graphs        # the fp32 band with CUDA graphs: one device call
    python benchmarks/loss_curve.py --smoke                   # CPU: tiny UNet on synthetic digits
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

from sinkflow import config
from sinkflow.cli.bench import run_cut
from sinkflow.runtime.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from preset_throughput import SMOKE_MODEL, UNET_PHASES  # noqa: E402
from results_md import machine  # noqa: E402

FP32 = {"eager": ["precision=fp32", "channels_last=false", "compile=false", "graph=none"],
        # fp32 with CUDA graphs: the same arithmetic as eager (timed-window loss equal to four decimals on an H100,
        # docs/gpu_results/h100_2026-11-26.md) at 2.5x the speed, for a band that fits one device call
        "graphs": ["precision=fp32", "channels_last=false", "compile=true", "compile_mode=reduce-overhead",
                   "graph=none"]}


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mnist")
    ap.add_argument("--method", default="fm", help="fm: the preset's UNet on the data alone (no pool to build)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="default 2000 (smoke 12)")
    ap.add_argument("--log-every", type=int, default=None, help="default 100 (smoke 4)")
    ap.add_argument("--seeds", type=int, default=3, help="fp32 training seeds for the band (smoke 2)")
    ap.add_argument("--reference", choices=list(FP32), default="eager", help="how the fp32 band is trained")
    ap.add_argument("--smoke", action="store_true", help="tiny UNet on synthetic digits, batch 8 (CPU check)")
    args = ap.parse_args(argv)
    steps, every = args.steps or (12 if args.smoke else 2000), args.log_every or (4 if args.smoke else 100)
    seeds = 2 if args.smoke and args.seeds == 3 else args.seeds
    base = [f"experiment.device={args.device}", "pool.batches=4"]
    ctx = contextlib.nullcontext()
    if args.smoke:
        from sinkflow.tools.data import real_or_synthetic

        base += [*SMOKE_MODEL, "train.velocity.batch_size=8", "train.nsf.batch_size=8"]
        ctx = real_or_synthetic(config.resolve(args.preset), force=True)
    with ctx:
        reference = [curve(args.preset, args.method, s, FP32[args.reference], base, steps, every) for s in range(seeds)]
        default = curve(args.preset, args.method, 0, [], base, steps, every)
    rows = compare(reference, default)
    print(f"loss_curve: {args.preset} --method {args.method}, {steps} steps, mean loss per {every} steps; fp32 "
          f"{args.reference} NCHW over seeds 0-{seeds - 1} vs the default config (seed 0), on {machine(args.device)}")
    print(f"{'step':>6} {'fp32 min':>9} {'fp32 max':>9} {'default':>9}  inside")
    for r in rows:
        print(f"{r['step']:>6} {r['lo']:>9.4f} {r['hi']:>9.4f} {r['loss']:>9.4f}  {'yes' if r['inside'] else 'NO'}")
    inside = sum(r["inside"] for r in rows)
    print(f"inside the fp32 band (widened by half its width): {inside} of {len(rows)} log steps")


if __name__ == "__main__":
    main()
