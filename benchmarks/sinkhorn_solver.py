"""NSGF velocity solvers: accuracy against a converged float64 reference, and speed (pool entries per second).

For pool-shaped problems (B batches of n source and n target points of a 2D task), every solver computes the
velocity v = grad f(mu,mu) - grad f(mu,mu*) at the same points; the reference is sinkflow's log-domain solver in
float64, run to tol 1e-7 (up to 5000 iterations) at the same epsilon. Rows: GeomLoss at scaling 0.9 / 0.95 / 0.99
(one pass of epsilon-annealing) and ``solver=converged`` (annealing, then over-relaxed iterations to tol, on the
absorbed kernel; one row runs them in the log domain, as until 2026-11-27).
"entries/s" counts velocity entries (one particle at one flow step) per second on one thread, each row timed after
one untimed solve of its first batch.

    python benchmarks/sinkhorn_solver.py                  # moons, 8 batches of 256
    python benchmarks/sinkhorn_solver.py --task checkerboard --batches 4 --n 512
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

from sinkflow import config, methods
from sinkflow.ot.sinkhorn import converged_velocity
from sinkflow.ot.velocity import _velocity_flat
from sinkflow.errors import SinkflowError
from sinkflow.runtime.rng import phase_generator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402

ROWS = [
    ("GeomLoss, scaling 0.9", dict(scaling=0.9)),
    ("GeomLoss, scaling 0.95", dict(scaling=0.95)),
    ("GeomLoss, scaling 0.99", dict(scaling=0.99)),
    ("converged, scaling 0.8, <=30 iters, tol 1e-2 (2D preset until 2026-11-25)", dict(scaling=0.8, solver="converged",
                                                                                    max_iters=30, tol=1e-2)),
    ("converged, scaling 0.8, <=100 iters, tol 1e-2", dict(scaling=0.8, solver="converged", max_iters=100, tol=1e-2)),
    ("converged, scaling 0.8, <=200 iters, tol 1e-2, log-domain iterations (2D preset until 2026-11-27)",
     dict(scaling=0.8, solver="converged", max_iters=200, tol=1e-2, final="log")),
    ("converged, scaling 0.8, <=200 iters, tol 1e-2 (2D preset)", dict(scaling=0.8, solver="converged", max_iters=200,
                                                                   tol=1e-2)),
    ("converged, scaling 0.9, <=200 iters, tol 1e-3", dict(scaling=0.9, solver="converged", max_iters=200, tol=1e-3)),
]


def clouds(task: str, batches: int, n: int, progress: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool-like problems: particles ``progress`` of the way from source to an independent target draw."""
    source, target = methods.distributions(config.resolve(task))
    x0 = torch.stack([source.sample(n, phase_generator(0, "bench", b)) for b in range(batches)]).float()
    y = torch.stack([target.sample(n, phase_generator(1, "bench", b)) for b in range(batches)]).float()
    ys = torch.stack([target.sample(n, phase_generator(2, "bench", b)) for b in range(batches)]).float()
    return (1 - progress) * x0 + progress * ys, y


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="moons")
    p.add_argument("--batches", type=positive_int, default=8)
    p.add_argument("--n", type=positive_int, default=256)
    p.add_argument("--blur", type=float, default=0.1)
    p.add_argument("--progress", type=float, nargs="+", default=[0.0, 0.9], help="how far the particles are along")
    args = p.parse_args(argv)
    try:  # a task that is no preset, or one without a point target, refused before any solve
        methods.distributions(config.resolve(args.task))
    except SinkflowError as exc:
        p.error(f"--task {args.task}: {exc}")
    torch.set_num_threads(1)
    print(f"# {args.task}, {args.batches} x {args.n} points, blur {args.blur}; {platform.node()}, 1 thread, "
          f"torch {torch.__version__}, {datetime.date.today()}")
    print("| particles at | solver | mean abs dv | max abs dv | rel. error | entries/s |")
    print("|---|---|---|---|---|---|")
    for progress in args.progress:
        x, y = clouds(args.task, args.batches, args.n, progress)
        pts = torch.cat([x, y], 1).flatten(0, 1)
        diameter = float((pts.amax(0) - pts.amin(0)).norm())
        ref, _ = converged_velocity(x.double(), y.double(), blur=args.blur, scaling=0.95, diameter=diameter,
                                    max_iters=5000, tol=1e-7, final="log")
        scale = ref.norm(dim=-1).mean()
        for name, kw in ROWS:
            kw = dict(kw)
            if "final" in kw:  # the final-epsilon iterations in the log domain instead of on the absorbed kernel
                kw.pop("solver")
                solve = lambda a, b: converged_velocity(a, b, blur=args.blur, diameter=diameter, **kw)[0]  # noqa: E731
            else:
                scaling = kw.pop("scaling")
                solve = lambda a, b: _velocity_flat(a, b, args.blur, scaling, diameter, "tensorized", **kw)  # noqa: E731
            # one untimed solve of the first batch first: each row was one cold call, so the first row (GeomLoss at
            # 0.9) held GeomLoss's first-call costs in the entries/s the rows are compared by
            solve(x[:1], y[:1])
            start = time.perf_counter()
            v = solve(x, y)
            seconds = time.perf_counter() - start
            err = (v.double() - ref).norm(dim=-1)
            print(f"| {progress:.0%} | {name} | {err.mean():.4f} | {err.max():.3f} | {err.mean() / scale:.4f} | "
                  f"{args.batches * args.n / seconds:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
