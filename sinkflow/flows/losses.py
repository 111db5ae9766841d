"""Maximum-likelihood training helpers: dequantisation, bits/dim, ``flow_loss``.

Convention (the standard one, as in RealNVP/Glow): pixels are integers ``k in {0..n_bins-1}``; uniform
dequantisation gives ``x = k + u`` in ``[0, n_bins)``; the model sees ``x / n_bins - 0.5`` in
``[-0.5, 0.5)``. The ``/ n_bins`` scaling has log|det| ``-D log(n_bins)``, so with ``log_prob`` the model's
log-density of the scaled input,

    bits/dim = (-log_prob + D * log(n_bins)) / (D * ln 2),

which upper-bounds the discrete model's code length. Non-finite samples are *not* dropped.
"""

from __future__ import annotations

import math

import torch

from sinkflow.errors import SinkflowError


def to_levels(x, n_bins: int = 256) -> torch.Tensor:
    """Integer levels in ``[0, n_bins)`` from uint8/integer pixels or floats in [0, 1] (``k/255``)."""
    if x.dtype == torch.uint8 or not x.is_floating_point():
        k = x.long()
        if n_bins != 256:
            k = k // (256 // n_bins)  # Glow's n_bits < 8 reduction from 8-bit data
    else:
        if x.numel() and (float(x.min()) < 0 or float(x.max()) > 1):
            raise SinkflowError("float images for a flow must lie in [0, 1]",
                                "pass uint8 pixels or ToTensor()-style floats k/255")
        k = torch.round(x * (n_bins - 1)).long()
    if k.numel() and (int(k.min()) < 0 or int(k.max()) >= n_bins):
        raise SinkflowError(f"pixel levels outside [0, {n_bins})", "pass uint8 pixels or floats in [0, 1]")
    return k


def dequantize(x, generator: torch.Generator | None = None, n_bins: int = 256,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uniform dequantisation: ``levels + U[0, 1)``, float in ``[0, n_bins)``."""
    k = to_levels(x, n_bins).to(dtype or torch.get_default_dtype())
    u_device = generator.device if generator is not None else k.device
    u = torch.rand(k.shape, generator=generator, dtype=k.dtype, device=u_device)
    return k + u.to(k.device)


def preprocess(x_deq: torch.Tensor, n_bins: int = 256) -> torch.Tensor:
    """``[0, n_bins) -> [-0.5, 0.5)``, the space the model's density lives in."""
    return x_deq / n_bins - 0.5


def postprocess(x: torch.Tensor) -> torch.Tensor:
    """Model space -> image floats in [0, 1] (for saving samples)."""
    return (x + 0.5).clamp(0, 1)


def bits_per_dim(log_prob: torch.Tensor, dims: int, n_bins: int = 256) -> torch.Tensor:
    """Per-sample bits/dim from the model's log-density of ``x / n_bins - 0.5`` (see module docstring)."""
    return (-log_prob / dims + math.log(n_bins)) / math.log(2.0)


def flow_loss(model, x, generator: torch.Generator | None = None, n_bins: int = 256):
    """``(loss, bpd)``: loss = mean bits/dim (differentiable), bpd = its detached value.

    ``x`` is a batch of uint8 pixels or floats in [0, 1] with the model's sample shape.
    """
    dims = math.prod(x.shape[1:])
    param = next(model.parameters(), None)
    if param is not None:
        x = x.to(param.device)
    dtype = param.dtype if param is not None else None
    z = preprocess(dequantize(x, generator, n_bins, dtype), n_bins)
    loss = bits_per_dim(model.log_prob(z), dims, n_bins).mean()
    return loss, loss.detach()
