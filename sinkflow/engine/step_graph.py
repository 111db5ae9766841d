"""The whole optimizer step as one CUDA graph (``train.<phase>.graph: step``).

Why: a small network's step is launch-bound. ``compile_mode=reduce-overhead`` graphs the model's forward and
backward, but the loss, the gradient clip, the non-finite guard and Adam still launch kernel by kernel from
Python, and CUDA-graph trees check the graphs' outputs every step: on the ``mnist`` preset the GPU was busy 34-46 %
of a step on an H100 (docs/gpu_results/h100_2026-11-26b.md). Captured whole, a step is one ``graph.replay()``.

How (PyTorch's whole-network capture, "CUDA Graphs" in its docs): every batch is copied into static tensors
(allocated from the first batch); the first ``WARMUP`` steps run eagerly on a side stream (they are real training
steps: they create Adam's state, compile a compiled model and let cuBLAS / cuDNN choose their kernels); the next
step is captured and replayed, every later one is a replay. What changes between steps without a kernel of its own
enters through device tensors written before each replay: the learning rate (the schedule, lr-find) and the step
number (the non-finite guard's record). Adam is the fused kernel, which takes the guard's skip flag on the device
(``found_inf``), so a replayed step never applies a non-finite update, exactly as an eager one. Autocast runs
without its weight-cast cache (a cached cast would outlive the capture).

On a CPU nothing is captured: the same step runs eagerly on the same static tensors (the CPU suite runs this path).
What a replay skips: Python forward hooks (``Health`` counts dead activations on a probe forward instead:
``Trainer.probe_forward``) and anything the step would read back to the host (none: ``sinkflow.engine.finite``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sinkflow.errors import SinkflowError

WARMUP = 3  # eager steps before the capture (PyTorch's recipe: "a few"; DDP would need 11: grad_sync.py is none)


def _static_copy(batch: Any, phase: str) -> Any:
    """Fresh tensors shaped, typed and laid out as ``batch``'s, holding its values."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone(memory_format=torch.preserve_format)
    if isinstance(batch, dict):
        return {k: _static_copy(v, phase) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_static_copy(v, phase) for v in batch)
    raise SinkflowError(f"a captured step needs a batch of tensors, got a {type(batch).__name__}",
                        f"set train.{phase}.graph=none")


def _fill(static: Any, batch: Any, phase: str) -> None:
    """Copy ``batch`` into the static tensors (the same structure and shapes: a fixed-shape phase)."""
    if isinstance(static, torch.Tensor):
        if batch.shape != static.shape:
            raise SinkflowError(f"a captured step got a batch of shape {tuple(batch.shape)} after "
                                f"{tuple(static.shape)}", f"set train.{phase}.graph=none for a phase whose batches vary")
        static.copy_(batch, non_blocking=True)
    elif isinstance(static, dict):
        for k, v in static.items():
            _fill(v, batch[k], phase)
    else:
        for s, b in zip(static, batch, strict=True):
            _fill(s, b, phase)


def end_failed_capture(device: int, pool) -> None:
    """End what a capture whose ``capture_end`` raised left begun in the caching allocator. torch's
    ``CUDAGraph::capture_end`` checks ``cudaStreamEndCapture`` before it ends the allocator's routing to the graph's
    pool (``endAllocateToPool``), and its ``reset`` releases the pool only after a capture that ended: the capture
    stayed listed as underway for the rest of the process, and with it listed the allocator defers for good the free
    of every block used on a second stream (``record_stream``: each prefetched batch, a step's worth of memory every
    step) and fails ``TORCH_INTERNAL_ASSERT(captures_underway.empty())`` in ``empty_cache`` (``RunFolder.release``
    between phases, the next phase's ``torch.cuda.graph``). Ended and released here as torch's own
    ``_use_cuda_memory_pool_manager`` does; a capture that never began routing (no such pool underway) is left.
    Torch 2.4 to 2.7 have the call under its older name alone (``_cuda_endAllocateCurrentStreamToPool``, the same
    arguments; 2.8 has both): the new name raised AttributeError there, in place of the capture's own error."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or torch._C._cuda_endAllocateCurrentStreamToPool
    try:
        end(device, pool)
    except RuntimeError:  # "endAllocatePool: not currently recording to mempool_id"
        return
    torch._C._cuda_releasePool(device, pool)


class CaptureFailed(SinkflowError):
    """The step could not be recorded (a host read inside the model, an op CUDA graphs cannot hold). Nothing recorded
    ran, so no update was applied: ``graph: auto`` goes on without the graph (``Trainer._step``), ``graph: step``
    stops with this error."""

    @classmethod
    def of(cls, phase: str, exc: BaseException) -> CaptureFailed:
        """The line for phase ``phase``'s failed capture, naming the first line of ``exc``: the step's own error where
        it raised one (``StepGraph._capture``), not capture_end's after it."""
        what = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return cls(f"capturing phase '{phase}''s training step as a CUDA graph failed: {what}",
                   f"set train.{phase}.graph=none")


class StepGraph:
    """``StepGraph(update, optimizer, device)(batch, step) -> outputs``: ``update(batch, step)`` (forward, backward,
    clip, guard, optimizer; no host reads) run on static copies of the batches, as CUDA-graph replays on CUDA.

    ``step`` reaches ``update`` as a 0-dim int64 device tensor; the optimizer's learning rates are read from its
    param groups before every call (whoever set them: the schedule, lr-find). The outputs (0-dim tensors) are
    returned as copies: the next replay overwrites the graph's own.

    ``parts=(first, between, then)`` (a torchrun job's step, ``sinkflow.engine.grad_sync``): ``update`` split where
    it all-reduces the gradients, captured as two graphs in one memory pool, ``first(batch, step) -> carry`` (the
    forward and backward) and ``then(step, carry) -> outputs`` (clip, guard, optimizer), with ``between(carry)`` run
    eagerly between their replays. The warm-up steps and a CPU run ``update`` whole, which does the same."""

    def __init__(self, update: Callable[[Any, torch.Tensor], tuple], optimizer: torch.optim.Optimizer,
                 device: torch.device, phase: str = "velocity", parts: tuple[Callable, ...] | None = None):
        self.update, self.optimizer, self.device, self.phase = update, optimizer, torch.device(device), phase
        self.parts = parts
        self.captures = self.device.type == "cuda"
        self.static: Any = None
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)
        self.lrs = [torch.zeros((), dtype=torch.float32, device=self.device) for _ in optimizer.param_groups]
        self.graph = self.second = self.carry = None
        # warm-up and capture on a stream of CUDA's high-priority pool: torch.cuda.graph's own default capture
        # stream and every plain torch.cuda.Stream() (the prefetch workers', other phases') come round-robin from
        # the same pool of 32, so after a few phases in one process a worker's stream was the capture stream:
        # its draw was recorded into the graph and its event could not be waited on ("CUDA error: invalid
        # argument" on an H100, the 8th phase of one process, 2026-11-27)
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.captures else None
        self.outputs: tuple | None = None
        self.step_error: BaseException | None = None
        self.eager_steps = self.replays = 0

    def __call__(self, batch: Any, step: int) -> tuple:
        if self.static is None:
            self.static = _static_copy(batch, self.phase)
        else:
            _fill(self.static, batch, self.phase)
        self.step.fill_(step)
        if not self.captures:
            return self.update(self.static, self.step)
        for lr, group in zip(self.lrs, self.optimizer.param_groups):
            lr.fill_(float(group["lr"]))
        if self.graph is None and self.eager_steps < WARMUP:
            out = self._warmup()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            if self.second is not None:  # torchrun: the gradients' all-reduce between the two graphs
                self.parts[1](self.carry)
                self.second.replay()
            self.replays += 1
            out = self.outputs
        return tuple(o.clone() for o in out)

    def _warmup(self) -> tuple:
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = self.update(self.static, self.step)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.eager_steps += 1
        return out

    def _capture(self) -> None:
        """Record one step; Adam reads its learning rate from ``self.lrs`` while recording (as a tensor it is read
        at every replay) and is marked capturable only meanwhile (elsewhere it runs uncaptured, warm-up included)."""
        groups = self.optimizer.param_groups
        saved = [(g["lr"], g.get("capturable", False)) for g in groups]
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        pool = torch.cuda.graph_pool_handle()  # named here, so that a failed capture's routing to it can be ended
        self.step_error = None  # this capture's own: one left by an earlier capture's other error named this one
        try:
            for g, lr in zip(groups, self.lrs):
                g["lr"], g["capturable"] = lr, True
            self.optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients it reuses
            if self.parts is None:
                self.outputs = self._record(graph, pool, lambda: self.update(self.static, self.step))
            else:  # the backward, then (after the eager all-reduce, at each replay) the update, in one memory pool
                first, _, then = self.parts
                carry = self._record(graph, pool, lambda: first(self.static, self.step))
                second = torch.cuda.CUDAGraph()
                self.outputs = self._record(second, pool, lambda: then(self.step, carry))
                self.second, self.carry = second, carry
        except RuntimeError as exc:
            # torch.cuda.graph's __exit__ leaves its stream context unexited when capture_end raises (an invalidated
            # capture): the phase would go on with the capture stream as its current stream
            torch.cuda.set_stream(current)
            end_failed_capture(self.stream.device.index, pool)
            self.second = None
            named, self.step_error = self.step_error or exc, None
            if isinstance(named, torch.OutOfMemoryError):  # the step's memory, captured or not: the out-of-memory
                raise named  # line with its fixes (sinkflow.tools.oom), not a capture failure auto would train on past
            raise CaptureFailed.of(self.phase, named) from exc
        finally:
            for g, (lr, cap) in zip(groups, saved):
                g["lr"], g["capturable"] = lr, cap
        self.graph = graph

    def _record(self, graph, pool, step: Callable[[], Any]) -> Any:
        """``step()`` captured into ``graph``, its outputs returned. Where the step itself raised (a host read inside
        the capture), torch.cuda.graph's exit raises capture_end's own "operation failed due to a previous error"
        over it: the step's error is kept in ``step_error``, the one a failed capture names."""
        with torch.cuda.graph(graph, pool=pool, stream=self.stream, capture_error_mode="thread_local"):
            # thread_local: the prefetch worker keeps drawing (and copying) the next batch on its own stream meanwhile
            try:
                return step()
            except BaseException as exc:
                self.step_error = exc
                raise

    def invalidate(self) -> None:
        """The optimizer's state was loaded (``Trainer.load_state_dict``: lr-find's restore, a rollback): Adam's
        moments are new tensors now, which a replay of the old graph would not touch. The graph is dropped and the
        next step captures anew (the warm-up steps were taken already)."""
        self.graph = self.second = self.carry = self.outputs = None

    def release(self) -> None:
        """Free the graph, its private memory pool (the gradients the replays wrote included) and the static
        batch when the phase ends (``Trainer.fit``), whoever keeps the trainer (lr-find, doctor, a benchmark).
        Dropping ``update`` (a bound method of the Trainer) also breaks the trainer <-> graph reference cycle, so
        none of this waits for the cyclic garbage collector (``run_phases`` runs one between phases; a caller
        that did not, ``memory_estimate.py``, measured each phase on top of the previous phases' captured steps
        on an H100: 344 MiB -> 670 MiB -> 1.08 GiB over mnist's three phases)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = self.second = self.carry = self.static = self.outputs = self.update = self.parts = None
