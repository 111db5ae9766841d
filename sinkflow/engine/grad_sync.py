"""Gradients averaged over a torchrun job's ranks by one all-reduce between two captured graphs (``graph: step``).

Why not DDP there: DistributedDataParallel all-reduces gradient buckets from hooks inside the backward pass, and a
CUDA graph holds those only under conditions PyTorch lists for NCCL ("CUDA Graphs" in its docs: its asynchronous
error handling off before the process group starts, the wrapper built on a side stream, 11 eager steps before the
capture), none of them measured here. So a captured step under torchrun is two graphs with this eager call between
them: the forward and backward of the plain model (compiled as in one process: no DDPOptimizer splitting its graph),
one all-reduce of every gradient as a flat buffer, then the clip, non-finite guard and optimizer as the second graph.
Every rank averages the same sums, so every rank clips, skips and steps alike, as under DDP. The one per-rank input
to that decision, whether this rank's own loss was finite, travels in the same all-reduce (``loss_bad``): the
non-finite guard's OR over ranks (``dist.any_over_ranks``) is a collective of its own, which inside the update's
graph would have been an NCCL all-reduce captured into it, under the conditions this split exists to avoid.

What DDP overlaps (a bucket's all-reduce with the rest of the backward) waits for the backward here. Its cost is
the gradients' bytes through the interconnect once a step: the ``mnist`` UNet's 4.4 MB, the CIFAR-10 UNet's 143 MB
(its time on several cards unmeasured: one GPU is lent here; `split-rate` in gpu_session.py times it in a group of
one). The rest of DDP's part is kept: the weights and buffers broadcast from rank 0 when the phase starts, the
buffers after every step (what a BatchNorm's running statistics get from DDP before each forward).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from sinkflow.errors import SinkflowError


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype (one flat buffer each: a collective sums one dtype)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _collective(tensors: list[torch.Tensor], op) -> None:
    """``op(flat)`` on each dtype's tensors as one flat buffer, written back in place (the tensors keep their
    storage: a graph's static gradients and the optimizer's references stay valid)."""
    for group in _by_dtype(tensors):
        flat = torch.cat([t.reshape(-1) for t in group])
        op(flat)
        torch._foreach_copy_(group, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in group]), group)])


class GradSync:
    """``GradSync(model)``: ``start()`` gives every rank rank 0's weights and buffers (as DDP's constructor does);
    calling it after a backward averages each parameter's gradient over the ranks and gives every rank rank 0's
    buffers. Parameters without a gradient are left alone. Each rank's backward must reach the same parameters, or
    the ranks' flat buffers differ in size and NCCL waits for ever: the first call checks that with one all-reduce of
    which parameters have a gradient and raises on every rank alike where they differ (DDP's own error, one line).
    ``GradSync(...)(loss)`` also sets ``loss_bad`` (a 0-dim float32 tensor that keeps its storage: the update's graph
    reads it) above 0 where any rank's ``loss`` was non-finite, in the gradients' all-reduce."""

    def __init__(self, model: torch.nn.Module):
        named = list(model.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.buffers = [b for b in model.buffers() if b.is_floating_point() or b.dtype == torch.int64]
        self.world = tdist.get_world_size()
        device = self.params[0].device if self.params else torch.device("cpu")
        self.loss_bad = torch.zeros((), dtype=torch.float32, device=device)
        self.checked = False

    def start(self) -> None:
        with torch.no_grad():
            _collective(self.params + self.buffers, lambda flat: tdist.broadcast(flat, src=0))

    @torch.no_grad()
    def __call__(self, loss: torch.Tensor | None = None) -> None:
        if not self.checked and self.params:
            self._check_same_parameters()
        grads = [p.grad for p in self.params if p.grad is not None]
        if loss is not None:  # 1 here where this rank's loss is not finite: after the average, > 0 where any rank's
            self.loss_bad.copy_(~torch.isfinite(loss.detach()))
            grads.append(self.loss_bad)
        if grads:
            _collective(grads, self._average)
        if self.buffers:
            _collective(self.buffers, lambda flat: tdist.broadcast(flat, src=0))

    def _check_same_parameters(self) -> None:
        """One all-reduce, once: how many ranks hold each parameter's gradient (all or none, else the ranks'
        backwards reached different parameters). Every rank reads the same counts, so every rank raises alike."""
        has = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32, device=self.loss_bad.device)
        tdist.all_reduce(has)
        partial = [name for name, n in zip(self.names, has.tolist()) if 0 < n < self.world]
        if partial:
            raise SinkflowError(f"parameter {partial[0]!r} got a gradient on some ranks only ({len(partial)} such): "
                                "under torchrun, graph: step averages one flat buffer of gradients that every rank's "
                                "backward must fill alike", "let every rank's loss reach the same parameters (DDP "
                                "refuses this too)", every_rank=True)
        self.checked = True

    def _average(self, flat: torch.Tensor) -> None:
        flat.div_(self.world)  # DDP's default hook: each rank's share first, then the sum (gloo has no AVG)
        tdist.all_reduce(flat)
