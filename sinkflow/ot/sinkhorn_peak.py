"""How much memory one batched Sinkhorn velocity step takes, and how many pool batches fit a budget.

The tensorized GeomLoss solve for B pool batches stacks the (x, y) and (x, x) problems into a
(2B, n, n) batch. Its transient peak, measured with the torch profiler's allocation events on CPU
(``python benchmarks/ot_memory.py``; see docs/ot.md), is

    peak = 4 bytes * (C_NN * B * n^2 + C_ND * B * n * D)

with C_NN ~= 10.0 (two stored cost matrices for 2B problems = 4 B n^2, plus the logsumexp
temporaries and the autograd buffers of the last extrapolation step) and C_ND ~= 12.0 (stacked copies
of the clouds, the gradient and the velocity). The constants below are rounded up and add the
simulate loop's own state (current x, y: 2 B n D floats), so the estimate is an upper bound for one
step of ``simulate_sinkhorn_flow``. The pool storage itself (xs, vs) is not included.
"""

from __future__ import annotations

from sinkflow.errors import SinkflowError

C_NN = 10.5  # float32 (n x n) buffers live at the peak, per pool batch
C_ND = 14.0  # float32 (n x D) buffers live at the peak, per pool batch
OVERHEAD_BYTES = 1 << 20  # weights, potentials, allocator slack


def sinkhorn_peak_bytes(batch: int, n: int, dim: int, dtype_bytes: int = 4) -> int:
    """Upper bound on the peak bytes of one batched velocity step for ``batch`` pool batches of n points in dim D."""
    return int(dtype_bytes * (C_NN * batch * n * n + C_ND * batch * n * dim)) + OVERHEAD_BYTES


def max_batches_in_flight(n: int, dim: int, budget_bytes: int, dtype_bytes: int = 4) -> int:
    """Largest number of pool batches B whose batched solve fits ``budget_bytes``.

    Raises SinkflowError when not even one batch fits, since the pool cannot be built then.
    """
    per_batch = dtype_bytes * (C_NN * n * n + C_ND * n * dim)
    free = budget_bytes - OVERHEAD_BYTES
    if free < per_batch:
        need = (per_batch + OVERHEAD_BYTES) / 2**20
        raise SinkflowError(
            f"one Sinkhorn pool batch (n={n}, D={dim}) needs about {need:.1f} MiB "
            f"but the memory budget is {budget_bytes / 2**20:.1f} MiB",
            "lower the pool batch size n or raise the memory budget",
        )
    return int(free // per_batch)


def cpu_peak_bytes(fn) -> int:
    """Peak of the bytes allocated (minus freed) while ``fn()`` runs, from the torch profiler's CPU
    allocation events in time order. Tensors alive before the call are not counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def measured_cpu_peak_bytes(batch: int, n: int, dim: int, blur: float = 0.5, scaling: float = 0.9,
                            diameter: float = 10.0) -> int:
    """Peak bytes of one batched velocity solve on CPU, plus x and y: what ``sinkhorn_peak_bytes``
    estimates; the test and benchmarks/ot_memory.py compare the two."""
    import torch

    from sinkflow.ot.velocity import _velocity_solve

    x, y = torch.randn(batch, n, dim), torch.randn(batch, n, dim) + 1
    peak = cpu_peak_bytes(lambda: _velocity_solve(x, y, blur, scaling, diameter, "tensorized"))
    return peak + x.nbytes + y.nbytes
