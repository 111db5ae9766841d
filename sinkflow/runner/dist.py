"""Process-group facts for torchrun (DDP). A single process is rank 0 of a world of 1.

Under ``torchrun`` the environment carries RANK/WORLD_SIZE/LOCAL_RANK; ``init()`` joins the process
group (NCCL on CUDA, gloo on CPU). Everything else asks ``current()`` and never reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def current() -> DistInfo:
    if tdist.is_available() and tdist.is_initialized():
        return DistInfo(tdist.get_rank(), tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return DistInfo()


def init(device: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun; a no-op otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not tdist.is_initialized():
        use_nccl = device != "cpu" and torch.cuda.is_available()
        if use_nccl:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        tdist.init_process_group("nccl" if use_nccl else "gloo")
    return current()


def device_for(info: DistInfo, device: torch.device) -> torch.device:
    """Each rank takes its own GPU."""
    if device.type == "cuda" and info.enabled:
        return torch.device("cuda", info.local_rank)
    return device


def barrier() -> None:
    if current().enabled:
        tdist.barrier()


def shard(tensor: torch.Tensor, info: DistInfo | None = None) -> torch.Tensor:
    """This rank's disjoint slice of a globally drawn batch (rows rank, rank+world, ...)."""
    info = info or current()
    return tensor[info.rank :: info.world] if info.enabled else tensor
