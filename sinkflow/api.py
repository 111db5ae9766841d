"""The Python API: the whole pipeline in two calls, or its parts in your own training loop.

    run = sinkflow.train("moons", train_iters=2000)         # same presets, keys, checks and engine as `sinkflow train`
    x = run.sample(1024, steps=10)                          # (1024, 2) samples from the trained model

The parts (``sinkhorn_velocity``, ``simulate_sinkhorn_flow``, ``w2``, ``build_model``, ``euler``, the
distributions and the methods' tasks) are the same objects the CLI uses, re-exported here; the README and
``examples/`` show them in a loop of your own.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import torch

from sinkflow import methods
from sinkflow.config import schema
from sinkflow.errors import SinkflowError


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

    def model(self, phase: str | None = None) -> torch.nn.Module:
        """The frozen network a finished phase produced (EMA weights when the phase kept them); None: the method's
        first network (velocity; a flow's flow). A name that is not one of the method's network phases is refused
        as such: "has not finished" would send the user to `train --resume`, which never makes it."""
        method = methods.of(self.cfg).name
        phases = schema.METHOD_REGISTRY[method].phases  # the method's phases in order, as `sinkflow status`
        networks = [p for p in phases if p in schema.MODEL]  # those that train a network (model.<phase>)
        phase = networks[0] if phase is None else phase
        if phase not in networks:
            problem = (f"phase {phase!r} of method {method} trains no network" if phase in phases else
                       f"method {method} has no network phase {phase!r}")
            raise SinkflowError(problem, f"its networks: {', '.join(networks)}")
        return self._run.model(phase)

    @torch.no_grad()
    def sample(self, n: int, steps: int | None = None, seed: int = 0, x0: torch.Tensor | None = None,
               qmc: bool | None = None) -> torch.Tensor:
        """``n`` samples (CPU tensor shaped like the data) with ``steps`` integration steps (a whole number >= 1;
        None: the method's own, e.g. sample.steps; NSF steps for NSGF++), from ``x0`` or a seeded source draw: i.i.d.
        by default, randomised QMC with ``qmc=True`` (None: ``sample.qmc``), as `sinkflow sample` draws."""
        method = methods.of(self.cfg)
        if steps is not None and not (isinstance(steps, numbers.Integral) and not isinstance(steps, bool)
                                      and steps >= 1):  # as `sinkflow sample --steps`: 0 is not "the default"
            raise SinkflowError(f"steps={steps!r} must be a whole number >= 1",
                                "e.g. steps=10, or leave it out (None) for the run's default")
        if x0 is None:
            from sinkflow.eval.points import generate

            qmc = self.cfg["sample"]["qmc"] if qmc is None else qmc
            return generate(self._run, n, steps or method.default_steps(self.cfg), seed, qmc=qmc)[0]
        x, _ = method.sample(self._run, x0.to(self._run.device), steps)
        return x.cpu()

    def evaluate(self) -> str:
        """The report `sinkflow train` prints at the end (W2 table, or image / flow metrics)."""
        from sinkflow.eval.report import final_report

        return final_report(self._run)

    def __repr__(self) -> str:
        return f"sinkflow.Run({str(self.dir)!r})"


def train(preset: str = "8gaussians-moons", *, runs_dir: str | Path = "runs", name: str | None = None,
          device: str = "auto", **overrides) -> Run:
    """Train every phase of ``preset`` exactly as `sinkflow train` does and return the finished ``Run``.

    ``overrides``: shorthands (``train_iters=2000``, ``batch_size``, ``lr``, ``seed``, ``method="otcfm"``, every
    ``sinkflow.config.SHORTHANDS`` name) or dotted config keys passed as a dict (``**{"pool.batches": 64}``);
    the same resolution, checks and one-line errors as the CLI (``SinkflowError``), through the same engine
    entry point (``sinkflow.engine.experiment.train_run``), no argument parsing. The run folder is
    ``runs_dir/name`` (default: preset, method and time).
    """
    from sinkflow import config
    from sinkflow.config.render import scalar
    from sinkflow.engine.experiment import train_run

    short = {"device": device, "name": name}  # None: the run folder's own name, from the resolved method
    dotted = [f"experiment.runs_dir={scalar(str(runs_dir))}"]
    for key, value in overrides.items():
        if key in config.SHORTHANDS:
            short[key] = value
        elif "." in key:
            dotted.append(f"{key}={scalar(value)}")
        else:
            raise SinkflowError(f"unknown override {key!r}",
                                f"use a dotted config key as a dict, e.g. **{{'pool.batches': 4}}, or one of "
                                f"{', '.join(config.SHORTHANDS)}")
    cfg = config.resolve(preset, dotted, short)
    return open_run(train_run(cfg, device=device).dir)  # SinkflowError / Interrupted propagate to the caller


def open_run(path: str | Path) -> Run:
    """Reopen a run folder (read only): sample from it or evaluate it."""
    from sinkflow.runtime.run_folder import RunFolder

    return Run(RunFolder.open(Path(path)))
