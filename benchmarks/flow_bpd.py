"""Held-out bits/dim of the flow-digits preset on CPU, through the runner, beside baseline densities.

Trains ``sinkflow train flow-digits`` (or the preset named) in each memory mode asked for, keeping a
checkpoint every ``--ckpt-every`` steps. Model selection reads the *validation* split only
(``data.val_fraction``, carved from the train split with a fixed seed): validation bits/dim of every
checkpoint and of the final weights, over 3 dequantisation draws, picks the step. Test bits/dim is then
measured once, at that checkpoint, on the whole test split.

Baselines in the same table, fitted to the same training images the flow sees (train minus validation) and
scored with the same dequantisation on the same test images (``sinkflow.flows.baselines``): the uniform
density, an independent-pixel categorical (add-one smoothed histograms) and a full-covariance Gaussian fitted
to the dequantised training data in closed form. Published MNIST / CIFAR-10 figures are printed for
orientation only (other data, other budgets); MNIST cannot be measured here (no download).

``--samples FILE.png``: one PNG of samples from the selected checkpoint at temperatures 1.0 / 0.8 / 0.6
(the same prior noise in each panel).

Niced and single-threaded by default (the machine is shared):
    python benchmarks/flow_bpd.py --modes standard invertible --json benchmarks/flow_bpd.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402

PUBLISHED = [  # literature values; see docs/flows.md for their provenance
    ("MNIST", "RealNVP, as tabulated by FFJORD (Grathwohl et al. 2019)", 1.06),
    ("MNIST", "Glow, as tabulated by FFJORD (Grathwohl et al. 2019)", 1.05),
    ("CIFAR-10", "RealNVP (Dinh et al. 2017)", 3.49),
    ("CIFAR-10", "Glow (Kingma & Dhariwal 2018)", 3.35),
]


def level_array(images, n_bins: int):
    """uint8 data-layer images (k * 255 / 16 for digits, k for 8-bit) -> integer levels, as the flow sees them."""
    import numpy as np
    import torch

    from sinkflow.flows import to_levels
    from sinkflow.methods.normalizing_flow import pixel_levels

    x = torch.from_numpy(np.array(images)).float() * (2 / 255) - 1
    return to_levels(pixel_levels(x, n_bins), n_bins).reshape(len(x), -1).numpy()


def checkpoint_bpd(run, path, images, seeds: int = 3) -> tuple[float, float]:
    import torch

    from sinkflow.methods.normalizing_flow import test_bpd
    from sinkflow.data import sample_shape
    from sinkflow.runtime.run_folder import build_phase_model

    from sinkflow.runtime.checkpoint import load

    state = load(path)  # weights only: a checkpoint never runs code
    model = build_phase_model(run.cfg, "flow", sample_shape(run.cfg))
    model.load_state_dict(state.get("ema") or state["model"])
    model.eval().requires_grad_(False)
    r = test_bpd(run, n=len(images), seeds=seeds, batch=256, model=model)
    return r["bpd"], r["bpd_std"]


def temperature_grid(run, path, out, temps=(1.0, 0.8, 0.6), n: int = 64) -> Path:
    """One PNG: ``n`` samples per temperature side by side, the same prior noise in every panel."""
    import torch
    from torchvision.utils import make_grid, save_image

    from sinkflow.flows import postprocess
    from sinkflow.methods.normalizing_flow import decode
    from sinkflow.data import sample_shape
    from sinkflow.runtime.run_folder import build_phase_model

    from sinkflow.runtime.checkpoint import load

    state = load(path)  # weights only: a checkpoint never runs code
    model = build_phase_model(run.cfg, "flow", sample_shape(run.cfg))
    model.load_state_dict(state.get("ema") or state["model"])
    model.eval().requires_grad_(False)
    eps = torch.randn((n, *model.in_shape), generator=torch.Generator().manual_seed(7))
    panels = []
    for t in temps:
        x = postprocess(decode(model, eps, t), run.cfg["model"]["flow"]["n_bins"])
        x = torch.nn.functional.interpolate(x, scale_factor=4, mode="nearest")
        panels.append(make_grid(x, nrow=8, padding=2, pad_value=1.0))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_image(make_grid(torch.stack(panels), nrow=len(panels), padding=8, pad_value=1.0), out)
    return Path(out)


def candidates(run) -> list[Path]:
    """The checkpoints model selection compares: every step checkpoint and the final weights (final.pt, labelled
    with its step), unless a step checkpoint holds that step already. Without final.pt, a run shorter than
    --ckpt-every had nothing to select from and the steps after the last checkpoint were never a candidate."""
    from sinkflow.runtime.checkpoint import load

    ckpts = run.checkpoints("flow")
    steps = ckpts.steps()
    final_step = int(load(ckpts.final_path).get("step", -1))
    return [p for _, p in steps] + ([ckpts.final_path] if final_step not in {s for s, _ in steps} else [])


def train_and_measure(preset: str, mode: str, runs_dir: Path, iters: int | None, ckpt_every: int,
                      overrides: list[str], samples: str | None = None) -> dict:
    from sinkflow import methods
    from sinkflow.cli import main
    from sinkflow.flows.baselines import baselines
    from sinkflow.methods.normalizing_flow import select_checkpoint
    from sinkflow.models import count_parameters
    from sinkflow.runtime.run_folder import RunFolder

    name = f"{preset}-{mode}"
    args = ["train", preset, f"model.flow.memory={mode}", f"experiment.runs_dir={runs_dir}", "--name", name,
            "--device", "cpu", f"train.flow.ckpt_every={ckpt_every}", "checkpoint.keep=1000", "--no-report", *overrides]
    if iters:
        args += ["--train-iters", str(iters)]
    start = time.perf_counter()
    if main(args) != 0:
        raise SystemExit(f"training {name} failed")
    wall = time.perf_counter() - start
    run = RunFolder.open(runs_dir / name)
    cfg = run.cfg
    n_bins = cfg["model"]["flow"]["n_bins"]
    _, target = methods.distributions(cfg)
    best_path, val_curve = select_checkpoint(run, candidates(run), seeds=3)  # validation only
    best = next(r for r in val_curve if r["path"] == str(best_path))
    test_mean, test_std = checkpoint_bpd(run, best_path, target.test_images)  # test, once
    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    train_bpd = [r["loss"] for r in records if r.get("phase") == "flow" and "loss" in r]
    drift = [r for r in records if r.get("final")][-1]
    fit, test = level_array(target.fit_images(), n_bins), level_array(target.test_images, n_bins)
    val = level_array(target.images[target.val_index.numpy()], n_bins)
    out = {"preset": preset, "mode": mode, "iters": cfg["train"]["flow"]["iters"],
           "batch_size": cfg["train"]["flow"]["batch_size"], "n_bins": n_bins,
           "params": count_parameters(run.model("flow")), "wall_s": wall, "train_bpd_last": train_bpd[-1],
           "val_curve": [{k: v for k, v in r.items() if k != "path"} for r in val_curve],
           "selected_step": best["step"], "val_bpd": best["val_bpd"], "test_bpd": test_mean,
           "test_bpd_std": test_std, "fallen_back": drift["fallen_back"], "n_fit": len(fit), "n_val": len(val),
           "n_test": len(test), "baselines_test": baselines(fit, test, n_bins),
           "baselines_val": baselines(fit, val, n_bins)}
    if samples:
        out["samples"] = str(temperature_grid(run, best_path, samples))
    return out


def table(results: list[dict]) -> str:
    r0 = results[0]
    lines = ["| model | params | steps (batch) | CPU wall | train bits/dim (last log window) | "
             "validation bits/dim (selected step) | test bits/dim | drift fallbacks |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['preset']}, memory {r['mode']} | {r['params'] / 1e3:.0f}k | {r['iters']} ({r['batch_size']}) | "
                     f"{r['wall_s'] / 60:.1f} min | {r['train_bpd_last']:.3f} | {r['val_bpd']:.3f} ({r['selected_step']}) | "
                     f"**{r['test_bpd']:.3f}** +- {r['test_bpd_std']:.3f} | {int(r['fallen_back'])} |")
    names = {"uniform": "uniform density", "independent_pixel": "independent-pixel categorical (add-one histograms)",
             "gaussian": "full-covariance Gaussian (closed form, dequantised)"}
    for key, name in names.items():
        lines.append(f"| {name} | | fitted to {r0['n_fit']} images | | | {r0['baselines_val'][key]:.3f} | "
                     f"**{r0['baselines_test'][key]:.3f}** | |")
    best = min(r0["baselines_test"].values())
    lines += ["", f"{r0['n_fit']} fitting / {r0['n_val']} validation / {r0['n_test']} test images, {r0['n_bins']} levels. "
                  f"Best baseline on test: {best:.3f}; " + "; ".join(
                      f"{r['mode']}: flow - best baseline = {r['test_bpd'] - best:+.3f}" for r in results) + ".",
              "Validation curve (step: bits/dim): " + "; ".join(
                  f"{r['mode']}: " + ", ".join(f"{c['step']}: {c['val_bpd']:.3f}" for c in r["val_curve"])
                  for r in results), "",
              "Published test bits/dim (other data sets, for orientation only): "
              + "; ".join(f"{d} {name}: {v:.2f}" for d, name, v in PUBLISHED) + "."]
    return "\n".join(lines)


def main_cli(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="flow-digits")
    p.add_argument("--modes", nargs="+", default=["standard"], choices=["standard", "checkpoint", "invertible"])
    p.add_argument("--iters", type=positive_int, help="training steps (default: the preset's)")
    p.add_argument("--ckpt-every", type=positive_int, default=250,
                   help="steps between the checkpoints that are evaluated (the final weights are one too)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs-dir", help="keep the runs here (default: a temporary folder)")
    p.add_argument("--json", help="also write the results as JSON")
    p.add_argument("--samples", help="PNG of samples at temperatures 1.0 / 0.8 / 0.6 (first mode's selected step)")
    p.add_argument("overrides", nargs="*", help="config overrides passed to sinkflow train (key=value)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.json:  # made now: a missing folder found after the training would lose it
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    os.nice(10)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("SINKFLOW_PROGRESS", "0")
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = Path(args.runs_dir or tmp)
        results = [train_and_measure(args.preset, m, runs_dir, args.iters, args.ckpt_every, args.overrides,
                                     args.samples if i == 0 else None) for i, m in enumerate(args.modes)]
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs visible, "
            f"{args.threads} torch thread(s), niced", "torch": torch.__version__,
            "command": "python benchmarks/flow_bpd.py " + " ".join(argv)}
    print(table(results))
    print(f"\n{meta['command']}  ({meta['date']}, {meta['machine']}, torch {meta['torch']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main_cli()
