"""Test bits/dim of the flow-digits preset on CPU, through the runner, beside reference points.

Trains ``sinkflow train flow-digits`` (or the preset named) in each memory mode asked for, then measures
test bits/dim on the whole held-out split (3 dequantisation draws) at every step checkpoint, so the table
shows where the held-out likelihood is best, not just the last step. Context rows: the uniform density
(log2 of the number of levels) and an independent-pixel categorical model (per-pixel level histograms of
the training split, add-one smoothed): a flow that models pixel correlations should beat it. Published
MNIST / CIFAR-10 figures are printed for orientation only (other data, other budgets); MNIST cannot be
measured here (no download) and this benchmark does not pretend to.

Niced and single-threaded by default (the machine is shared):
    python benchmarks/flow_bpd.py --modes standard invertible --json benchmarks/flow_bpd.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

PUBLISHED = [  # literature values; see docs/flows.md for their provenance
    ("MNIST", "RealNVP, as tabulated by FFJORD (Grathwohl et al. 2019)", 1.06),
    ("MNIST", "Glow, as tabulated by FFJORD (Grathwohl et al. 2019)", 1.05),
    ("CIFAR-10", "RealNVP (Dinh et al. 2017)", 3.49),
    ("CIFAR-10", "Glow (Kingma & Dhariwal 2018)", 3.35),
]


def independent_pixel_bpd(target, n_bins: int) -> float:
    """Test bits/dim of a per-pixel categorical model fitted to the training split (add-one smoothing)."""
    import numpy as np

    def levels(arr):
        x = np.asarray(arr, np.float64).reshape(len(arr), -1)
        return np.rint(x * (n_bins - 1) / 255).astype(int) if 256 % n_bins else (x.astype(int) * n_bins // 256)

    train, test = levels(target.images), levels(target.test_images)
    counts = np.stack([np.bincount(train[:, j], minlength=n_bins) for j in range(train.shape[1])]) + 1.0
    probs = counts / counts.sum(1, keepdims=True)
    return float(-np.mean(np.log2(probs[np.arange(train.shape[1])[None, :], test])))


def checkpoint_bpd(run, path, levels, n_bins: int, seeds: int = 3) -> tuple[float, float]:
    import statistics

    import torch

    from sinkflow.flows import flow_loss
    from sinkflow.runner.phase import build_phase_model, phase_generator

    state = torch.load(path, weights_only=False)
    model = build_phase_model(run, "flow")
    model.load_state_dict(state.get("ema") or state["model"])
    model.eval().requires_grad_(False)
    values = []
    with torch.no_grad():
        for s in range(seeds):
            gen = phase_generator(s, "dequantize-test")
            total = sum(float(flow_loss(model, chunk, gen, n_bins)[1]) * len(chunk) for chunk in levels.split(256))
            values.append(total / len(levels))
    return statistics.fmean(values), statistics.stdev(values)


def train_and_measure(preset: str, mode: str, runs_dir: Path, iters: int | None, ckpt_every: int) -> dict:
    from sinkflow import methods
    from sinkflow.cli import main
    from sinkflow.methods.flow import pixel_levels
    from sinkflow.models import count_parameters
    from sinkflow.runner.run import Run

    name = f"{preset}-{mode}"
    args = ["train", preset, f"model.flow.memory={mode}", f"experiment.runs_dir={runs_dir}", "--name", name,
            "--device", "cpu", f"train.flow.ckpt_every={ckpt_every}", "checkpoint.keep=1000", "--no-report"]
    if iters:
        args += ["--train-iters", str(iters)]
    start = time.perf_counter()
    if main(args) != 0:
        raise SystemExit(f"training {name} failed")
    wall = time.perf_counter() - start
    run = Run.open(runs_dir / name)
    cfg = run.cfg
    n_bins = cfg["model"]["flow"]["n_bins"]
    _, target = methods.distributions(cfg)
    levels = pixel_levels(target.test_set(len(target.test_images)), n_bins)
    ckpts = sorted((run.dir / "checkpoints/flow").glob("step_*.pt"))
    curve = []
    for path in ckpts:
        step = int(path.stem.split("_")[1])
        mean, std = checkpoint_bpd(run, path, levels, n_bins)
        curve.append({"step": step, "test_bpd": mean, "test_bpd_std": std})
    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    train_bpd = [r["loss"] for r in records if r.get("phase") == "flow" and "loss" in r]
    drift = [r for r in records if r.get("final")][-1]
    best = min(curve, key=lambda r: r["test_bpd"])
    return {"preset": preset, "mode": mode, "iters": cfg["train"]["flow"]["iters"],
            "batch_size": cfg["train"]["flow"]["batch_size"], "n_bins": n_bins,
            "params": count_parameters(run.model("flow")), "wall_s": wall, "train_bpd_last": train_bpd[-1],
            "final": curve[-1], "best": best, "curve": curve, "fallen_back": drift["fallen_back"],
            "n_test": len(levels), "independent_pixel_bpd": independent_pixel_bpd(target, n_bins),
            "uniform_bpd": math.log2(n_bins)}


def table(results: list[dict]) -> str:
    r0 = results[0]
    lines = [f"| run | params | steps (batch) | CPU wall | train bits/dim (last log window) | test bits/dim, final step | "
             f"best test bits/dim (step) | drift fallbacks |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['preset']}, memory {r['mode']} | {r['params'] / 1e3:.0f}k | {r['iters']} ({r['batch_size']}) | "
                     f"{r['wall_s'] / 60:.1f} min | {r['train_bpd_last']:.3f} | {r['final']['test_bpd']:.3f} "
                     f"+- {r['final']['test_bpd_std']:.3f} | {r['best']['test_bpd']:.3f} ({r['best']['step']}) | "
                     f"{int(r['fallen_back'])} |")
    lines += ["", f"Context on the same {r0['n_test']} held-out images, {r0['n_bins']} levels: uniform density "
                  f"{r0['uniform_bpd']:.3f}; independent-pixel categorical (train-split histograms, add-one) "
                  f"{r0['independent_pixel_bpd']:.3f} bits/dim.", "",
              "Published test bits/dim (other data sets, for orientation only): "
              + "; ".join(f"{d} {name}: {v:.2f}" for d, name, v in PUBLISHED) + "."]
    return "\n".join(lines)


def main_cli() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="flow-digits")
    p.add_argument("--modes", nargs="+", default=["standard"], choices=["standard", "checkpoint", "invertible"])
    p.add_argument("--iters", type=int, help="training steps (default: the preset's)")
    p.add_argument("--ckpt-every", type=int, default=250, help="steps between the checkpoints that are evaluated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs-dir", help="keep the runs here (default: a temporary folder)")
    p.add_argument("--json", help="also write the results as JSON")
    args = p.parse_args()
    os.nice(10)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("SINKFLOW_PROGRESS", "0")
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = Path(args.runs_dir or tmp)
        results = [train_and_measure(args.preset, m, runs_dir, args.iters, args.ckpt_every) for m in args.modes]
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs visible, "
            f"{args.threads} torch thread(s), niced", "torch": torch.__version__,
            "command": "python " + " ".join(sys.argv)}
    print(table(results))
    print(f"\n{meta['command']}  ({meta['date']}, {meta['machine']}, torch {meta['torch']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main_cli()
