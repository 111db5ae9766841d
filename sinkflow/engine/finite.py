"""No non-finite update is ever applied, without a host sync per step.

Reading a loss or a gradient norm as a Python number each step (``.item()``, ``float()``) makes the host wait
for the GPU to drain its queue: on a small network that wait, not arithmetic, is most of a step. The guard
keeps everything on the device instead:

* ``update(step, loss, grad_norm)`` marks the step bad when either value is not finite (under float16 only
  the loss: GradScaler already skips Inf/NaN gradients by design, and the flag is or-ed into its own:
  ``skip_with_scaler``), remembers the first bad step and its values, and returns a *sticky* skip flag: from the
  first bad step on, every optimizer update is skipped.
* A fused optimizer (the Trainer's Adam on CUDA, and on the CPU from torch 2.4: ``trainer.adam_kernel``) takes
  the flag as its ``found_inf`` input, the protocol GradScaler uses: the kernel leaves weights, moments and step
  counts untouched when it is set, with no sync. An optimizer without that input (foreach Adam, where this torch
  has no fused kernel) is guarded by ``check_now`` instead: the step's loss and gradient norm are read and the run
  stops before the update.
* ``failure()`` reads the flag (one sync). The engine reads it on log steps and before every checkpoint
  (``Trainer.raise_if_non_finite``), so a non-finite step stops the run there, naming the first bad step; the
  weights it stops with, and every checkpoint, hold only finite updates.

Under DDP the flag is OR-ed over ranks on the device, so every rank skips the same steps and stops together.
"""

from __future__ import annotations

import math

import torch

from sinkflow.runtime import dist


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Does ``optimizer.step`` honour a ``found_inf`` tensor (fused Adam/AdamW/SGD)?"""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and bool(optimizer.defaults.get("fused"))


class NonFiniteGuard:
    def __init__(self, device: torch.device, check_grad: bool = True):
        self.check_grad = check_grad
        self.first = torch.zeros((), dtype=torch.int64, device=device)  # first bad step (0 = none)
        self.loss = torch.zeros((), dtype=torch.float32, device=device)
        self.norm = torch.zeros((), dtype=torch.float32, device=device)

    def update(self, step: int | torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor,
               loss_bad: torch.Tensor | None = None) -> torch.Tensor:
        """Record step ``step`` (1-based; an int, or a 0-dim int64 tensor on the device: a captured step reads it
        there); returns the float32 skip flag (1 = do not apply this update).

        The record is updated in place: a CUDA graph of the step (``sinkflow.engine.step_graph``) reads and writes
        these same tensors at every replay, so the flag stays sticky across replays.

        ``loss_bad`` (above 0: some rank's loss was non-finite) is the loss's check agreed over the ranks already, by
        a torchrun job's captured step (``sinkflow.engine.grad_sync``, whose averaged gradients give every rank the
        same norm): then no collective here, where the update's CUDA graph would have captured one."""
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float()
        bad = ~torch.isfinite(loss) if loss_bad is None else loss_bad > 0
        if self.check_grad:
            bad = bad | ~torch.isfinite(grad_norm)
        if loss_bad is None:
            bad = dist.any_over_ranks(bad)
        new = bad & (self.first == 0)
        step = step if isinstance(step, torch.Tensor) else torch.full_like(self.first, step)
        self.loss.copy_(torch.where(new, loss, self.loss))
        self.norm.copy_(torch.where(new, grad_norm, self.norm))
        self.first.copy_(torch.where(new, step, self.first))
        return (self.first > 0).float()

    def failure(self) -> tuple[str, int] | None:
        """(what went non-finite, first bad step) of the device-side record, or None (one sync). Under DDP every rank
        finds the same step (the flag is OR-ed) and the values are the mean over ranks, as a logged loss is: each rank
        had named its own shard's loss, three numbers for one stop."""
        step = int(self.first)
        if not step:
            return None
        return self.what(dist.mean_over_ranks(float(self.loss)), dist.mean_over_ranks(float(self.norm))), step

    def clear(self) -> None:
        """Forget the record (in place: a captured step keeps writing these tensors), so later updates apply again.
        For a tool that takes steps one by one, reads each and goes on past a bad one (lr-find)."""
        for t in (self.first, self.loss, self.norm):
            t.zero_()

    def check_now(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        """The host-side check of one step (where a read is free: the CPU): what is non-finite, or None."""
        value = dist.mean_over_ranks(float(loss))  # every rank sees the same value (and stops together)
        norm = dist.mean_over_ranks(float(grad_norm)) if self.check_grad else 0.0
        return None if math.isfinite(value) and math.isfinite(norm) else self.what(value, norm)

    @staticmethod
    def what(loss: float, norm: float) -> str:
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        return f"non-finite gradient norm ({norm}) with a finite loss ({loss:.4g})"


def skip_with_scaler(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Or the guard's skip ``flag`` into the Inf/NaN flag GradScaler's ``unscale_`` recorded for ``optimizer``, on the
    device (no sync; a captured step holds it). Under float16 ``scaler.step`` hands the fused kernel GradScaler's
    flag, which sees only the gradients: a NaN loss with finite gradients (a NaN term without parameters) was
    applied, and so was every update after it until the next check, where the stop said the step was not applied.
    GradScaler then also lowers its scale, as for an overflow (the run stops at the check anyway)."""
    for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        found.copy_(torch.maximum(found, flag.to(found.device, found.dtype)))


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Updates the optimizer actually applied (GradScaler skips ``step`` on Inf/NaN gradients)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(float(state["step"]))
    return 0
