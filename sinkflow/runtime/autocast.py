"""The autocast a ``precision`` key names (``fp32`` / ``bf16`` / ``fp16``): one mapping for the training phases
(``train.*.precision``), the sampler (``sample.precision``) and the memory planner."""

from __future__ import annotations

import torch

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32 is autocast off


def autocast(device_type: str, precision: str, cache: bool = True) -> torch.autocast:
    """``torch.autocast`` in ``precision``'s half dtype, disabled for fp32 (master weights and optimizer state stay
    float32 either way). ``cache=False`` where a CUDA graph captures the region (a cached weight cast
    would outlive the capture)."""
    dtype = HALF.get(precision)
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None, cache_enabled=cache)
