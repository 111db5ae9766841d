"""Strict float32 for OT solves: no autocast, no TF32 / bf16 matmuls.

Why: Sinkhorn works on costs divided by a small epsilon, so a TF32 matmul (10-bit mantissa) in the
cost matrix turns into errors of order |x|^2 * 1e-3 / eps in the exponent - large enough to move the
velocity visibly. Training may run under bf16 autocast; the OT step must not.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def _precision_knobs() -> list[object]:
    """The per-backend fp32 matmul settings this torch exposes (new API, torch >= 2.9)."""
    knobs = []
    for backend in (getattr(torch.backends, "cuda", None), getattr(torch.backends, "mkldnn", None)):
        matmul = getattr(backend, "matmul", None)
        if matmul is not None and hasattr(matmul, "fp32_precision"):
            knobs.append(matmul)
    return knobs


@contextmanager
def strict_float32(device_type: str) -> Iterator[None]:
    """Disable autocast and reduced-precision fp32 matmuls inside; restore the caller's settings after.

    Uses the per-backend ``fp32_precision`` API where it exists: mixing it with the legacy
    ``allow_tf32`` setters raises in recent torch, and saving/restoring per-backend values is safe
    whichever API the caller used.
    """
    knobs = _precision_knobs()
    if knobs:
        saved = [k.fp32_precision for k in knobs]
        for k in knobs:
            k.fp32_precision = "ieee"
    else:  # older torch: legacy switch
        saved_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    finally:
        if knobs:
            for k, value in zip(knobs, saved):
                k.fp32_precision = value
        else:
            torch.backends.cuda.matmul.allow_tf32 = saved_tf32
