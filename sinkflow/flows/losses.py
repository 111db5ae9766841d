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
    """Integer levels in ``[0, n_bins)`` from 8-bit pixels or floats in [0, 1].

    Integer tensors (uint8 or any integer dtype) are 8-bit pixel values 0..255, reduced to ``n_bins`` levels as
    ``k * n_bins // 256`` (Glow's ``k // 2**(8 - n_bits)`` for a power of two, and defined for any ``n_bins``: with
    ``256 // n_bins`` a non-divisor such as 17 sent 255 out of range). Floats in [0, 1] are
    ``round(x * (n_bins - 1))``: ``k / 255`` for 256 levels, ``k / (n_bins - 1)`` for data already at ``n_bins``
    levels (sklearn's digits, 0..16, as ``x / 16``). For an ``n_bins`` that divides 256 they are
    ``round(x * 255) * n_bins // 256``, the integer path's reduction: ToTensor()'s ``k / 255`` got another binning
    than the same uint8 pixels (at 32 levels a fifth of the pixels moved a level, and bits/dim changed), and
    ``k / (n_bins - 1)`` still comes back as ``k`` (``round(255 k / (n_bins - 1))`` lies in the 8-bit bin of ``k``)."""
    check_n_bins(n_bins)
    if x.dtype == torch.uint8 or not x.is_floating_point():
        k = x.long()
        if k.numel():
            lo, hi = torch.stack(torch.aminmax(k)).tolist()  # one read
            if lo < 0 or hi > 255:
                raise SinkflowError(f"integer pixels for a flow are 8-bit values 0..255, got {lo}..{hi}",
                                    f"pass uint8 pixels, or levels 0..{n_bins - 1} as floats k/{n_bins - 1}")
        if n_bins != 256:
            k = k * n_bins // 256
        return k
    if x.numel():
        lo, hi = torch.stack(torch.aminmax(x.detach())).tolist()
        if not (lo >= 0 and hi <= 1):  # NaN fails both
            raise SinkflowError(f"float images for a flow must lie in [0, 1], got {lo:.4g}..{hi:.4g}",
                                "pass uint8 pixels or ToTensor()-style floats k/255 (NaN or Inf: check the data)")
    if 256 % n_bins == 0:
        return torch.round(x * 255).long() * n_bins // 256
    return torch.round(x * (n_bins - 1)).long()


def check_n_bins(n_bins) -> int:
    """The likelihood's pixel levels: an integer in [2, 256] (0 was a math domain error, 300 silently wrong)."""
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or not 2 <= n_bins <= 256:
        raise SinkflowError(f"n_bins={n_bins!r} must be an integer in [2, 256]",
                            "use 256 for 8-bit images (or 17 for sklearn digits' native 0..16 levels)")
    return n_bins


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


def postprocess(x: torch.Tensor, n_bins: int = 256) -> torch.Tensor:
    """Model space -> the data's own pixel values in [0, 1]: the level ``k`` whose bin ``[k, k+1) / n_bins`` holds
    the sample (the discrete image the dequantised density assigns it to; openai/glow's postprocess quantises too),
    then that level as the data layer holds it: ``k / 255`` for 8-bit data, the 8-bit bin's centre under a bit
    reduction (``n_bins`` dividing 256), ``round(k * 255 / (n_bins - 1)) / 255`` for data with ``n_bins`` native
    levels (sklearn digits: exactly the data's values). The continuous ``x + 0.5`` was off the grid: a white
    digit pixel came back anywhere in 0.88..1. NaN goes to the middle level, +-inf to the range ends."""
    check_n_bins(n_bins)
    y = torch.nan_to_num(x + 0.5, nan=0.5, posinf=1.0, neginf=0.0)
    k = torch.floor(y * n_bins).clamp_(0, n_bins - 1)
    if 256 % n_bins == 0:
        s = 256 // n_bins
        return (k * s + (s - 1) / 2) / 255.0
    return torch.round(k * 255.0 / (n_bins - 1)) / 255.0


def bits_per_dim(log_prob: torch.Tensor, dims: int, n_bins: int = 256) -> torch.Tensor:
    """Per-sample bits/dim from the model's log-density of ``x / n_bins - 0.5`` (see module docstring)."""
    check_n_bins(n_bins)
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
    loss = bits_per_dim(model(z)[1], dims, n_bins).mean()  # forward, not log_prob: a DDP-wrapped model has only it
    return loss, loss.detach()
