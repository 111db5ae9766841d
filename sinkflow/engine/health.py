"""Training-dynamics dashboard: what the Trainer logs next to loss, LR, grad norm and throughput.

A ``Callback`` the engine adds to every training phase (``sinkflow.engine.trainer``).

Only on log steps (the cost is paid once every ``log_every`` steps):

* ``update_ratio`` (``update_ratio/g<i>`` with several parameter groups): ||w_after - w_before|| /
  ||w_before|| of the step that was just taken. ~1e-3 is healthy for Adam; 1e-5 means the LR is too
  low (or the parameters are not in the optimizer), 1e-1 means it is too high.
* ``loss_scale`` and ``skipped_steps`` under float16: GradScaler's current scale, and the steps whose
  update it skipped because of Inf/NaN gradients (phase steps minus Adam's own step count).
* ``dead_frac``: fraction of activation inputs in the flat region of their nonlinearity (ReLU: x <= 0;
  SiLU/GELU/SELU/ELU/Mish: x < -4, where the derivative is below ~0.07), and ``dead_units``: the
  fraction of units (channels / features) that are flat for the whole batch; measured with forward
  hooks on the activation modules during the logged step only. Where the step is a CUDA-graph replay
  (``train.<phase>.graph: step``, the CUDA default for UNet phases) no Python runs inside it, so the hooks watch a
  no-grad forward of the same batch through the eager model right after the step instead
  (``Trainer.probe_forward``: one forward every ``log_every`` steps, on the updated weights, dropout off).

Every ``train.<phase>.hist_every`` steps (0 = off) weight and gradient histograms go to TensorBoard.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from sinkflow.engine.finite import optimizer_steps
from sinkflow.runtime.callbacks import Callback

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

    def pause(self) -> None:
        """Remove the hooks and keep the counts (``detach`` reads them)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def detach(self) -> dict:
        self.pause()
        out = {}
        if self.total:
            out["dead_frac"] = self.flat / self.total
        if self.units:
            out["dead_units"] = self.dead_units / self.units
        self.flat = self.total = self.dead_units = self.units = 0
        return out


class Health(Callback):
    """Per-phase dashboard: ``on_train_batch_start`` and ``on_log`` bracket the optimizer step of a log step."""

    def __init__(self):
        self.trainer = None
        self.dead: DeadActivations | None = None
        self.before: list[list[torch.Tensor]] | None = None
        self.probing = False  # the coming logged step is a replay: its hooks are off, a probe forward watches it

    def on_phase_start(self, trainer) -> None:
        self.trainer = trainer
        cfg = trainer.cfg
        self.log_every, self.iters = cfg["log_every"], cfg["iters"]
        self.hist_every = int(cfg.get("hist_every", 0) or 0)
        self.dead = DeadActivations(trainer.model)
        self.before = None

    def logs_next(self) -> bool:
        nxt = self.trainer.step + 1
        return nxt % self.log_every == 0 or nxt == self.iters

    def on_train_batch_start(self, trainer, batch) -> None:
        """Snapshot the weights and attach the activation hooks when the coming step will be logged."""
        if not self.logs_next():
            return
        with torch.no_grad():
            self.before = [[p.detach().clone() for p in g["params"]] for g in trainer.optimizer.param_groups]
        self.probing = trainer.captures_steps  # decided here: a step whose capture fails (graph: auto) runs plain,
        # its hooks off, and captures_steps reads False at its end
        if not self.probing:  # a CUDA-graph replay runs no Python: the hooks would not fire
            self.dead.attach()

    def on_train_batch_end(self, trainer, batch, outputs) -> None:
        if self.probing and self.before is not None:  # a logged replay: watch the probe forward
            self.dead.attach()
            try:
                trainer.probe_forward(batch)
            finally:
                self.dead.pause()
        self.histograms()

    def on_log(self, trainer, metrics: dict) -> None:
        metrics.update(self.collect())

    def teardown(self, trainer) -> None:
        if self.dead is not None:
            self.dead.detach()  # a step interrupted between the hooks leaves no forward hook behind

    def collect(self) -> dict:
        """The dashboard values of the step just taken (logged with the step's metrics)."""
        out: dict = {}
        trainer = self.trainer
        groups = trainer.optimizer.param_groups
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
        scaler = trainer.scaler
        if scaler.is_enabled():
            out["loss_scale"] = float(scaler.get_scale())
            out["skipped_steps"] = max(0, trainer.step - optimizer_steps(trainer.optimizer))
        return out

    def histograms(self) -> None:
        """Weight and gradient histograms every ``hist_every`` steps."""
        trainer = self.trainer
        step = trainer.step
        if not self.hist_every or step % self.hist_every:
            return
        name = trainer.name
        for pname, p in trainer.model.named_parameters():
            trainer.run.logger.histogram(f"{name}/weights/{pname}", p.detach().float().cpu(), step)
            if p.grad is not None:
                trainer.run.logger.histogram(f"{name}/grads/{pname}", p.grad.detach().float().cpu(), step)
