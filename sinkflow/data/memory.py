"""Will ``n`` samples fit in this machine's RAM? Asked before any work by `sinkflow sample` / `eval` and by the
API's ``Run.evaluate`` alike (an ``n`` of 10 million ground for 10 minutes to 7.7 GB before it was stopped)."""

from __future__ import annotations

import math
import os

from sinkflow.errors import SinkflowError, human_bytes


def available_memory() -> int:
    """Bytes of RAM this process can still get (MemAvailable; total RAM where /proc is not there)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Bytes per (sample, test point) pair of an exact W2 (POT's emd2 on n x n points): the float64 cost matrix, the
# float64 transport plan and the network simplex's arcs (source, target, cost, flow, state). Measured: the peak RSS
# rises 40.8-41.1 n^2 bytes at n = 1,000-6,000 (getrusage, 2026-11-30); 8, the cost matrix alone, was 5x short.
EXACT_W2_PAIR_BYTES = 48


def check_sample_memory(n: int, cfg: dict, flag: str = "--n", exact_w2: bool = False, grid_bytes: int = 0) -> None:
    """Refuse ``n`` samples that cannot fit in memory, before any work: the samples and their source noise
    (float32, x4 for the working copies), plus an exact W2's n x n working set (``EXACT_W2_PAIR_BYTES``) for points,
    plus ``grid_bytes`` for a PNG grid of them (``eval.images.grid_bytes``)."""
    from sinkflow import data

    dim = math.prod(data.sample_shape(cfg))
    need = 4 * n * dim * 4 + (EXACT_W2_PAIR_BYTES * n * n if exact_w2 else 0) + grid_bytes
    have = available_memory()
    if need > have:
        what = ("samples and an exact-W2 cost matrix" if exact_w2 else "samples and their PNG grid" if grid_bytes
                else "samples")
        raise SinkflowError(f"{flag} {n} needs about {human_bytes(need)} of memory for its {what} but this machine "
                            f"has {human_bytes(have)} available", f"use a smaller {flag}" + (
                                ", or --out DIR/ (one PNG per image) or a .npy file" if grid_bytes else ""))
