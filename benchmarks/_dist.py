"""A process group of this one process, for the scripts that check and time a torchrun job's captured step on one
card (``sinkflow.engine.grad_sync``: the trainer in any process group averages a captured step's gradients by one
all-reduce between two graphs; in a group of one NCCL still runs the collective, so its cost and the two graphs'
show on a single GPU)."""

from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as tdist


@contextlib.contextmanager
def group_of_one(device: torch.device):
    """NCCL on a card, gloo on the CPU; the group is destroyed on the way out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tdist.init_process_group("nccl" if torch.device(device).type == "cuda" else "gloo", rank=0, world_size=1,
                             init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        tdist.destroy_process_group()
