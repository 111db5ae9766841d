"""How much of the card a training phase uses: `sinkflow bench --throughput PRESET`.

Per training phase of a preset, with the phase's own config (precision, memory format, prefetch, compile):

* **steps/s and samples/s** over ``steps`` steps with the device synchronised only at the start and the end,
  so the number is what a run gets (a per-step sync, as ``--profile`` uses to split a step, would itself
  slow a small network down).
* **data wait %**: the share of that wall time the training thread spent between one step's end and the next
  step's start (waiting for a batch the prefetcher has not finished, or drawing it inline, plus callbacks).
* **draw ms**: with batches made ahead, a worker's mean time per batch (sampling, OT-CFM's exact plan, the copy),
  from the start of its draw to the end of its prepare: beside the step time it says whether the workers keep up
  (two batches are in the making, their stages overlapping: about half of it per step where the prepare is the
  larger part), or slow the step by competing for the GIL and the cores while they run.
* **device busy %** (CUDA): the share of the timed steps' wall time in which kernels ran, from the PyTorch
  profiler over a few extra steps; ``100 - busy`` is the time the GPU waited on the host (launch overhead,
  syncs, Python). On a CPU the host *is* the device, so it is not reported.
* **model FLOP/s and % of peak**: FLOPs of one training step (forward + backward) counted by
  ``torch.utils.flop_counter.FlopCounterMode`` on the phase's real batch, times steps/s, against the peak this
  device reaches on a large matrix product in the phase's precision (measured here, not a datasheet value).
"""

from __future__ import annotations

import time

import torch

from sinkflow.runtime.callbacks import Callback


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_rows(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return batch_rows(next(iter(batch.values())))
    return batch_rows(batch[0])


def step_flops(trainer, batch) -> int:
    """FLOPs of the phase's forward + backward on ``batch`` (the optimizer's elementwise work is not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(trainer.precision)
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(trainer.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = trainer.task.loss(trainer.model, batch)
        grads = torch.autograd.grad(loss, [p for p in trainer.model.parameters() if p.requires_grad],
                                    allow_unused=True)
    del grads
    return int(counter.get_total_flops())


def peak_flops(device: torch.device, precision: str, size: int | None = None, repeats: int = 5,
               budget_s: float = 2.0) -> float:
    """FLOP/s of a square matrix product in ``precision`` on ``device``: the ceiling a training step is held to.
    On a CPU too: its autocast runs the products and convolutions in bf16 / fp16 (a bf16 row's % peak was taken
    against the float32 product's, 112 GFLOP/s on the dev VM where bf16's is 484: 54 % read for 13 %). On a CPU the
    product is a layer's, ``linear`` (oneDNN): fp16's ``a @ b`` takes a path of 1 GFLOP/s there against linear's 28,
    which put a fp16 phase at 431 % of it. The timed products stop after ``budget_s`` (at least one is timed)."""
    import torch.nn.functional as F

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    n = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    product = (lambda: a @ b) if device.type == "cuda" else (lambda: F.linear(a, b))  # the same 2 n^3 FLOPs
    product()  # warm-up (kernel selection)
    _sync(device)
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        _sync(device)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > budget_s:
            break
    return 2 * n**3 / best


def worker_draws(trainer) -> tuple[float, int]:
    """(seconds, count) of the batches the prefetch worker has drawn so far in this phase."""
    batches = trainer.batches
    return (batches.draw_s, batches.draws) if batches is not None else (0.0, 0)


class Throughput(Callback):
    """Times ``steps`` steps of every training phase after ``warmup`` untimed ones; ``rows`` gets a dict per phase.

    With ``busy_steps`` > 0 on CUDA, that many further steps run under the PyTorch profiler for the device-busy
    share. ``flops`` counts one step's FLOPs during the warm-up (that step is not timed)."""

    def __init__(self, warmup: int, steps: int, busy_steps: int = 5, flops: bool = True):
        self.warmup, self.steps, self.busy_steps, self.flops = warmup, steps, busy_steps, flops
        self.rows: list[dict] = []

    def on_phase_start(self, trainer) -> None:
        self.first = trainer.step
        self.t0 = self.t1 = None
        self.wait = 0.0
        self._end: float | None = None
        self.samples = 0
        self.step_flops = None
        self.prof = None
        self.prof_t0 = None
        self.busy: float | None = None
        self.loss_sum = None  # summed on the device over the timed steps, read once at the end
        self.draw0 = self.draw_ms = None

    def _index(self, trainer) -> int:
        return trainer.step - self.first  # steps done in this phase before the current one

    def on_train_batch_start(self, trainer, batch) -> None:
        if not trainer.training:
            return
        i = self._index(trainer)
        now = time.perf_counter()
        if i == 0 and self.flops:  # counted on the eager module: compiling changes the kernels, not the arithmetic
            self.step_flops = step_flops(trainer, batch)
        if i == self.warmup:
            _sync(trainer.device)
            self.t0 = now = time.perf_counter()
            self.draw0 = worker_draws(trainer)
        elif self.t0 is not None and self.t1 is None and self._end is not None:
            self.wait += now - self._end
        if i == self.warmup + self.steps and self.busy_steps and trainer.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.prof_t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, batch, outputs) -> None:
        if not trainer.training:
            return
        i = self._index(trainer)  # counts the step just taken
        self._end = time.perf_counter()
        if self.t0 is not None and self.t1 is None:
            self.samples += batch_rows(batch)
            loss = outputs[0].detach().float()
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
            if i == self.warmup + self.steps:
                _sync(trainer.device)
                self.t1 = time.perf_counter()
                (s0, n0), (s1, n1) = self.draw0, worker_draws(trainer)
                if n1 > n0:  # the draws of the timed window; a window too short for one: every draw so far
                    self.draw_ms = 1e3 * (s1 - s0) / (n1 - n0)
                elif n1:
                    self.draw_ms = 1e3 * s1 / n1
        if self.prof is not None and i == self.warmup + self.steps + self.busy_steps:
            _sync(trainer.device)
            wall = time.perf_counter() - self.prof_t0
            self.prof.__exit__(None, None, None)
            from torch.autograd import DeviceType

            kernel_us = sum(e.time_range.elapsed_us() for e in self.prof.events() if e.device_type == DeviceType.CUDA)
            self.busy = min(1.0, kernel_us * 1e-6 / wall)
            self.prof = None

    def on_phase_end(self, trainer) -> None:
        if not trainer.training:
            return
        if self.prof is not None:  # the phase ended inside the profiled window
            self.prof.__exit__(None, None, None)
            self.prof = None
        row = {"phase": trainer.name, "device": str(trainer.device), "precision": trainer.precision,
               "channels_last": trainer.channels_last, "steps": 0}
        if self.t1 is not None:
            wall = self.t1 - self.t0
            row.update(steps=self.steps, steps_per_s=self.steps / wall, samples_per_s=self.samples / wall,
                       wait_fraction=self.wait / wall, step_flops=self.step_flops,
                       busy_fraction=self.busy, loss=float(self.loss_sum) / self.steps, draw_ms=self.draw_ms)
        self.rows.append(row)


def add_peak(rows: list[dict], peaks: dict) -> list[dict]:
    """Achieved model FLOP/s and its fraction of the measured peak for the row's device and precision."""
    for r in rows:
        if r.get("steps") and r.get("step_flops"):
            r["flops_per_s"] = r["step_flops"] * r["steps_per_s"]
            r["peak"] = peaks[(r["device"], r["precision"])]
            r["peak_fraction"] = r["flops_per_s"] / r["peak"]
    return rows


def draw_ms(row: dict) -> str:
    """The worker's mean draw time, or - where batches were drawn inline."""
    return f"{row['draw_ms']:.2f}" if row.get("draw_ms") is not None else "-"


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'phase':<10} {'prec':<5} {'steps/s':>9} {'samples/s':>10} {'wait %':>7} {'draw ms':>8} {'busy %':>7} "
             f"{'GFLOP/step':>11} {'TFLOP/s':>8} {'% peak':>7}"]
    for r in rows:
        if not r.get("steps"):
            lines.append(f"{r['phase']:<10} (no timed steps: the phase is shorter than --warmup + --steps)")
            continue
        busy = f"{100 * r['busy_fraction']:.0f}%" if r.get("busy_fraction") is not None else "-"
        gf = f"{r['step_flops'] / 1e9:.3g}" if r.get("step_flops") else "-"
        tf = f"{r['flops_per_s'] / 1e12:.3g}" if r.get("flops_per_s") else "-"
        pk = f"{100 * r['peak_fraction']:.1f}%" if r.get("peak_fraction") is not None else "-"
        lines.append(f"{r['phase']:<10} {r['precision']:<5} {r['steps_per_s']:>9.2f} {r['samples_per_s']:>10.0f} "
                     f"{100 * r['wait_fraction']:>6.1f}% {draw_ms(r):>8} {busy:>7} {gf:>11} {tf:>8} {pk:>7}")
    return "\n".join(lines)
