"""Memory accounting for the planner: parameters, optimizer state, and measured activation memory."""

from __future__ import annotations

import torch


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def model_memory_bytes(model: torch.nn.Module, optimizer: str = "adam", ema: bool = False) -> int:
    """Bytes held for the whole run: parameters + gradients + optimizer state (+ an EMA copy).

    Adam keeps two moments per parameter (exp_avg, exp_avg_sq) in the parameter's dtype; SGD none.
    Frozen parameters count once (no gradient, no state).
    """
    states = {"adam": 2, "adamw": 2, "sgd": 0}
    if optimizer not in states:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {sorted(states)}")
    total = 0
    for p in model.parameters():
        b = p.numel() * p.element_size()
        total += b * (1 + (1 + states[optimizer] if p.requires_grad else 0) + (1 if ema else 0))
    return total


def _saved_bytes(model: torch.nn.Module, inputs: tuple, autocast_dtype: torch.dtype | None) -> int:
    """Bytes of the distinct tensors autograd keeps for backward during one forward (parameters excluded)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            storages[s.data_ptr()] = s.nbytes()
        return t

    device_type = inputs[0].device.type
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            out = model(*inputs)
    storages.pop(out.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def saved_activation_bytes(
    model: torch.nn.Module,
    sample_shape: tuple[int, ...],
    batch_size: int,
    with_time: bool = True,
    autocast_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> int:
    """Activation memory a training step keeps between forward and backward at ``batch_size``.

    Measured, not modelled: runs the real forward at batch 1 and 2 (on ``device``, default the
    model's) while recording every tensor autograd saves, and extrapolates linearly (activations are
    affine in the batch size). It leaves out the transient workspace of single ops, which is small
    next to this for convolutional nets; see docs/models.md for how it compares with CUDA's peak.
    """
    p = next(model.parameters())
    device = torch.device(device) if device is not None else p.device
    sizes = []
    for n in (1, 2):
        x = torch.randn(n, *sample_shape, device=device, dtype=p.dtype)
        inputs = (x, torch.rand(n, device=device)) if with_time else (x,)
        sizes.append(_saved_bytes(model, inputs, autocast_dtype))
    per_sample = sizes[1] - sizes[0]
    return max(0, sizes[0] - per_sample) + per_sample * batch_size
