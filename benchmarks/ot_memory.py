"""Measure the peak memory of one batched Sinkhorn velocity step; check sinkhorn_peak_bytes bounds it.

CPU: the torch profiler's allocation events (profile_memory=True), summed in time order.
CUDA (if present): torch.cuda.max_memory_allocated around the same call.
Prints measured peak / (4 B n^2) and / (4 B n D), and measured / estimated (must stay <= 1).

    python benchmarks/ot_memory.py
    python benchmarks/ot_memory.py --cases 1,16,2 2,8,4     # other (B, n, D) cases, e.g. tiny ones
"""

from __future__ import annotations

import argparse
import platform

import torch

from sinkflow.ot import sinkhorn_peak_bytes
from sinkflow.ot.sinkhorn_peak import measured_cpu_peak_bytes
from sinkflow.ot.velocity import _velocity_solve as _velocity_flat

CASES = [(1, 256, 2), (4, 256, 2), (8, 128, 2), (4, 64, 784), (8, 64, 784), (2, 128, 3072), (4, 512, 2)]


def cpu_peak(B, n, D):
    # x and y are counted too: they stay live in the simulate loop
    return measured_cpu_peak_bytes(B, n, D, blur=0.5, scaling=0.9, diameter=10.0)


def cuda_peak(B, n, D):
    torch.cuda.empty_cache()
    x = torch.randn(B, n, D, device="cuda")
    y = torch.randn(B, n, D, device="cuda") + 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    v = _velocity_flat(x, y, 0.5, 0.9, 10.0, "tensorized")
    del v
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start + 4 * 2 * B * n * D


def case(text: str) -> tuple[int, int, int]:
    B, n, D = (int(v) for v in text.split(","))
    return B, n, D


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=case, nargs="+", default=CASES, metavar="B,n,D",
                    help="pool batches, points per batch, dimension (default: the documented cases)")
    args = ap.parse_args(argv)
    print(f"machine: {platform.platform()} | torch {torch.__version__} | "
          + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"))
    print("| device | B | n | D | peak MiB | peak/(4Bn^2) | peak/(4BnD) | peak/estimate |")
    print("|---|---|---|---|---|---|---|---|")
    devices = [("cpu", cpu_peak)] + ([("cuda", cuda_peak)] if torch.cuda.is_available() else [])
    for name, fn in devices:
        for B, n, D in args.cases:
            pk = fn(B, n, D)
            est = sinkhorn_peak_bytes(B, n, D)
            print(f"| {name} | {B} | {n} | {D} | {pk / 2**20:.2f} | {pk / (4 * B * n * n):.2f} "
                  f"| {pk / (4 * B * n * D):.2f} | {pk / est:.2f} |")


if __name__ == "__main__":
    main()
