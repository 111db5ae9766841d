"""The NSGF++ phase-transition time predictor t_phi(x) in [0, 1] (paper App. E.2).

Images: 4 conv layers (32, 64, 128, 256 filters, 3x3, stride 1, padding 1), ReLU, and 2x2 average
pooling after each; flatten; one linear layer to 1; sigmoid. Pooling uses ``ceil_mode=True`` so odd
sizes keep their last row/column and tiny images never pool to zero (8 -> 4 -> 2 -> 1 -> 1); the
linear layer's width is fixed at construction from the configured image size. Points (N, D): an MLP
with the same output contract, so NSGF++ also runs on 2D data.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from sinkflow.models.mlp import mlp_stack


def pooled_size(size: int, layers: int) -> int:
    """Spatial size after ``layers`` rounds of AvgPool2d(2, ceil_mode=True)."""
    for _ in range(layers):
        size = math.ceil(size / 2)
    return size


class TimePredictorCNN(nn.Module):
    def __init__(self, sample_shape: tuple[int, int, int], channels: tuple[int, ...] = (32, 64, 128, 256)):
        super().__init__()
        c, hgt, wid = sample_shape
        self.sample_shape = tuple(sample_shape)
        layers = []
        for width in channels:
            layers += [nn.Conv2d(c, width, 3, stride=1, padding=1), nn.ReLU(), nn.AvgPool2d(2, ceil_mode=True)]
            c = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c * pooled_size(hgt, len(channels)) * pooled_size(wid, len(channels)), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[1:]) != self.sample_shape:
            raise ValueError(f"time predictor built for {self.sample_shape}, got {tuple(x.shape[1:])}")
        if self.features[0].weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return torch.sigmoid(self.head(self.features(x).flatten(1))).squeeze(1)


class TimePredictorMLP(nn.Module):
    """For flat data such as 2D points: MLP -> 1 -> sigmoid."""

    def __init__(self, dim: int, hidden: int = 256, depth: int = 3, activation: str = "selu"):
        super().__init__()
        self.net = mlp_stack(dim, 1, hidden, depth, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(x.reshape(x.shape[0], -1))).squeeze(1)


def build(c: dict, sample_shape: tuple[int, ...]) -> nn.Module:
    """The CNN for images (C, H, W), the MLP for points: same contract, forward(x) -> (N,) in [0, 1]."""
    if len(sample_shape) == 3:
        return TimePredictorCNN(sample_shape, tuple(int(w) for w in c["channels"]))
    return TimePredictorMLP(math.prod(sample_shape), int(c["hidden"]), int(c["depth"]), c["activation"])
