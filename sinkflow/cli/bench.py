"""`sinkflow bench --profile PRESET [overrides]`: is each training phase data-bound or compute-bound?

Runs every phase of the experiment in a throw-away run folder, with each training phase cut to
``--steps`` optimizer steps, and times each step in two parts (a ``StepTimer`` callback of the engine): the
data part (from the end of one step to the start of the next: batch creation, gathers, host-to-device
copies) and the compute part (forward, backward, optimizer, EMA; the device is synchronised at the end so
queued kernels are counted). The
pool is built small (``pool.batches`` cut to 4) unless ``--pool-batches`` says otherwise.
"""

from __future__ import annotations

import tempfile
import time

import torch

from sinkflow import config, data, methods
from sinkflow.cli.common import add_config_args, resolve_args
from sinkflow.errors import SinkflowError
from sinkflow.runtime.callbacks import Callback
from sinkflow.engine.experiment import run_phases
from sinkflow.runtime.run_folder import RunFolder
from sinkflow.tools.throughput import batch_rows


def add_parser(sub):
    p = sub.add_parser("bench", help="profile training steps (data wait vs compute) or measure throughput",
                       description="Run N steps of every training phase and report the fraction of step time spent "
                                   "waiting for data (batch creation + host-to-device copy) versus compute.")
    add_config_args(p)
    p.add_argument("--profile", action="store_true", help="split each step into data wait and compute, with a "
                   "device sync per step (the default)")
    p.add_argument("--throughput", action="store_true", help="steps/s, samples/s, data wait, device busy and "
                   "the fraction of the device's peak FLOP/s per phase, with no per-step sync")
    p.add_argument("--steps", type=int, default=30, help="timed steps per training phase (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocation, compile; default 5)")
    p.set_defaults(func=run)


class StepTimer(Callback):
    """Times every training phase's steps: compute = the optimizer step (device synchronised after it);
    data = from the end of one step to the start of the next. ``rows`` gets one report per phase."""

    def __init__(self, warmup: int):
        self.warmup = warmup
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
        data, compute = self.data[self.warmup :], self.compute[self.warmup :]
        if not data:
            return {"phase": phase, "steps": 0}
        d, c = sum(data) / len(data), sum(compute) / len(compute)
        return {"phase": phase, "steps": len(data), "step_ms": 1e3 * (d + c), "data_ms": 1e3 * d,
                "compute_ms": 1e3 * c, "data_fraction": d / (d + c), "samples_per_s": self.samples / (d + c)}


def run_cut(cfg: dict, total: int, callbacks: list, log_every: int | None = None) -> None:
    """Run the experiment in a temp folder with every training phase cut to ``total`` steps (logged once at the
    end, or every ``log_every`` steps)."""
    overrides = []
    for name in cfg["train"]:
        overrides += [f"train.{name}.iters={total}", f"train.{name}.ckpt_every={10 * total}",
                      f"train.{name}.log_every={log_every or total}"]
    with tempfile.TemporaryDirectory(prefix="sinkflow-bench-") as tmp:
        cfg = config.apply_overrides(cfg, [*overrides, f"experiment.runs_dir={tmp}", "experiment.name=bench"])
        run = RunFolder.create(cfg)
        source, target = data.distributions(cfg)
        run_phases(run, methods.of(cfg).phases(cfg, source, target), callbacks=callbacks)
        run.logger.close()


def profile(cfg: dict, steps: int, warmup: int) -> list[dict]:
    """Every training phase cut to warmup + steps steps, each step timed in a data and a compute part."""
    timer = StepTimer(warmup)
    run_cut(cfg, warmup + steps + 1, [timer])  # the first step has no "previous end": not counted
    return timer.rows


def throughput(cfg: dict, steps: int, warmup: int, busy_steps: int = 5) -> list[dict]:
    """Every training phase cut to warmup + steps (+ busy_steps on CUDA) steps, timed without per-step syncs."""
    from sinkflow.runtime.run_folder import resolve_device
    from sinkflow.tools.throughput import Throughput, add_peak, peak_flops

    if resolve_device(cfg["experiment"]["device"]).type != "cuda":
        busy_steps = 0  # the profiled busy share is a CUDA measurement: no extra steps elsewhere
    meter = Throughput(warmup, steps, busy_steps)
    run_cut(cfg, warmup + steps + busy_steps, [meter])
    peaks = {}
    for r in meter.rows:
        key = (r["device"], r["precision"])
        if key not in peaks:
            peaks[key] = peak_flops(torch.device(r["device"]), r["precision"])
    return add_peak(meter.rows, peaks)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'phase':<10} {'steps':>5} {'step ms':>9} {'data ms':>9} {'compute ms':>10} {'data %':>7} "
             f"{'samples/s':>10}  verdict"]
    for r in rows:
        if not r.get("steps"):
            lines.append(f"{r['phase']:<10} (no timed steps: raise --steps)")
            continue
        verdict = "data-bound" if r["data_fraction"] > 0.3 else "compute-bound"
        lines.append(f"{r['phase']:<10} {r['steps']:>5} {r['step_ms']:>9.2f} {r['data_ms']:>9.2f} "
                     f"{r['compute_ms']:>10.2f} {100 * r['data_fraction']:>6.1f}% {r['samples_per_s']:>10.0f}  {verdict}")
    return "\n".join(lines)


def run(args):
    if args.steps < 1 or args.warmup < 0:
        raise SinkflowError(f"--steps {args.steps} --warmup {args.warmup} is not a valid budget",
                            "use --steps >= 1 and --warmup >= 0")
    pool_set = args.pool_batches is not None or any(o.startswith("pool.batches=") for o in args.overrides)
    cfg = resolve_args(args)
    if not pool_set:
        cfg = config.apply_overrides(cfg, [f"pool.batches={min(cfg['pool']['batches'], 4)}"])
    data.distributions(cfg)  # validate the data before any work
    name = f"{cfg['experiment']['preset']} ({methods.of(cfg).name})"
    if args.throughput:
        from sinkflow.tools.throughput import format_rows

        rows = throughput(cfg, args.steps, args.warmup)
        device = rows[0]["device"] if rows else cfg["experiment"]["device"]
        print(f"sinkflow bench --throughput {name} on {device}: {args.steps} steps per phase after {args.warmup} "
              f"warm-up, synchronised only at both ends; wait = between steps (data, callbacks); busy = kernels "
              f"running (CUDA); % peak = model FLOP/s over this device's measured matrix-product peak")
        print(format_rows(rows))
        return 0
    rows = profile(cfg, args.steps, args.warmup)
    device = rows[0]["device"] if rows else cfg["experiment"]["device"]
    print(f"sinkflow bench --profile {name} on {device}: "
          f"data = batch creation + host-to-device copy between steps; compute = forward/backward/optimizer")
    print(format_table(rows))
    print("data-bound (> 30 % waiting): raise pool.storage=memory, keep the image cache in RAM, or use fewer "
          "but larger batches; compute-bound: a UNet on CUDA already runs fp16 with the whole step one CUDA "
          "graph (the phase's first line says what ran); other networks can try train.*.precision=bf16, train.*.compile=true")
    return 0
