"""The Python API: the whole pipeline in two calls, or its parts in your own training loop.

    run = sinkflow.train("moons", train_iters=2000)         # same presets, keys and checks as `sinkflow train`
    x = run.sample(1024, steps=10)                          # (1024, 2) samples from the trained model

The parts (``sinkhorn_velocity``, ``simulate_sinkhorn_flow``, ``w2``, ``build_model``, ``euler``, the
distributions and the methods' tasks) are the same objects the CLI uses, re-exported here; the README and
``examples/`` show them in a loop of your own.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sinkflow import data, methods
from sinkflow.errors import SinkflowError

SHORTHANDS = {"train_iters": "--train-iters", "batch_size": "--batch-size", "lr": "--lr", "seed": "--seed",
              "method": "--method"}


class Run:
    """A trained (or training) run folder: its config, its finished models, and sampling."""

    def __init__(self, run):
        self._run = run

    @property
    def dir(self) -> Path:
        return self._run.dir

    @property
    def cfg(self) -> dict:
        return self._run.cfg

    def model(self, phase: str = "velocity") -> torch.nn.Module:
        """The frozen network a finished phase produced (EMA weights when the phase kept them)."""
        return self._run.model(phase)

    @torch.no_grad()
    def sample(self, n: int, steps: int | None = None, seed: int = 0, x0: torch.Tensor | None = None) -> torch.Tensor:
        """``n`` samples (CPU tensor shaped like the data) with ``steps`` integration steps (default: the
        method's own, e.g. sample.steps; NSF steps for NSGF++), from ``x0`` or a seeded source draw."""
        from sinkflow.runner.rng import phase_generator

        method = methods.of(self.cfg)
        if x0 is None:
            source, _ = data.distributions(self.cfg)
            x0 = source.sample(n, phase_generator(seed, "sample"), "cpu")
        x, _ = method.sample(self._run, x0.to(self._run.device), steps)
        return x.cpu()

    def evaluate(self) -> str:
        """The report `sinkflow train` prints at the end (W2 table, or image / flow metrics)."""
        from sinkflow.eval.report import final_report

        return final_report(self._run)

    def __repr__(self) -> str:
        return f"sinkflow.Run({str(self.dir)!r})"


def _argv(preset: str, runs_dir: str | Path, name: str, device: str, overrides: dict) -> list[str]:
    argv = ["train", preset, "--device", device, "--name", name, "--no-report", f"experiment.runs_dir={runs_dir}"]
    for key, value in overrides.items():
        if key in SHORTHANDS:
            argv += [SHORTHANDS[key], str(value)]
        elif "." in key:
            argv.append(f"{key}={value}")
        else:
            raise SinkflowError(f"unknown override {key!r}",
                                f"use a dotted config key as a dict, e.g. **{{'pool.batches': 4}}, or one of "
                                f"{', '.join(SHORTHANDS)}")
    return argv


def train(preset: str = "8gaussians-moons", *, runs_dir: str | Path = "runs", name: str | None = None,
          device: str = "auto", **overrides) -> Run:
    """Train every phase of ``preset`` exactly as `sinkflow train` does and return the finished ``Run``.

    ``overrides``: shorthands (``train_iters=2000``, ``batch_size``, ``lr``, ``seed``, ``method="otcfm"``) or
    dotted config keys passed as a dict (``**{"pool.batches": 64}``); the same one-line errors as the CLI,
    raised as ``SinkflowError``. The run folder is ``runs_dir/name`` (default: preset, method and time).
    """
    from sinkflow.cli import build_parser

    name = name or f"{preset}-{overrides.get('method', 'default')}-{time.strftime('%Y%m%d-%H%M%S')}"
    parser = build_parser()
    args, extra = parser.parse_known_args(_argv(preset, runs_dir, name, device, overrides))
    args.overrides = [*args.overrides, *extra]
    args.func(args)  # SinkflowError / Interrupted propagate to the caller
    return open_run(Path(runs_dir) / name)


def open_run(path: str | Path) -> Run:
    """Reopen a run folder (read only): sample from it or evaluate it."""
    from sinkflow.runner.run import Run as RunFolder

    return Run(RunFolder.open(Path(path)))
