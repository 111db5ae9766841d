"""Training-dynamics dashboard: what TrainPhase logs next to loss, LR, grad norm and throughput.

Only on log steps (the cost is paid once every ``log_every`` steps):

* ``update_ratio`` (``update_ratio/g<i>`` with several parameter groups): ||w_after - w_before|| /
  ||w_before|| of the step that was just taken. ~1e-3 is healthy for Adam; 1e-5 means the LR is too
  low (or the parameters are not in the optimizer), 1e-1 means it is too high.
* ``loss_scale`` and ``skipped_steps`` under float16: GradScaler's current scale, and the steps whose
  update it skipped because of Inf/NaN gradients (phase steps minus Adam's own step count).
* ``dead_frac``: fraction of activation inputs in the flat region of their nonlinearity (ReLU: x <= 0;
  SiLU/GELU/SELU/ELU/Mish: x < -4, where the derivative is below ~0.07), and ``dead_units``: the
  fraction of units (channels / features) that are flat for the whole batch; measured with forward
  hooks on the activation modules during the logged step only.

Every ``train.<phase>.hist_every`` steps (0 = off) weight and gradient histograms go to TensorBoard.
"""

from __future__ import annotations

import torch
import torch.nn as nn

RELU_LIKE = (nn.ReLU, nn.ReLU6)
SMOOTH = (nn.SiLU, nn.GELU, nn.SELU, nn.ELU, nn.Mish, nn.CELU)
SATURATED_BELOW = -4.0


class DeadActivations:
    """Forward hooks that count saturated inputs of every activation module while attached."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.handles: list = []
        self.flat = self.total = self.dead_units = self.units = 0

    def attach(self) -> None:
        for m in self.model.modules():
            if isinstance(m, RELU_LIKE + SMOOTH):
                self.handles.append(m.register_forward_hook(self._hook))

    def _hook(self, module, inputs, output) -> None:
        x = inputs[0]
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return
        with torch.no_grad():
            mask = x <= 0 if isinstance(module, RELU_LIKE) else x < SATURATED_BELOW
            self.flat += int(mask.sum())
            self.total += mask.numel()
            if mask.dim() >= 2:
                per_unit = mask.transpose(0, 1).reshape(mask.shape[1], -1).all(dim=1)
                self.dead_units += int(per_unit.sum())
                self.units += per_unit.numel()

    def detach(self) -> dict:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        out = {}
        if self.total:
            out["dead_frac"] = self.flat / self.total
        if self.units:
            out["dead_units"] = self.dead_units / self.units
        self.flat = self.total = self.dead_units = self.units = 0
        return out


class Health:
    """Per-phase dashboard state; ``before_step`` and ``collect`` bracket the optimizer step of a log step."""

    def __init__(self, phase, logger=None):
        self.phase = phase
        self.logger = logger
        cfg = phase.cfg
        self.log_every, self.iters = cfg["log_every"], cfg["iters"]
        self.hist_every = int(cfg.get("hist_every", 0) or 0)
        self.dead = DeadActivations(phase.model)
        self.before: list[list[torch.Tensor]] | None = None

    def logs_next(self) -> bool:
        nxt = self.phase.step + 1
        return nxt % self.log_every == 0 or nxt == self.iters

    def before_step(self) -> None:
        """Snapshot the weights and attach the activation hooks when the coming step will be logged."""
        if not self.logs_next():
            return
        with torch.no_grad():
            self.before = [[p.detach().clone() for p in g["params"]] for g in self.phase.optimizer.param_groups]
        self.dead.attach()

    def collect(self) -> dict:
        """The dashboard values of the step just taken (call in the logging block)."""
        out: dict = {}
        groups = self.phase.optimizer.param_groups
        if self.before is not None:
            with torch.no_grad():
                for i, (g, old) in enumerate(zip(groups, self.before)):
                    if not old:
                        continue
                    delta = torch.stack([(p.detach().float() - o.float()).norm() for p, o in zip(g["params"], old)]).norm()
                    norm = torch.stack([o.float().norm() for o in old]).norm()
                    key = "update_ratio" if len(groups) == 1 else f"update_ratio/g{i}"
                    out[key] = float(delta / norm.clamp_min(1e-12))
            self.before = None
        out.update(self.dead.detach())
        scaler = getattr(self.phase, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            out["loss_scale"] = float(scaler.get_scale())
            out["skipped_steps"] = max(0, self.phase.step - optimizer_steps(self.phase.optimizer))
        return out

    def histograms(self) -> None:
        """Weight and gradient histograms every ``hist_every`` steps."""
        step = self.phase.step
        if not self.hist_every or step % self.hist_every or self.logger is None:
            return
        name = self.phase.name
        for pname, p in self.phase.model.named_parameters():
            self.logger.histogram(f"{name}/weights/{pname}", p.detach().float().cpu(), step)
            if p.grad is not None:
                self.logger.histogram(f"{name}/grads/{pname}", p.grad.detach().float().cpu(), step)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Updates the optimizer actually applied (GradScaler skips ``step`` on Inf/NaN gradients)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(float(state["step"]))
    return 0
