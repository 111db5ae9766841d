"""Batches made ahead on background threads, so the training thread never waits for them.

A phase's batch (pool gathers, image sampling and augmentation, OT-CFM's exact minibatch OT plan, the
host-to-device copy) is drawn from the phase's own generator. ``BatchPrefetcher`` makes batches k + 1 and k + 2
on worker threads while step k runs, in the same order and from the same generator as drawing inline, so the
batches are identical (tested). A task may split its batch into a ``draw`` (everything that reads the generator)
and a ``prepare`` (the rest: OT-CFM's plan, NSGF++'s NSF pairs): the draws run one after another in batch order,
and batch k + 1's prepare overlaps batch k + 2's draw, so a step faster than one whole batch's making does not wait
(on an H100 the `mnist` OT-CFM batch took 7.7 ms on one worker while the step took 10). What a resume needs is the
generator state *before the first batch not yet trained on*; each worker records it before its draw
(``generator_state``), so a checkpoint written while later batches are in the making resumes with the first of
them, bit for bit.

On CUDA each worker works on its own stream and the training stream waits on an event recorded after the batch,
so the copies overlap compute; the batch's tensors are marked as used by the training stream so the caching
allocator does not hand their memory back to the worker too early. The exact OT solver and torch's kernels release
the GIL, so the OT plan is computed off the critical path.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
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


DEPTH = 2  # batches in the making beside the one the step trains on (the memory planner counts them)


class _Pending:
    """One batch in the making: the generator state its draw starts from, and whether the draw is done."""

    def __init__(self):
        self.state: torch.Tensor | None = None
        self.started = False
        self.drawn = threading.Event()
        self.future: Future | None = None


class BatchPrefetcher:
    """``next(wanted)`` returns the next batch, ``prepare(draw())``; with ``ahead``, up to ``depth`` following
    batches are already being made on worker threads (no more than the ``wanted`` the loop says it will still take).
    ``draw`` must take all its randomness from ``generator`` (the phase generator), which nothing else may touch while
    this is open; ``prepare`` (default: none) finishes a drawn batch without reading it.

    The draws run one at a time in batch order (each waits until the previous one is drawn), so the generator is read
    exactly as inline; a batch's ``prepare`` (OT-CFM's exact plan) runs on its worker while the next batch is drawn
    on another, so the two stages of consecutive batches overlap."""

    def __init__(self, draw: Callable[[], Any], generator: torch.Generator, device: torch.device, ahead: bool,
                 prepare: Callable[[Any], Any] | None = None, depth: int = DEPTH):
        self.draw, self.generator, self.device = draw, generator, torch.device(device)
        self.prepare = prepare if prepare is not None else (lambda drawn: drawn)
        self.ahead, self.depth = ahead, max(1, int(depth))
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[_Pending] = deque()
        self._last: _Pending | None = None  # the latest batch submitted: the next one's draw waits for its draw
        self._lock = threading.Lock()  # a draw's start (its generator state) against generator_state()
        self._streams = threading.local()  # each worker's own CUDA stream
        self.draw_s, self.draws = 0.0, 0  # workers' time per batch made (draw + prepare), and how many (bench)

    def generator_state(self) -> torch.Tensor:
        """The generator state from which the next batch the loop has not consumed is drawn (checkpoints)."""
        with self._lock:
            if self._pending and self._pending[0].started:
                return self._pending[0].state
            # not started: no later batch has (the draws go in order), and every earlier one is drawn
            return self.generator.get_state()

    def next(self, wanted: int = 1) -> Any:
        """The next batch; then keep up to ``depth`` batches in the making, but never more than the ``wanted``
        (how many more the loop will take after this one: 0 at the last step)."""
        if not self.ahead:
            return self.prepare(self.draw())
        if not self._pending:
            self._submit()
        pending = self._pending.popleft()
        while len(self._pending) < min(self.depth, wanted):  # before waiting: its prepare overlaps their draws
            self._submit()
        batch, event = pending.future.result()  # an exception of the draw is raised here, on the training thread
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in tensors(batch):
                if t.device.type == "cuda":
                    t.record_stream(stream)
        return batch

    def _submit(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="sinkflow-prefetch")
            if self.device.type == "cuda":
                self.device = indexed(self.device)
        pending, previous = _Pending(), self._last
        pending.future = self._pool.submit(self._make, pending, previous)
        self._pending.append(pending)
        self._last = pending

    def _make(self, pending: _Pending, previous: _Pending | None) -> tuple[Any, Any]:
        if previous is not None:
            previous.drawn.wait()
        with self._lock:
            pending.state, pending.started = self.generator.get_state(), True
        start = time.perf_counter()
        try:
            with self._on_stream() as stream:
                drawn = self.draw()
                pending.drawn.set()
                batch = self.prepare(drawn)
                event = None
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
            return batch, event
        finally:
            pending.drawn.set()  # also after a failed draw: the next batch must not wait for ever
            with self._lock:
                self.draw_s, self.draws = self.draw_s + time.perf_counter() - start, self.draws + 1

    @contextlib.contextmanager
    def _on_stream(self):
        """On CUDA, this worker thread's own stream (the training stream waits on an event recorded after it)."""
        if self.device.type != "cuda":
            yield None
            return
        torch.cuda.set_device(self.device)  # the current device is per thread
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            yield stream

    def close(self) -> None:
        """Wait for the batches in the making (they are dropped; ``generator_state`` still points before them)."""
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
