"""The paper's velocity MLP v(x, t): 3 hidden layers of 256 units; SELU, as torchcfm's ``MLP`` (the paper names none).

Inputs of any shape (N, *) are flattened to (N, D), concatenated with the time features, and the
output is reshaped back, so the same network serves 2D points and (small) flattened images.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from sinkflow.models.unet import as_batch_times

ACTIVATIONS = {"selu": nn.SELU, "silu": nn.SiLU, "relu": nn.ReLU, "gelu": nn.GELU}


def mlp_stack(d_in: int, d_out: int, hidden: int, depth: int, activation: str) -> nn.Sequential:
    """``depth`` hidden layers of ``hidden`` units with ``activation`` after each, then a linear head."""
    act = ACTIVATIONS[activation]
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, hidden), act()]
        d = hidden
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers)


def fourier_time_features(t: torch.Tensor, n_freq: int) -> torch.Tensor:
    """[t, sin(2^k pi t), cos(2^k pi t) for k < n_freq]: resolves times on [0, 1] at scales 1 .. 2^-n_freq."""
    freqs = math.pi * 2.0 ** torch.arange(n_freq, dtype=torch.float32, device=t.device)
    args = t[:, None] * freqs[None]
    return torch.cat([t[:, None], torch.sin(args), torch.cos(args)], dim=-1)


def time_bin_features(t: torch.Tensor, n_bins: int) -> torch.Tensor:
    """One-hot of the bin [k/K, (k+1)/K) that t falls in (the last bin also holds t = 1). A field that jumps
    at known times (NSGF's pool velocity changes at each grid time k/T) gets the jump as an input instead
    of having to bend a smooth function of t; the 1e-4 keeps a grid time that rounds below k/K in bin k."""
    k = torch.floor(t * n_bins + 1e-4).clamp(0, n_bins - 1).long()
    return nn.functional.one_hot(k, n_bins).to(t.dtype)


class MLP(nn.Module):
    """Velocity MLP on flat inputs. ``time_freqs=0`` and ``time_bins=0`` feed raw t (torchcfm's
    ``time_varying`` MLP)."""

    def __init__(self, dim: int, hidden: int = 256, depth: int = 3, activation: str = "selu", time_freqs: int = 0,
                 time_bins: int = 0):
        super().__init__()
        self.dim = dim
        self.time_freqs = time_freqs
        self.time_bins = time_bins
        self.net = mlp_stack(dim + 1 + 2 * time_freqs + time_bins, dim, hidden, depth, activation)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        n = x.shape[0]
        t = as_batch_times(t, n, x.device)
        tf = fourier_time_features(t, self.time_freqs) if self.time_freqs else t[:, None]
        if self.time_bins:
            tf = torch.cat([tf, time_bin_features(t, self.time_bins)], dim=-1)
        flat = x.reshape(n, -1)
        out = self.net(torch.cat([flat, tf.to(flat.dtype)], dim=-1))
        return out.reshape(x.shape)


def build(c: dict, sample_shape: tuple[int, ...]) -> MLP:
    """The velocity MLP for ``model.<phase>`` keys ``c`` (defaults filled in) on samples shaped ``sample_shape``."""
    return MLP(math.prod(sample_shape), int(c["hidden"]), int(c["depth"]), c["activation"], int(c["time_freqs"]),
               int(c["time_bins"]))
