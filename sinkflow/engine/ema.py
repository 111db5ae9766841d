"""EMA weights that never make the host wait for the device.

torch's ``AveragedModel.update_parameters`` asks ``bool(self.n_averaged == 0)`` and ``self.n_averaged > 0`` of a
counter that lives on the device: two host syncs per optimizer step on a GPU, which drain the launch queue of a
small network's step (the issue-23 rule: no host read per step). ``EMA`` is the same model with the same update,
arithmetic and state dict (``module.*`` and ``n_averaged``: checkpoints load either way), but it keeps a host-side
mirror of "has it started", read from the device once, when a checkpoint is loaded.
"""

from __future__ import annotations

import math
from itertools import chain

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


# the share of the first step's weights still in the average at the last step above which the Trainer warns
START_SHARE = 0.01


def first_step_share(decay: float, iters: int) -> float:
    """The weight the first step's model keeps in the average after ``iters`` steps: ``decay ** (iters - 1)`` (the
    first update copies the weights). sinkflow's EMA has no warm-up, so a decay meant for a long run (0.9999 over
    20k steps: 13.5 %) leaves a short run's sampler near its starting weights."""
    return decay ** max(iters - 1, 0) if decay > 0 else 0.0


def largest_decay(iters: int, share: float = START_SHARE) -> float:
    """The largest decay of 4 decimals whose first-step share after ``iters`` steps stays at or under ``share``."""
    return math.floor(share ** (1 / max(iters - 1, 1)) * 1e4 - 1e-6) / 1e4  # below an exact bound's rounding


class EMA(AveragedModel):
    """``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)`` without host syncs.

    The first update copies the weights (and buffers), every later one is torch's EMA kernel
    (``decay * ema + (1 - decay) * model``, foreach lerp per device and dtype)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.started = False  # host mirror of n_averaged > 0

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        ema = [t.detach() for t in chain(self.module.parameters(), self.module.buffers())]
        cur = [t.detach().to(e.device) for e, t in zip(ema, chain(model.parameters(), model.buffers()), strict=True)]
        if not self.started:
            for e, c in zip(ema, cur):
                e.copy_(c)
            self.started = True
        else:
            groups: dict[tuple, tuple[list, list]] = {}
            for e, c in zip(ema, cur):
                pair = groups.setdefault((e.device, e.dtype), ([], []))
                pair[0].append(e)
                pair[1].append(c)
            for es, cs in groups.values():  # torch's EMA kernel ignores its count argument
                self.multi_avg_fn(es, cs, self.n_averaged)
        self.n_averaged += 1

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.started = bool(self.n_averaged > 0)  # one read, at load
        return out
