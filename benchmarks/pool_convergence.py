"""Does the 2D recipe's Sinkhorn solver converge? Iterations needed and the pool's end-point error per target.

For every 2D preset task and every family of ``benchmarks/suite2d.py``, a few pool batches (the recipe's batch
size, steps, schedule, scaling and tol; i.i.d. source draws) are flowed twice: once with a cap of ``--cap``
iterations at the final epsilon (the reference: solved to tol) and once with each ``--blur B:ITERS`` setting. It
prints, per target, the iterations the converged solve needed at each flow step (the most over the batches) and
how far each setting's end points lie from that setting's own converged end points (mean and largest distance):
a solve stopped at max_iters puts its error straight into the pool's end points, since the harmonic schedule's
last step moves the whole remaining way (docs/nsgf.md). Also the time per batch, which is what a larger cap costs,
and the landing error: W2 between each batch's end points and its own target points (0 for ``pool.landing=exact``;
an entropic last step lands blurred, at the blur's scale).

    OMP_NUM_THREADS=1 python benchmarks/pool_convergence.py --blur 0.1:30 0.2:30 0.2:200 --write
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite2d  # noqa: E402
from _args import positive_int  # noqa: E402
from results_md import RESULTS, write_section  # noqa: E402

PRESET_TASKS = ("8gaussians", "8gaussians-moons", "moons", "scurve", "checkerboard")


def clouds(task: str, batches: int, n: int, seed: int = 0):
    """(x0, y): ``batches`` i.i.d. source draws and target batches of ``n`` points, (B, n, 2) each."""
    import torch

    from sinkflow import config
    from sinkflow.data import TOY2D, Normal

    g = torch.Generator().manual_seed(seed)
    if task in suite2d.FAMILIES:
        source = suite2d.FAMILIES[task][0]
        rows = torch.as_tensor(suite2d.sample(task, suite2d.TRAIN_ROWS, seed=seed), dtype=torch.float32)
        y = rows[torch.randint(0, len(rows), (batches, n), generator=g)]
    else:
        data = config.resolve(task)["data"]
        source = data["source"]
        y = torch.stack([TOY2D[data["target"]]().sample(n, g) for _ in range(batches)])
    src = TOY2D[source]() if source in TOY2D else Normal((2,))
    x0 = torch.stack([src.sample(n, g) for _ in range(batches)])
    return x0, y.to(x0.dtype)


def flow(x0, y, recipe: dict, blur: float, max_iters: int):
    """End points of the recipe's harmonic flow with a Sinkhorn solve at every step, the last one included (what this
    script measures is the solver; the recipe's ``pool.landing=exact`` replaces the last solve), and the iterations
    each step's solve ran (the most over batches)."""
    from sinkflow.ot.sinkhorn import converged_velocity
    from sinkflow.ot.velocity import _bbox_diameter, eta_schedule

    pool, sk = recipe["pool"], recipe["sinkhorn"]
    x, used = x0.clone(), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this script measures what the warning says
        for eta in eta_schedule(pool["eta"], pool["steps"], pool["eta_growth"] or None, pool["schedule"]):
            v, done = converged_velocity(x, y, blur=blur, scaling=sk["scaling"], diameter=_bbox_diameter(x, y),
                                         max_iters=max_iters, tol=sk["tol"])
            used.append(int(done.max()))
            x = x + eta * v
    return x, used


def measure(tasks, settings, batches: int, n: int, cap: int) -> list[dict]:
    from sinkflow import config
    from sinkflow.ot import w2

    recipe = config.resolve("moons")
    rows = []
    for task in tasks:
        x0, y = clouds(task, batches, n)
        row = {"task": task, "settings": {}}
        for blur, iters in settings:
            ref, used = flow(x0, y, recipe, blur, cap)
            start = time.perf_counter()
            end, _ = flow(x0, y, recipe, blur, iters)
            seconds = (time.perf_counter() - start) / batches
            dist = (end - ref).norm(dim=-1)
            row["settings"][f"{blur}:{iters}"] = {"needed": used, "mean": float(dist.mean()), "max": float(dist.max()),
                                                  "s_per_batch": seconds,
                                                  "landing": sum(w2(end[b], y[b]) for b in range(batches)) / batches}
        rows.append(row)
        print(task, {k: (v["needed"], round(v["mean"], 4), round(v["max"], 3)) for k, v in row["settings"].items()},
              flush=True)
    return rows


def table(rows, settings) -> str:
    keys = [f"{b}:{i}" for b, i in settings]
    head = ["target"] + [f"blur {k.split(':')[0]}: iterations needed per step" for k in dict.fromkeys(
        k.split(":")[0] for k in keys)] + [f"end-point error, blur {k.replace(':', ', cap ')} (mean / max)" for k in keys] \
        + [f"s per batch, blur {k.replace(':', ', cap ')}" for k in keys] \
        + [f"landing W2, blur {k.replace(':', ', cap ')}" for k in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r["settings"]
        needed = {k.split(":")[0]: s[k]["needed"] for k in keys}
        cells = [r["task"]] + [" / ".join(map(str, v)) for v in needed.values()]
        cells += [f"{s[k]['mean']:.4f} / {s[k]['max']:.2f}" for k in keys] + [f"{s[k]['s_per_batch']:.2f}" for k in keys]
        cells += [f"{s[k]['landing']:.3f}" for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def blur_setting(text: str) -> str:
    """An argparse type: BLUR:MAX_ITERS, a blur > 0 and a whole number of iterations >= 1 (kept as written)."""
    blur, _, iters = text.partition(":")
    try:
        ok = float(blur) > 0 and int(iters) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not BLUR:MAX_ITERS (blur > 0, iterations >= 1), e.g. 0.2:30")
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(PRESET_TASKS) + list(suite2d.FAMILIES),
                   choices=list(PRESET_TASKS) + list(suite2d.FAMILIES))
    p.add_argument("--blur", type=blur_setting, nargs="+", default=["0.1:30", "0.2:30", "0.2:200"],
                   help="BLUR:MAX_ITERS settings to measure against their own solve to tol")
    p.add_argument("--batches", type=positive_int, default=8)
    p.add_argument("--n", type=positive_int, default=256, help="particles per batch (the recipe's pool.batch_size)")
    p.add_argument("--cap", type=positive_int, default=3000, help="the reference's iteration cap (solved to tol)")
    p.add_argument("--write", action="store_true", help="replace the pool_convergence section of RESULTS.md")
    args = p.parse_args(argv)
    import torch

    settings = [(float(b), int(i)) for b, i in (s.split(":") for s in args.blur)]
    start = time.perf_counter()
    rows = measure(args.tasks, settings, args.batches, args.n, args.cap)
    from sinkflow import config

    recipe = config.resolve("moons")
    pool, sk = recipe["pool"], recipe["sinkhorn"]
    body = (f"Command: `python benchmarks/pool_convergence.py {' '.join(argv if argv is not None else sys.argv[1:])}`  \n"
            f"Machine: {platform.machine()}, {os.cpu_count()} cores visible (shared), torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s)  \nDate: {datetime.date.today()}  \n"
            f"Protocol: {args.batches} batches of {args.n} i.i.d. source points and target points per target, the 2D "
            f"recipe's flow ({pool['schedule']}, {pool['steps']} steps, scaling {sk['scaling']}, tol {sk['tol']}; a Sinkhorn solve at every step, the last one included); each setting's end points against the same "
            f"setting solved to tol (cap {args.cap}). Wall time {(time.perf_counter() - start) / 60:.1f} min.\n\n"
            f"{table(rows, settings)}\n")
    print(body)
    if args.write:
        write_section("pool_convergence", body, "Does the 2D pool's Sinkhorn solver converge? (issue 26)", RESULTS)


if __name__ == "__main__":
    main()
