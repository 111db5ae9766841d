"""Process-group facts for torchrun (DDP). A single process is rank 0 of a world of 1.

Under ``torchrun`` the environment carries RANK/WORLD_SIZE/LOCAL_RANK; ``init()`` joins the process
group (NCCL on CUDA, gloo on CPU). Everything else asks ``current()`` and never reads the environment.

Conventions every phase follows (docs/performance.md):
- ``train.*.batch_size`` is the batch of ONE process; the global batch is ``batch_size * world``.
  The phase generator draws the whole global batch and each rank keeps its ``shard``, so a run on
  N processes sees exactly the batches of one process with an N-times larger batch_size.
- Only rank 0 writes files (checkpoints, logs, plots, the run folder; each rank writes its own pool chunks into
  the shared memmap); the others wait at barriers, and a failure there is agreed (``on_main``).
- Decisions that end a loop (a signal, an error) are agreed by all ranks (``agree_stop``), or the
  ranks that go on would wait forever in the next collective. For the same reason every rank must run the same
  config: ``check_same`` compares them before any folder or work.
"""

from __future__ import annotations

import math
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as tdist

from sinkflow.errors import SinkflowError


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


def grouped() -> bool:
    """Is this process in a process group (torchrun's, of two or more: ``init``; or one made by hand)?"""
    return tdist.is_available() and tdist.is_initialized()


def per_node() -> int:
    """Processes on each node (torchrun's LOCAL_WORLD_SIZE): fewer than the world on a multi-node job."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or current().world)


def current() -> DistInfo:
    if grouped():
        return DistInfo(tdist.get_rank(), tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return DistInfo()


def init(device: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun; a no-op otherwise.

    NCCL when the run uses CUDA, gloo for ``--device cpu`` (how the DDP path is tested without GPUs).
    ``torch.cuda.set_device`` comes first so no rank touches GPU 0 by accident.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not tdist.is_initialized():
        use_nccl = not str(device).startswith("cpu") and torch.cuda.is_available()
        if use_nccl:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        tdist.init_process_group("nccl" if use_nccl else "gloo")
    info = current()
    if not info.is_main:  # one voice: only rank 0 prints progress messages
        logging.getLogger("sinkflow").setLevel(logging.WARNING)
        # and the data's warnings (a point file's scale, a folder's left-out images): every rank reads the same data
        # (check_ranks_agree), and 8 GPUs printed each 8 times; its errors still stop every rank in one line
        logging.getLogger("sinkflow.data").setLevel(logging.ERROR)
    return info


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


def all_gather_object(obj: Any) -> list:
    """Every rank's ``obj``, in rank order, on every rank; ``[obj]`` alone."""
    if not current().enabled:
        return [obj]
    every: list = [None] * current().world
    tdist.all_gather_object(every, obj)
    return every


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s value of ``obj`` on every rank (e.g. the run folder name rank 0 chose)."""
    if not current().enabled:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def on_main(work: Callable[[], Any]) -> Any:
    """``work()`` on rank 0 only, its outcome agreed by every rank: its result, or its one-line error raised on every
    rank. A rank-0-only step that fails (the run folder's lock held by another process, a folder it cannot write)
    otherwise left the other ranks waiting in the next collective until the store closed, and their gloo/NCCL
    tracebacks buried the one line. An out-of-memory error is agreed too: rank 0's own work on the device (NSGF++'s
    states, ``NSGFStates``) printed its OOM line and each other rank the lost-peer line beside it."""
    info = current()
    if not info.enabled:
        return work()
    result, failure = None, None
    if info.is_main:
        try:
            result = work()
        except (SinkflowError, OSError, torch.OutOfMemoryError) as exc:
            failure = exc
    said = broadcast_object(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if said is not None:
        raise SinkflowError(f"rank 0 stopped: {said}", every_rank=True)  # rank 0 prints its own line
    return result


def on_every(work: Callable[[], Any]) -> Any:
    """``work()`` (a check that runs no collective) on every rank, its outcome agreed: its result, or a one-line
    error raised on every rank and printed once, by rank 0 (its own, else the first failing rank's, named). Checks
    that every rank runs alike (the config they share, a resume's checkpoints) printed their line once a rank."""
    if not current().enabled:
        return work()
    result, failure = None, None
    try:
        result = work()
    except SinkflowError as exc:
        failure = exc
    said = all_gather_object(None if failure is None else str(failure))
    first = next((rank for rank, line in enumerate(said) if line is not None), None)
    if first is None:
        return result
    if failure is not None:  # rank 0 prints its own line; another rank's stays silent, named by rank 0's below
        failure.every_rank = True
        raise failure
    raise SinkflowError(f"rank {first} stopped: {said[first]}", every_rank=True)


def stop_rank(signum: int | None) -> int:
    """``signum`` as the ranks' agreement orders it (the largest wins): a real signal (SIGTERM, SIGINT) over the time
    limit over a callback's ``request_stop`` over a callback's ``stop``; the signal number itself in the low bits. By
    the bare numbers SIGINT (2) lost to the request's code (10) and the time limit's (14): a Ctrl+C on one rank was
    reported as another rank's request, with its exit status."""
    if not signum:
        return 0
    from sinkflow.runtime.signals import QUIET, REQUESTED, TIME_LIMIT

    return {QUIET: 1, REQUESTED: 2, TIME_LIMIT: 3}.get(signum, 4) << 16 | signum


def stop_code(ranked: int) -> int | None:
    """The signal number of ``stop_rank``'s value (None for none)."""
    return (ranked & 0xFFFF) or None


def agree_stop(signum: int | None) -> int | None:
    """A stop seen by any rank stops every rank at the same step (the first in ``stop_rank``'s order)."""
    if not current().enabled:
        return signum
    flag = torch.tensor([stop_rank(signum)], dtype=torch.int64, device=_collective_device())
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    return stop_code(int(flag.item()))


def agree_stop_paced(signum: int | None, pace: int) -> tuple[int | None, int]:
    """``agree_stop`` in the same one collective as the steps until the next agreement: the fewest any rank
    proposes (``pace``: the steps it takes in a few seconds). Every rank gets the same two numbers, so they meet at
    the same next step."""
    flag = torch.tensor([stop_rank(signum), -max(int(pace), 1)], dtype=torch.int64, device=_collective_device())
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    stop, steps = flag.tolist()
    return stop_code(stop), -steps


# keys ``check_same`` may be given as absolute paths (the caller resolves them), and the working directory's key
PATH_KEYS = ("data.path", "data.root", "data.source", "data.target", "experiment.runs_dir")
CWD = "(working directory)"


def check_same(values: dict[str, Any]) -> None:
    """Every rank's ``values`` (its resolved config, flattened) equal rank 0's, or every rank stops with one line
    naming the first differing key and the ranks. Ranks started with different options (a wrapper giving one rank
    --train-iters 60 and another 80) ran different loops: rank 0 finished step 60 and waited forever in a
    collective rank 1 never reached. Nothing in a config is per rank (each rank's GPU comes from LOCAL_RANK,
    ``device_for``, not from ``experiment.device``), so every key must agree."""
    info = current()
    if not info.enabled:
        return
    every = all_gather_object({k: repr(v) for k, v in values.items()})  # repr: a NaN equals itself
    keys = dict.fromkeys(k for r in every for k in r)  # rank 0's order first: the caller's (keys a run reads first)
    differ = [k for k in keys if k != CWD and len({r.get(k) for r in every}) > 1]  # the folder: to explain, only
    if not differ:
        return
    key = differ[0]
    mine = every[0].get(key, "unset")
    others = [f"{r.get(key, 'unset')} on rank {i}" for i, r in enumerate(every) if r.get(key) != every[0].get(key)]
    more = f" (and {len(differ) - 1} more key{'s' if len(differ) > 2 else ''})" if len(differ) > 1 else ""
    problem = (f"the {info.world} processes of this torchrun job were started with different options: {key} is "
               f"{mine} on rank 0 but {', '.join(others[:4])}{', ...' if len(others) > 4 else ''}{more}")
    if key in PATH_KEYS and len({r.get(CWD) for r in every}) > 1:  # the same relative path, in different folders
        raise SinkflowError(f"{problem}: the nodes were started in different working directories",
                            "start every node in the same folder, or give absolute paths (experiment.runs_dir, "
                            "data.root, ...); nothing was written", every_rank=True)
    raise SinkflowError(f"{problem}, so they would wait on each other forever",
                        "start every rank with the same command and options (torchrun runs one command for all of "
                        "them: a wrapper script must not add per-rank options); nothing was written", every_rank=True)


def leave_after_stop() -> DistInfo:
    """After an agreed stop (every rank raised ``Interrupted`` at the same step): wait for every rank, then leave
    the process group; returns this rank's info. torchrun ends the ranks still running with SIGTERM as soon as one
    exits non-zero, which killed the slower rank mid-exit (a SIGABRT from gloo's threads, a crash report), so the
    stop is agreed first and that late SIGTERM is ignored: every rank exits 128+signal on its own."""
    info = current()
    if not info.enabled:
        return info
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop is saved: torchrun's closing signal changes nothing
    tdist.barrier()  # rank 0 has written its checkpoint, status.json and logs
    leave()
    return info


def leave() -> None:
    """Leave the process group before the process exits (``sinkflow.cli.main``, on every way out). A rank that
    exited still in the group could abort in gloo's threads ("terminate called without an active exception",
    SIGABRT), and torchrun's report then blamed that rank."""
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def lr_scale(rule: str, world: int) -> float:
    """Learning-rate factor when the global batch grows with the number of processes (``train.*.lr_scaling``)."""
    if rule == "none" or world == 1:
        return 1.0
    if rule == "linear":
        return float(world)
    if rule == "sqrt":
        return math.sqrt(world)
    raise SinkflowError(f"unknown lr_scaling rule '{rule}'", "use none, linear or sqrt")


def any_over_ranks(flag: torch.Tensor) -> torch.Tensor:
    """A boolean device tensor OR-ed over ranks, on the device (no host sync); itself when alone."""
    if not current().enabled:
        return flag
    t = flag.to(device=_collective_device(), dtype=torch.int32)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.to(flag.device).bool()


def mean_over_ranks(value: float) -> float:
    """The mean of a per-rank scalar (e.g. the shard's loss) over all ranks; itself when alone."""
    if not current().enabled:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    tdist.all_reduce(t)
    return float(t.item()) / current().world


def _collective_device() -> torch.device:
    """NCCL only reduces CUDA tensors; gloo takes CPU ones."""
    if tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


PEER_LOST = "another process of this torchrun job stopped or stopped answering"


def peer_lost(exc: BaseException) -> bool:
    """Is ``exc`` a collective that failed because another rank of a multi-process job went away (killed, or
    stopped on its own error)? The surviving ranks printed a gloo/NCCL traceback wall over the one line that matters
    (the CLI's), and their failed heartbeat kept gloo's raw text for `sinkflow status`."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return isinstance(exc, getattr(tdist, "DistError", ())) or any(  # a frozen rank: the backend's timeout
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting"))
