"""Memory accounting: parameters, optimizer state, and activation memory measured with saved-tensor hooks."""

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


class SavedTensorCounter(torch.autograd.graph.saved_tensors_hooks):
    """``with SavedTensorCounter(model) as c: loss = ...``; then ``c.bytes``: the bytes autograd saves for backward.

    Counts each distinct storage once (views of one tensor are not double counted) and leaves out parameter
    storages (weights are not activations). This is the memory held between forward and backward; the
    backward pass additionally holds its own transients (for a flow: one recomputed checkpoint segment or
    one layer in invertible mode). Needs no GPU.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
        self._seen: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._params and ptr not in self._seen:
            self._seen[ptr] = st.nbytes()
        return t

    def discard(self, obj) -> None:
        """Stop counting the storages of ``obj`` (a tensor or nested lists/tuples of them), e.g. the outputs."""
        if torch.is_tensor(obj):
            self._seen.pop(obj.untyped_storage().data_ptr(), None)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                self.discard(item)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def largest(self) -> int:
        return max(self._seen.values(), default=0)


def forward_saved_bytes(model: torch.nn.Module, inputs: tuple,
                        autocast_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(total, largest) bytes of the distinct non-parameter tensors autograd keeps for backward during one
    ``model(*inputs)`` (under autocast to ``autocast_dtype`` if given). The outputs are not activations
    (a flow returns (latents, log_prob)) and are not counted."""
    device_type = inputs[0].device.type
    with SavedTensorCounter(model) as counter:
        with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            out = model(*inputs)
    counter.discard(out)
    return counter.bytes, counter.largest


def activation_terms(
    model: torch.nn.Module,
    sample_shape: tuple[int, ...],
    with_time: bool | None = True,
    autocast_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[int, int, int]:
    """(fixed, per-sample, largest per-sample) bytes of the activations a training forward keeps for backward.

    Measured, not modelled: runs the real forward at batch 1 and 2 (on ``device``, default the model's)
    while recording every tensor autograd saves, and splits the total into a fixed and a per-sample part
    (activations are affine in the batch size). ``with_time``: pass a time ``t`` after ``x``; None: pass one
    if the forward takes it (the time predictor does not).
    """
    p = next(model.parameters())
    device = torch.device(device) if device is not None else p.device
    sizes = []
    for n in (1, 2):
        x = torch.randn(n, *sample_shape, device=device, dtype=p.dtype)
        if with_time is False:
            sizes.append(forward_saved_bytes(model, (x,), autocast_dtype))
            continue
        t = torch.rand(n, device=device)
        try:
            sizes.append(forward_saved_bytes(model, (x, t), autocast_dtype))
        except TypeError:  # a network without a time input
            if with_time:
                raise
            sizes.append(forward_saved_bytes(model, (x,), autocast_dtype))
    (t1, m1), (t2, m2) = sizes
    per = max(0, t2 - t1)
    return max(0, t1 - per), per, max(m2 - m1, m2 // 2)


def recompute_terms(
    model: torch.nn.Module,
    sample_shape: tuple[int, ...],
    autocast_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> tuple[int, int, int]:
    """(fixed, per-sample, largest per-sample) bytes autograd saves while backward re-runs the largest piece of a
    memory-saving model with grad: a flow's checkpoint segment, or one layer in invertible mode (``recompute_units``
    of its chains).
    The forward of such a model keeps almost nothing (``activation_terms``), so this transient is its peak:
    a Glow layer of the CIFAR-10 preset re-runs its 512-channel conditioner, ~2 MiB per sample.

    Measured as ``activation_terms`` is, at batch 1 and 2: a no-grad forward records each chain's input, then
    every unit is run on its true input with grad under ``SavedTensorCounter``; the third number is the largest
    tensor one unit saves (the gradients backward makes are of its size). (0, 0, 0) for a model without units.
    """
    chains = [m for m in model.modules() if callable(getattr(m, "recompute_units", None)) and m.recompute_units()]
    if not chains:
        return 0, 0, 0
    p = next(model.parameters())
    largest, biggest = [], []
    for n in (1, 2):
        inputs = {}
        hooks = [c.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod, args[0].detach()))
                 for c in chains]
        try:
            with torch.no_grad():
                model(torch.randn(n, *sample_shape, device=device, dtype=p.dtype))
        finally:
            for h in hooks:
                h.remove()
        best = big = 0
        for chain in chains:
            chain.drop_caches()  # a layer's weights cached by the no-grad forward would not be re-derived with grad
            x = inputs[chain]
            for a, b in chain.recompute_units():
                x = x.detach().requires_grad_(True)
                with SavedTensorCounter(model) as counter, torch.autocast(
                        torch.device(device).type, dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
                    out = chain.run_layers(x, a, b)
                counter.discard(out)
                best, big, x = max(best, counter.bytes), max(big, counter.largest), out[0]
        largest.append(best)
        biggest.append(big)
    per = max(0, largest[1] - largest[0])
    return max(0, largest[0] - per), per, max(biggest[1] - biggest[0], biggest[1] // 2)


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
    fixed, per_sample, _ = activation_terms(model, sample_shape, with_time, autocast_dtype, device)
    return fixed + per_sample * batch_size
