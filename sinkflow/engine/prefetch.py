"""Batches drawn one step ahead on a background thread, so the training thread never waits for them.

A phase's batch (pool gathers, image sampling and augmentation, OT-CFM's exact minibatch OT plan, the
host-to-device copy) is drawn from the phase's own generator. ``BatchPrefetcher`` draws batch k + 1 on one
worker thread while step k runs, in the same order and from the same generator as drawing inline, so the
batches are identical (tested). What a resume needs is the generator state *before the first batch not yet
trained on*; the prefetcher snapshots it before every draw it starts (``generator_state``), so a checkpoint
written while batch k + 1 is in flight resumes with batch k + 1, bit for bit.

On CUDA the worker draws on its own stream and the training stream waits on an event recorded after the
draw, so the copy overlaps compute; the batch's tensors are marked as used by the training stream so the
caching allocator does not hand their memory back to the worker too early. POT's EMD solver and torch's
kernels release the GIL, so the OT plan of OT-CFM (and NSGF++'s NSF pairs) is computed off the critical path.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch


def tensors(batch: Any):
    """Every tensor of a tensor / tuple / list / dict batch."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from tensors(v)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            yield from tensors(v)


class BatchPrefetcher:
    """``next(more)`` returns the next batch of ``draw()``; with ``ahead`` the following one is already being
    drawn on a worker thread (when ``more`` says another will be wanted). ``draw`` must take all its
    randomness from ``generator`` (the phase generator), which nothing else may touch while this is open."""

    def __init__(self, draw: Callable[[], Any], generator: torch.Generator, device: torch.device, ahead: bool):
        self.draw, self.generator, self.device = draw, generator, torch.device(device)
        self.ahead = ahead
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[torch.Tensor, Future] | None = None
        self._stream = None
        self.draw_s, self.draws = 0.0, 0  # time the worker spent drawing, and how many draws (bench reads them)

    def generator_state(self) -> torch.Tensor:
        """The generator state from which the next batch the loop has not consumed is drawn (checkpoints)."""
        return self._pending[0] if self._pending is not None else self.generator.get_state()

    def next(self, more: bool = True) -> Any:
        """The next batch; if ``more``, start drawing the one after it."""
        if not self.ahead:
            return self.draw()
        if self._pending is None:
            self._submit()
        _, future = self._pending
        self._pending = None
        batch, event = future.result()  # an exception of the draw is raised here, on the training thread
        if more:
            self._submit()
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in tensors(batch):
                if t.device.type == "cuda":
                    t.record_stream(stream)
        return batch

    def _submit(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sinkflow-prefetch")
            if self.device.type == "cuda":
                self.device = indexed(self.device)
                self._stream = torch.cuda.Stream(self.device)
        state = self.generator.get_state()  # the worker is idle here: the last draw has been consumed
        self._pending = (state, self._pool.submit(self._draw_one))

    def _draw_one(self) -> tuple[Any, Any]:
        start = time.perf_counter()
        try:
            if self._stream is None:
                return self.draw(), None
            torch.cuda.set_device(self.device)  # the current device is per thread
            with torch.cuda.stream(self._stream):
                batch = self.draw()
                event = torch.cuda.Event()
                event.record(self._stream)
            return batch, event
        finally:
            self.draw_s, self.draws = self.draw_s + time.perf_counter() - start, self.draws + 1

    def close(self) -> None:
        """Wait for a draw in flight (its batch is dropped; ``generator_state`` still points before it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N``, N the calling thread's current device: the worker thread's ``set_device`` refuses
    an index-less device (a ValueError on an H100, torch 2.11; a plain ``cuda`` run died on its first step)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_prefetch(setting: str, device: torch.device) -> bool:
    """``train.<phase>.prefetch``: ``auto`` draws ahead on CUDA only (on a CPU the worker would compete with the
    step for the same cores and the GIL: measured in docs/performance.md), ``always`` / ``never`` force it."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "always"
