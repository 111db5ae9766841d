"""The measurements behind `sinkflow bench`: an experiment run with its training phases cut short, timed per step
(``StepTimer``, ``--profile``) or over a window without per-step syncs (``throughput``, ``--throughput``; the
callback is ``sinkflow.tools.throughput.Throughput``). The command's argument handling is ``sinkflow.cli.bench``."""

from __future__ import annotations

import time

import torch

from sinkflow import config, data, methods
from sinkflow.engine.experiment import run_phases
from sinkflow.runtime.callbacks import Callback, quiet
from sinkflow.runtime.run_folder import RunFolder
from sinkflow.runtime.scratch import scratch_dir
from sinkflow.tools.phases import quiet_cut
from sinkflow.tools.throughput import batch_rows


class StepTimer(Callback):
    """Times every training phase's steps: compute = the optimizer step (device synchronised after it);
    data = from the end of one step to the start of the next. ``rows`` gets one report per phase, over the
    ``steps`` steps after ``warmup`` (a phase needs two more: the first has no previous end, the last is the
    phase's log step, see ``LOG_STEP``)."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.rows: list[dict] = []

    def on_phase_start(self, trainer) -> None:
        self.data: list[float] = []
        self.compute: list[float] = []
        self.samples = 0
        self._last_end: float | None = None
        self._start: float | None = None

    def on_train_batch_start(self, trainer, batch) -> None:
        if trainer.training:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, batch, outputs) -> None:
        if not trainer.training:
            return
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        if self._last_end is not None:
            self.data.append(self._start - self._last_end)
            self.compute.append(end - self._start)
            self.samples = batch_rows(batch)
        self._last_end = end

    def on_phase_end(self, trainer) -> None:
        if trainer.training:
            self.rows.append({**self.report(trainer.name), "device": str(trainer.device),
                              "precision": trainer.precision, "channels_last": trainer.channels_last})

    def report(self, phase: str) -> dict:
        window = slice(self.warmup, self.warmup + self.steps)
        data, compute = self.data[window], self.compute[window]
        if not data:
            return {"phase": phase, "steps": 0}
        d, c = sum(data) / len(data), sum(compute) / len(compute)
        return {"phase": phase, "steps": len(data), "step_ms": 1e3 * (d + c), "data_ms": 1e3 * d,
                "compute_ms": 1e3 * c, "data_fraction": d / (d + c), "samples_per_s": self.samples / (d + c)}


# A phase cut to ``total`` steps logs its last step, and the engine's own callbacks run before a measuring one on
# it: Health clones the weights, writes histograms and, on a captured step, runs an eager probe forward (the first
# in its mode, which may pay cuDNN/cuBLAS set-up), all inside the step a measuring callback brackets. So every measurement ends
# one step before the last. Until 2026-11-27 the busy window (``Throughput``) ended on that step: the busy share
# read 3-4 % on an H100 where a session before, without the probe, read 81-87 % for the same path and rate.
LOG_STEP = 1


def run_cut(cfg: dict, total: int, callbacks: list, log_every: int | None = None) -> None:
    """Run the experiment in a temp folder with every training phase cut to ``total`` steps (logged once at the
    end, or every ``log_every`` steps; no checkpoint but the final one, no histograms: nothing but steps in a
    measured window)."""
    overrides = []
    for name in cfg["train"]:
        overrides += [f"train.{name}.iters={total}", *quiet_cut(cfg, name, total),
                      f"train.{name}.ckpt_every={10 * total}",
                      f"train.{name}.log_every={log_every or total}", f"train.{name}.hist_every=0"]
    with scratch_dir("bench") as tmp:
        cfg = config.apply_overrides(cfg, [*overrides, f"experiment.runs_dir={tmp}", "experiment.name=bench"])
        run = RunFolder.create(cfg)
        source, target = data.distributions(cfg)
        with quiet(chatter=False):  # a phase cut to a few steps has not learned: not news about the user's config
            run_phases(run, methods.phases(cfg, source, target), callbacks=callbacks)
        run.logger.close()


def profile(cfg: dict, steps: int, warmup: int) -> list[dict]:
    """Every training phase cut to warmup + steps steps, each step timed in a data and a compute part."""
    timer = StepTimer(warmup, steps)
    run_cut(cfg, 1 + warmup + steps + LOG_STEP, [timer])  # the first step has no "previous end": not counted
    return timer.rows


def throughput(cfg: dict, steps: int, warmup: int, busy_steps: int = 5, callbacks: list = ()) -> list[dict]:
    """Every training phase cut to warmup + steps (+ busy_steps on CUDA) + its log step, timed without per-step
    syncs (``callbacks`` watch the same run, e.g. a ``PhaseClock``)."""
    from sinkflow.runtime.run_folder import resolve_device
    from sinkflow.tools.throughput import Throughput, add_peak, peak_flops

    if resolve_device(cfg["experiment"]["device"]).type != "cuda":
        busy_steps = 0  # the profiled busy share is a CUDA measurement: no extra steps elsewhere
    meter = Throughput(warmup, steps, busy_steps)
    run_cut(cfg, warmup + steps + busy_steps + LOG_STEP, [meter, *callbacks])
    peaks = {}
    for r in meter.rows:
        key = (r["device"], r["precision"])
        if key not in peaks:
            peaks[key] = peak_flops(torch.device(r["device"]), r["precision"])
    return add_peak(meter.rows, peaks)


class PhaseClock(Callback):
    """Wall time of every phase, from its first unit of work to its end (its final checkpoint included), and of
    each of its units (a pool's chunks, a training phase's steps)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.units: dict[str, list[float]] = {}

    def on_phase_start(self, trainer) -> None:
        self._t0 = self._last = time.perf_counter()
        self.units[trainer.name] = []

    def on_train_batch_end(self, trainer, batch, outputs) -> None:
        now = time.perf_counter()
        self.units[trainer.name].append(now - self._last)
        self._last = now

    def on_phase_end(self, trainer) -> None:
        self.seconds[trainer.name] = time.perf_counter() - self._t0


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def projected_pool(full: dict, cut: dict, clock: PhaseClock) -> float | None:
    """Seconds the run's whole pool would take: the pool built here when it was not cut; otherwise its first chunk
    as measured (set-up included) plus every other batch at the rate of the chunks after the first, which were
    solved in groups of the real run's size (``bench --throughput`` builds two chunks)."""
    if "pool" not in clock.seconds or "pool" not in full:
        return None
    built, batches = cut["pool"]["batches"], full["pool"]["batches"]
    units = clock.units["pool"]
    if built == batches or len(units) < 2:
        return clock.seconds["pool"] * batches / built
    chunk = max(1, cut["pool"]["chunk"])
    per_batch = sum(units[1:]) / (built - chunk)
    return units[0] + per_batch * (batches - chunk)


def projected_run(rows: list[dict], full: dict, cut: dict, clock: PhaseClock) -> str:
    """The run's own budget at the rates just measured, in one line: the pool (``projected_pool``) and each
    training phase's ``train.<phase>.iters`` (from ``full``, the config the user would train) over its steps/s.
    What a user asks before renting the hours: does the whole run fit the session (issue 23: "projected from
    measured per-phase steps/s")."""
    parts, total, partial = [], 0.0, False
    pool = projected_pool(full, cut, clock)
    if pool is not None:
        built, batches = cut["pool"]["batches"], full["pool"]["batches"]
        parts.append(f"pool {batches:,} batches {_duration(pool)}"
                     + (f" (from the {built} built here)" if built != batches else ""))
        total += pool
    for r in rows:
        iters = full["train"][r["phase"]]["iters"]
        if not r.get("steps"):
            parts.append(f"{r['phase']} not timed")
            partial = True
            continue
        seconds = iters / r["steps_per_s"]
        parts.append(f"{r['phase']} {iters:,} steps {_duration(seconds)}")
        total += seconds
    return (f"the run's own budget at these rates: {'; '.join(parts)}; {'at least ' if partial else ''}"
            f"{_duration(total)} in all, not counting compiling or capturing at each phase's start, step "
            f"checkpoints and the evaluation")


def format_table(rows: list[dict]) -> str:
    lines = [f"{'phase':<10} {'steps':>5} {'step ms':>9} {'data ms':>9} {'compute ms':>10} {'data %':>7} "
             f"{'samples/s':>10}  verdict"]
    for r in rows:
        if not r.get("steps"):
            lines.append(f"{r['phase']:<10} (no timed steps: raise --steps)")
            continue
        verdict = "data-bound" if r["data_fraction"] > 0.3 else "compute-bound"
        lines.append(f"{r['phase']:<10} {r['steps']:>5} {r['step_ms']:>9.2f} {r['data_ms']:>9.2f} "
                     f"{r['compute_ms']:>10.2f} {100 * r['data_fraction']:>6.1f}% {r['samples_per_s']:>10.0f}  "
                     f"{verdict}")
    return "\n".join(lines)
