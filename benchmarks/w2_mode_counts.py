"""How much of the 1024-point W2 on 8gaussians is the draw's mode counts (issue 10, docs/nsgf.md).

Samples of the exact target (the true 8 Gaussians, nothing learned) whose only error is how many points each mode
gets, scored like the 2D benchmark: exact W2 (POT) against the stratified 1024-point test draws, which hold
exactly 128 points per mode. "moved m" reassigns m random points of a stratified draw to another random mode
(sum of |n_k - 128| up to 2m: moves can cancel); "multinomial" is an i.i.d. draw of the mode labels. With --runs,
also the imbalance of trained 8gaussians runs' own evaluation draws (the 2D benchmark's sampling seeds 1000..,
modes by nearest centre), so the two can be compared.

    python benchmarks/w2_mode_counts.py [--n 1024] [--draws 10] [--runs RUN ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from sinkflow import config, data
from sinkflow.data.toy2d import EIGHT_CENTRES
from sinkflow.ot import w2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import at_least  # noqa: E402

MOVES = (0, 2, 4, 8, 16)  # points reassigned to another mode in the "moved m" rows


def exact_sample(target, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The target's own mixture (its radius and std) with the given mode of every point."""
    noise = torch.randn(len(labels), 2, generator=gen, dtype=torch.float64)
    return (target.radius * EIGHT_CENTRES[labels] + target.std * noise).float()


def imbalance(target, x: torch.Tensor) -> int:
    """Sum over the modes of |points nearest that centre - n/8|."""
    modes = torch.cdist(x.double(), target.radius * EIGHT_CENTRES).argmin(1)
    return int((torch.bincount(modes, minlength=8) - len(x) / 8).abs().sum())


def labels_with_moves(n: int, moved: int, gen: torch.Generator) -> torch.Tensor:
    labels = torch.arange(n) % 8
    idx = torch.randperm(n, generator=gen)[:moved]
    labels[idx] = (labels[idx] + torch.randint(1, 8, (moved,), generator=gen)) % 8  # always another mode
    return labels


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=at_least(max(MOVES)), default=1024,
                    help=f"points per draw (>= {max(MOVES)}: the largest row moves that many)")
    ap.add_argument("--draws", type=at_least(2), default=10, help="draws per row (>= 2: each row gives a std)")
    ap.add_argument("--runs", nargs="*", default=[], help="trained 8gaussians run folders to count")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _, target = data.distributions(config.resolve("8gaussians"))
    cases = [(f"moved {m}", lambda g, m=m: labels_with_moves(args.n, m, g)) for m in MOVES]
    cases.append(("multinomial", lambda g: torch.randint(0, 8, (args.n,), generator=g)))
    print(f"| exact-target sample, n = {args.n} | sum of abs(n_k - n/8) | W2 to the stratified test draw |")
    print("|---|---|---|")
    for name, make in cases:
        w, off = [], []
        for d in range(args.draws):
            gen = torch.Generator().manual_seed(100 + d)
            x = exact_sample(target, make(gen), gen)
            off.append(imbalance(target, x))
            w.append(w2(x, target.test_set(args.n, seed=2000 + d)))
        print(f"| {name} | {statistics.fmean(off):.1f} | {statistics.fmean(w):.3f} ± {statistics.stdev(w):.3f} |")
    if args.runs:
        from sinkflow.eval.points import generate
        from sinkflow.runtime.run_folder import RunFolder

        print("\n| run | steps | imbalance per sampling seed (1000, 1001, 1002) |\n|---|---|---|")
        for folder in args.runs:
            run = RunFolder.open(folder)
            for steps in (10, 100):
                off = [imbalance(target, generate(run, args.n, steps, seed=1000 + s)[0]) for s in range(3)]
                print(f"| {folder} | {steps} | {', '.join(map(str, off))} |")


if __name__ == "__main__":
    main()
