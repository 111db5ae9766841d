"""Random streams of a run: one CPU generator per (seed, tags), so phases never share a stream.

A leaf module (torch, numpy only): methods draw their batches from these generators and the engine
checkpoints them, so both import it.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import numpy as np
import torch


def stream_seed(seed: int, *tags: Any) -> int:
    """The seed of the stream named by (seed, tags): the same tags, the same stream, in any process."""
    return (seed * 1_000_003 + zlib.crc32(repr(tags).encode())) % (2**63)


def phase_generator(seed: int, *tags: Any) -> torch.Generator:
    """A CPU generator whose seed depends only on (seed, tags): phases never share a stream."""
    gen = torch.Generator()
    gen.manual_seed(stream_seed(seed, *tags))
    return gen


def draws_dropout(model: torch.nn.Module) -> bool:
    """Does ``model`` hold an active dropout layer (p > 0), the one consumer of the global RNG in a step?"""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def seed_everything(seed: int) -> None:
    """Seed the global torch / numpy / python RNGs (model init, dropout) from one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def device_generator(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded by one draw from the phase's CPU generator.

    Noise drawn with it is generated on the GPU (no host randn, no copy), yet the whole stream is still
    fixed by the CPU generator, which is what checkpoints save: a resumed run draws the same noise.
    On the CPU this is the CPU generator itself (results identical to drawing from it directly).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)
