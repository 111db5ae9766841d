"""A training phase made ready to poke at (doctor, lr-find): its ``Trainer`` before the first step.

``ready_trainer`` runs the phase's own ``Trainer.fit`` up to its first optimizer step and stops there (a
callback calls ``trainer.stop()`` at ``on_train_batch_start``), so any method's training step gets exactly the state its loop
would use (a pool opened, a checkpoint resumed), without knowing how the method prepares it.
"""

from __future__ import annotations

import copy
from pathlib import Path

from sinkflow import config as config_mod
from sinkflow import data, methods
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import TrainingStep
from sinkflow.runtime.callbacks import Callback
from sinkflow.runtime.lock import finish_fix

FOREVER = 10**9


class StopBeforeFirstStep(Callback):
    """Leave the trainer set up (resumed, first batch drawn: ``trainer.batch``) and end the phase before its
    first optimizer step, through the engine's supported stop (``Trainer.stop``).

    ``state``: a later state of the phase than the loop resumed (a finished phase's ``final.pt`` past its last step
    checkpoint), loaded before the first batch is drawn, so the loop draws that batch, and any it makes ahead, from
    the state's generator (``where``: its path, for the load's errors)."""

    def __init__(self, state: dict | None = None, where: str = ""):
        self.state, self.where = state, where

    def on_phase_start(self, trainer) -> None:
        if self.state is not None and self.state.get("step", 0) > trainer.step:
            trainer.load_state_dict(self.state, self.where)

    def on_train_batch_start(self, trainer, batch) -> None:
        trainer.stop()


def quiet_cut(cfg: dict, key: str, iters: int) -> list[str]:
    """The overrides that let ``train.<key>`` be cut to ``iters`` steps (a tool's scratch run: preflight, doctor,
    lr-find, bench) without the warnings about a long run's settings the cut would draw: a warm-up still running at
    the last step, an EMA that keeps its first step's weights. Both stay on the step's path, shortened."""
    from sinkflow.engine.ema import largest_decay

    train = cfg["train"][key]
    return [f"train.{key}.warmup={min(train.get('warmup', 0), max(iters - 1, 0))}",
            f"train.{key}.ema={min(train.get('ema', 0.0), largest_decay(iters))}"]


def scratch_overrides(cfg: dict) -> list[str]:
    """What the run's method shrinks of its own keys in a scratch run (``Method.scratch_overrides``: NSGF++'s
    NSGF states)."""
    return methods.of(cfg).scratch_overrides(cfg)


def ready_trainer(run, task, state: dict | None = None, where: str = ""):
    """``task``'s Trainer set up as its own loop would, with its first batch in ``trainer.batch``; no step
    is taken. ``state``: a later state to start from than the loop's resume (``StopBeforeFirstStep``)."""
    from sinkflow.engine.trainer import Trainer

    trainer = Trainer(run, task, [StopBeforeFirstStep(state, where)])
    trainer.fit()
    if not trainer.stopped:
        raise SinkflowError(f"phase {task.name} finished without taking a step", "check train.*.iters")
    return trainer


def _phases(cfg: dict) -> list:
    source, target = data.distributions(cfg)
    return methods.phases(cfg, source, target)


def train_phase_names(cfg: dict) -> list[str]:
    return [p.name for p in _phases(cfg) if isinstance(p, TrainingStep)]


def training_phase(cfg: dict, phase_name: str | None) -> TrainingStep:
    """The training phase ``phase_name`` of the run of ``cfg`` (None: its first), or a one-line error naming them."""
    steps = [p for p in _phases(cfg) if isinstance(p, TrainingStep)]
    if not steps:
        raise SinkflowError(f"method {methods.of(cfg).name} has no training phase", "pick another method")
    chosen = next((p for p in steps if p.name == (phase_name or steps[0].name)), None)
    if chosen is None:
        raise SinkflowError(f"no training phase '{phase_name}'", f"choose one of: {', '.join(p.name for p in steps)}")
    return chosen


def workspace(cfg: dict, phase_name: str | None, workdir: Path, pool_batches: int = 1, pool_steps: int = 10,
              prior_iters: int = 2,
              overrides: list[str] | None = None):
    """(run, ready trainer) in a scratch run under ``workdir``: earlier phases built small, ``phase_name`` ready.

    Earlier training phases run ``prior_iters`` steps (their models only need to exist); the pool keeps
    its real Sinkhorn batch size but only ``pool_batches`` batches of at most ``pool_steps`` Euler steps
    (the first ``pool_steps`` steps of the real flow: a CPU pool of the real length can take many minutes).
    """
    run, task = scratch_run(cfg, phase_name, workdir, pool_batches, pool_steps, prior_iters, overrides)
    return run, ready_trainer(run, task)


def scratch_run(cfg: dict, phase_name: str | None, workdir: Path, pool_batches: int = 1, pool_steps: int = 10,
                prior_iters: int = 2, overrides: list[str] | None = None):
    """(run, task): ``workspace``'s scratch run with the earlier phases done and released, and ``phase_name``'s task,
    no trainer built yet (what a caller measures the phase against: ``benchmarks/memory_estimate.py``)."""
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.engine.trainer import Trainer

    cfg = copy.deepcopy(cfg)
    phase_name = training_phase(cfg, phase_name).name
    phases = _phases(cfg)
    ov = [f"experiment.runs_dir={workdir}", "experiment.name=scratch",
          f"pool.batches={min(cfg['pool']['batches'], pool_batches)}", "pool.in_flight=0",
          f"pool.steps={min(cfg['pool']['steps'], pool_steps)}"]
    ov += scratch_overrides(cfg)
    for ph in phases:
        if isinstance(ph, TrainingStep):
            k = ph.model_key
            if ph.name == phase_name:
                ov += [f"train.{k}.iters={FOREVER}", f"train.{k}.log_every={FOREVER}", f"train.{k}.ckpt_every={FOREVER}"]
            elif not _later(phases, ph.name, phase_name):
                ov += [f"train.{k}.iters={prior_iters}", *quiet_cut(cfg, k, prior_iters),
                       f"train.{k}.ckpt_every={FOREVER}"]
    cfg = config_mod.apply_overrides(cfg, ov + list(overrides or []))
    run = RunFolder.create(cfg)
    for ph in _phases(cfg):
        if ph.name == phase_name:
            return run, ph
        Trainer(run, ph).fit()
        run.release()
    raise AssertionError("unreachable")


def open_run_phase(run_dir: Path, phase_name: str | None, device: str | None = None):
    """(run, ready trainer) of an existing run, without writing to it; earlier phases must be finished. ``device``:
    where it runs for this call (None: its experiment.device; config.yaml is unchanged).

    The trainer holds the phase's newest state: its step checkpoint, as a resume would load, or its ``final.pt`` where
    that is further on. Why: the loop resumes from step checkpoints only, so a finished phase without one
    (``ckpt_every`` above ``iters``) was swept from a fresh init (`lr-find RUN`, `doctor RUN`) under the run's name,
    and one whose last step checkpoint came before its end from that earlier step."""
    from sinkflow.runtime.run_folder import RunFolder

    cfg = read_device(run_dir, device)
    chosen = training_phase(cfg, phase_name)
    phase_name, key = chosen.name, chosen.model_key
    phases = _phases(cfg)
    for ph in phases:
        if ph.name == phase_name:
            break
        if not (Path(run_dir) / "checkpoints" / ph.name / "final.pt").is_file():
            raise SinkflowError(f"phase {ph.name} of {run_dir} has not finished, {phase_name} needs it",
                                f"{finish_fix(run_dir)}, or pass the preset instead")
    cfg = config_mod.apply_overrides(cfg, [f"train.{key}.iters={FOREVER}", f"train.{key}.log_every={FOREVER}",
                                           f"train.{key}.ckpt_every={FOREVER}"])
    run = RunFolder(Path(run_dir), cfg, log=False)  # read only: nothing is logged into the user's run
    ph = next(p for p in _phases(cfg) if p.name == phase_name)
    ckpts = run.checkpoints(phase_name)
    final = ckpts.final() if ckpts.final_path.is_file() else None  # checked as a step checkpoint is
    later = final if final is not None and final.get("optimizer") is not None else None
    return run, ready_trainer(run, ph, later, str(ckpts.final_path))


def read_device(run_dir: Path, device: str | None = None) -> dict:
    """The run's config.yaml, with ``experiment.device`` set to ``device`` in memory where one is given (a tool's
    `--device` for this call: the run folder is not changed)."""
    from sinkflow.runtime.run_folder import read_config

    cfg = read_config(run_dir)
    return cfg if device is None else config_mod.apply_shorthands(cfg, {"device": device})


def _later(phases, a: str, b: str) -> bool:
    names = [p.name for p in phases]
    return names.index(a) > names.index(b)
