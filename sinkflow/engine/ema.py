"""EMA weights that never make the host wait for the device.

torch's ``AveragedModel.update_parameters`` asks ``bool(self.n_averaged == 0)`` and ``self.n_averaged > 0`` of a
counter that lives on the device: two host syncs per optimizer step on a GPU, which drain the launch queue of a
small network's step (the issue-23 rule: no host read per step). ``EMA`` is the same model with the same update,
arithmetic and state dict (``module.*`` and ``n_averaged``: checkpoints load either way), but it keeps a host-side
mirror of the update count, read from the device once, when a checkpoint is loaded.

That count also drives the optional warm-up (``train.<phase>.ema_warmup``, on by default as in torch_ema and
diffusers): torch's EMA has none, so its decay holds from the first update and a decay meant for 100k steps leaves a
20k-step run's sampler a tenth made of its initial weights.
"""

from __future__ import annotations

import math
from itertools import chain

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


# the share of the first step's weights still in the average at the last step above which the Trainer warns
START_SHARE = 0.01
# the warm-up's offset: update t (t >= 1 updates before it) uses min(decay, (1 + t) / (WARMUP_OFFSET + t)), the ramp of
# torch_ema (use_num_updates) and diffusers' EMAModel by default
WARMUP_OFFSET = 10


def step_decay(decay: float, t: int, warmup: bool) -> float:
    """The decay of update ``t`` (``t`` updates before it, so ``t >= 1``): ``decay``, or with the warm-up the ramp
    ``(1 + t) / (10 + t)`` while it is below ``decay``. The ramp averages about the last tenth of the steps so far, so
    an EMA meant for a long run (0.9999) does not hold a short run's sampler near its initial weights."""
    return min(decay, (1 + t) / (WARMUP_OFFSET + t)) if warmup else decay


def ramp_updates(decay: float) -> int:
    """How many updates (t = 1, 2, ...) the warm-up's ramp is below ``decay``."""
    return max(0, math.ceil((WARMUP_OFFSET * decay - 1) / (1 - decay)) - 1)


def first_step_share(decay: float, iters: int, warmup: bool = False) -> float:
    """The weight the first step's model keeps in the average after ``iters`` steps: the product of every later
    update's decay (the first update copies the weights): ``decay ** (iters - 1)`` without the warm-up (0.9999 over
    20k steps: 13.5 %), under 1 % after 5 steps with it (the ramp's product is 10! (m + 1)! / (m + 10)!)."""
    if decay <= 0:
        return 0.0
    n = max(iters - 1, 0)
    m = min(n, ramp_updates(decay)) if warmup else 0
    ramp = math.exp(math.lgamma(m + 2) + math.lgamma(WARMUP_OFFSET + 1) - math.lgamma(m + WARMUP_OFFSET + 1))
    return ramp * decay ** (n - m)


def largest_decay(iters: int, share: float = START_SHARE) -> float:
    """The largest decay of 4 decimals whose first-step share after ``iters`` steps stays at or under ``share``."""
    return math.floor(share ** (1 / max(iters - 1, 1)) * 1e4 - 1e-6) / 1e4  # below an exact bound's rounding


class EMA(AveragedModel):
    """``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)`` without host syncs, and
    with the warm-up of torch_ema and diffusers if asked (``step_decay``).

    The first update copies the weights (and buffers), every later one is torch's EMA kernel
    (``decay * ema + (1 - decay) * model``, foreach lerp per device and dtype)."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = False):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.decay, self.warmup = decay, warmup
        self.updates = 0  # host mirror of n_averaged

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        ema = [t.detach() for t in chain(self.module.parameters(), self.module.buffers())]
        cur = [t.detach().to(e.device) for e, t in zip(ema, chain(model.parameters(), model.buffers()), strict=True)]
        if not self.updates:
            for e, c in zip(ema, cur):
                e.copy_(c)
        else:
            decay = step_decay(self.decay, self.updates, self.warmup)
            update = self.multi_avg_fn if decay == self.decay else get_ema_multi_avg_fn(decay)
            groups: dict[tuple, tuple[list, list]] = {}
            for e, c in zip(ema, cur):
                pair = groups.setdefault((e.device, e.dtype), ([], []))
                pair[0].append(e)
                pair[1].append(c)
            for es, cs in groups.values():  # torch's EMA kernel ignores its count argument
                update(es, cs, self.n_averaged)
        self.n_averaged += 1
        self.updates += 1

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.updates = int(self.n_averaged)  # one read, at load
        return out
