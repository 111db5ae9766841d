"""How much of the 1024-point W2 on 8gaussians is the draw's mode counts (issue 10, docs/nsgf.md).

Samples of the exact target (the true 8 Gaussians, nothing learned) whose only error is how many points each mode
gets, scored like the 2D benchmark: exact W2 (POT) against the stratified 1024-point test draws, which hold
exactly 128 points per mode. "moved m" reassigns m random points of a stratified draw to another random mode
(sum of |n_k - 128| = 2m); "multinomial" is an i.i.d. draw of the mode labels.

    python benchmarks/w2_mode_counts.py [--n 1024] [--draws 10]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from sinkflow import config, data
from sinkflow.data.toy2d import EIGHT_CENTRES
from sinkflow.ot import w2


def exact_sample(labels: torch.Tensor, gen: torch.Generator, radius: float = 5.0, std: float = math.sqrt(0.1)):
    noise = torch.randn(len(labels), 2, generator=gen, dtype=torch.float64)
    return (radius * EIGHT_CENTRES[labels] + std * noise).float()


def labels_with_moves(n: int, moved: int, gen: torch.Generator) -> torch.Tensor:
    labels = torch.arange(n) % 8
    idx = torch.randperm(n, generator=gen)[:moved]
    labels[idx] = (labels[idx] + torch.randint(1, 8, (moved,), generator=gen)) % 8  # always another mode
    return labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--draws", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, target = data.distributions(config.resolve("8gaussians"))
    cases = [(f"moved {m}", lambda g, m=m: labels_with_moves(args.n, m, g)) for m in (0, 2, 4, 8, 16)]
    cases.append(("multinomial", lambda g: torch.randint(0, 8, (args.n,), generator=g)))
    print(f"| exact-target sample, n = {args.n} | sum of abs(n_k - n/8) | W2 to the stratified test draw |")
    print("|---|---|---|")
    for name, make in cases:
        w, imbalance = [], []
        for d in range(args.draws):
            gen = torch.Generator().manual_seed(100 + d)
            labels = make(gen)
            imbalance.append(int((torch.bincount(labels, minlength=8) - args.n / 8).abs().sum()))
            w.append(w2(exact_sample(labels, gen), target.test_set(args.n, seed=2000 + d)))
        print(f"| {name} | {statistics.fmean(imbalance):.1f} | {statistics.fmean(w):.3f} ± {statistics.stdev(w):.3f} |")


if __name__ == "__main__":
    main()
