"""The autocast a ``precision`` key names (``fp32`` / ``bf16`` / ``fp16``): one mapping for the training phases
(``train.*.precision``), the sampler (``sample.precision``) and the memory planner; and what ``auto`` is for the
sampler (the training phases' ``auto``: ``sinkflow.engine.fast_path``, on the same card check)."""

from __future__ import annotations

import torch

from sinkflow.errors import SinkflowError

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32 is autocast off
FAST_KINDS = ("unet",)  # the networks the fast path was measured on


def bf16_tensor_cores(device: torch.device) -> bool:
    """Does this CUDA card run bf16 matrix products natively (sm_80+)? False on a CPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def autocast(device_type: str, precision: str, cache: bool = True) -> torch.autocast:
    """``torch.autocast`` in ``precision``'s half dtype, disabled for fp32 (master weights and optimizer state stay
    float32 either way). ``cache=False`` where a CUDA graph captures the region (a cached weight cast
    would outlive the capture)."""
    dtype = HALF.get(precision)
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None, cache_enabled=cache)


def sampling_precision(value: str, kind: str, device: torch.device | str, bf16: bool | None = None,
                       trained: str = "auto") -> str:
    """``sample.precision`` made concrete for the network ``kind`` the sampler calls on ``device``. ``auto``: fp32
    off a CUDA card (a CPU has no fast float16 kernels: 0.74x fp32's images/s on the MNIST UNet, docs/performance.md);
    on one, the network's set training precision (``trained``: its ``train.<phase>.precision``, fp32 included: a
    network kept out of half precision on purpose; a set bf16 only on a card with bf16 tensor cores, fp32 on an
    older one: a run trained on an A100 and sampled on a T4, where bf16 is unmeasured), else fp16 where a training
    phase's ``auto`` is (a UNet on a card with bf16 tensor cores), else fp32. Why fp16: on an H200 (2026-11-30, the
    CIFAR-10 UNet, 60 Euler steps, batch 256, cuDNN autotuning off) eager fp16 ran at 1.56x fp32's images/s (bf16
    1.67x, with 8x fp16's pixel error), and the samples themselves moved a paired FD-CNN by <= 0.05 against a new
    noise draw's 3.3-4.6 (RESULTS.md, "Half-precision sampling"). ``bf16`` overrides the card check, as in
    ``fast_path.resolve`` (the planner plans for a card not in hand)."""
    if value != "auto":
        return value
    device = torch.device(device)
    if device.type != "cuda":
        return "fp32"
    if trained not in ("auto", "bf16"):  # decided without the card (mnist.py's table head asks off the machine)
        return trained
    native = bf16_tensor_cores(device) if bf16 is None else bf16
    if trained == "bf16":  # trained on an Ampere card, sampled on a T4: no bf16 tensor cores there
        return "bf16" if native else "fp32"
    return "fp16" if kind in FAST_KINDS and native else "fp32"


def precision_named(value: str, resolved: str) -> str:
    """How a message names the precision the sampler ran in: the key as set (``sample.precision=fp16``), or what
    ``auto`` became (``fp16 (sample.precision=auto)``)."""
    return f"sample.precision={value}" if value == resolved else f"{resolved} (sample.precision={value})"


def fp16_overflow(where: str, value: str) -> SinkflowError:
    """The one-line refusal of a draw holding NaN / Inf that the sampler made in fp16 (``value``: ``sample.precision``
    as set, ``fp16`` or ``auto``): float16's range (65,504) did not hold a network's activations; bf16 keeps float32's
    range. ``where`` says what was drawn (samples, NSGF++'s states)."""
    return SinkflowError(f"{where} under {precision_named(value, 'fp16')}", "a network's activations overflow "
                         "float16's range: set sample.precision=bf16 (float32's range) or fp32")
