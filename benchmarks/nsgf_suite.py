"""NSGF vs OT-CFM on eight 2D target families users bring (issue 26), under the i.i.d. and QMC protocols.

Each family of ``benchmarks/suite2d.py`` is written as an (N, 2) ``.npy`` (10,000 training rows, then 1,024
held-out rows; training seed s gets its own i.i.d. draw s of the family, ``--one-draw`` gives every seed draw 0) and
trained exactly as a user would: ``sinkflow train moons --method M data.target=F.npy
data.test_rows=1024`` (the 8-Gaussian-source family also ``data.source=8gaussians``): the preset's recipe,
nothing keyed on the target. Each trained model is scored at 10 and 100 Euler steps under two protocols:

- **i.i.d.** (primary): 1,024 i.i.d. source draws against the 1,024 held-out rows (never trained on); floor =
  W2 between a fresh i.i.d. 1,024-point draw of the family and those rows;
- **QMC / stratified**: 1,024 scrambled-Sobol source draws against a stratified 1,024-point draw of the family
  (balanced mode counts, Sobol offsets); floor = W2 between two stratified draws;
- **energy** (i.i.d. draws, a proper score): the unbiased energy distance between 4,096 i.i.d. generated points
  and the 1,024 held-out rows. Its expectation is smallest, zero, for the exact distribution, which the 1,024-point
  W2 does not guarantee (a sampler that hedges between modes can score below the exact distribution there: the
  table's † marks); floor = the exact distribution's own i.i.d. 4,096-point draw against the same rows.

Each W2 is the mean over ``--eval-seeds`` sampling seeds; runs are kept in ``--runs-dir`` and a finished run is
never retrained (kill and rerun the same command to resume); ``--keep DIR`` copies each run's scores to DIR
(``benchmarks/scores/``: a collect needs only them), and a run kept there is not trained again, on any machine.
``--write`` replaces the nsgf_suite section of benchmarks/RESULTS.md.

    OMP_NUM_THREADS=1 python benchmarks/nsgf_suite.py --runs-dir R --seeds 3 --write
    python benchmarks/nsgf_suite.py --runs-dir R --collect --write     # tabulate what has finished
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite2d  # noqa: E402
from _args import at_least, fail, positive_int  # noqa: E402
from results_md import RESULTS, trained_budget, write_section  # noqa: E402
from scoring import COLUMNS, DIGITS, ENERGY_N, ENERGY_SEEDS  # noqa: E402
import scoring  # noqa: E402

from sinkflow import config  # noqa: E402

METHODS = ("nsgf", "otcfm")


def train_args(family: str, path: Path, method: str, seed: int, iters: int, runs_dir: Path, extra) -> list[str]:
    """The user's command line for one run (the moons preset's recipe, the family's points as data.target)."""
    source = suite2d.FAMILIES[family][0]
    return ["train", "moons", "--method", method, "--seed", str(seed), "--train-iters", str(iters),
            "--device", "cpu", "--name", f"{family}-{method}-s{seed}", "--no-report",
            f"experiment.runs_dir={runs_dir}", f"data.target={path}", f"data.source={source}",
            f"data.test_rows={suite2d.TEST_ROWS}", *config.read_overrides("moons", method, list(extra))]


def evaluate(run_dir: Path, family: str, eval_seeds: int, n: int = suite2d.TEST_ROWS, columns=COLUMNS) -> dict:
    """The ``columns`` at 10 and 100 steps, one value per sampling seed: {"iid": {"10": [...], "100": [...]},
    "energy": {...}, "qmc": {...}} (W2 under both protocols, the energy distance on i.i.d. draws)."""
    import numpy as np
    import torch

    from sinkflow.eval.points import generate, w2_table
    from sinkflow.ot import energy_distance, w2
    from sinkflow.runtime.run_folder import RunFolder

    run = RunFolder.open(run_dir)
    out = {}
    if "iid" in columns:
        out["iid"] = {str(r["steps"]): r["w2_all"] for r in w2_table(run, n=n, seeds=eval_seeds, protocol="iid")}
    for steps in run.cfg["eval"]["steps"] if "qmc" in columns else ():
        vals = []
        for s in range(eval_seeds):
            x, _ = generate(run, n, steps, seed=1000 + s, protocol="qmc")
            test = torch.as_tensor(suite2d.sample(family, n, seed=2000 + s, stratified=True), dtype=torch.float32)
            vals.append(w2(x, test))
        out.setdefault("qmc", {})[str(steps)] = vals
    if "energy" in columns:
        test_rows = np.load(run.cfg["data"]["target"])[-suite2d.TEST_ROWS:]
        n_draws = scoring.draws(eval_seeds, eval_seeds, eval_seeds)["energy"]
        out["energy"] = {str(k): [energy_distance(generate(run, ENERGY_N, k, seed=3000 + s, protocol="iid")[0], test_rows)
                                  for s in range(n_draws)] for k in run.cfg["eval"]["steps"]}
    return out


def one_run(family: str, path: str, method: str, seed: int, iters: int, runs_dir: str, extra, eval_seeds: int) -> dict:
    """Train (or resume) one run in this process, evaluate it, keep the result in RUN/bench.json."""
    import torch

    torch.set_num_threads(1)
    os.environ["SINKFLOW_PROGRESS"] = "0"
    warnings.filterwarnings("ignore", message=".*balance properties of Sobol.*")
    from sinkflow.cli import main

    run_dir = Path(runs_dir) / f"{family}-{method}-s{seed}"
    done = run_dir / "bench.json"
    if done.exists():  # a finished run is not retrained; a column missing or with other draws is scored again
        result = json.loads(done.read_text())
        redo = scoring.stale(result.get("scores", {}), scoring.draws(eval_seeds, eval_seeds, eval_seeds))
        if redo:
            scoring.rescorable(run_dir, redo)
            result["scores"] = {**result.get("scores", {}), **evaluate(run_dir, family, eval_seeds, columns=redo)}
            result["eval_seeds"] = eval_seeds
            done.write_text(json.dumps(result))
        return result
    start = time.perf_counter()
    if not (run_dir / "status.json").exists() or json.loads((run_dir / "status.json").read_text()).get("state") != "finished":
        if run_dir.exists():
            code = main(["train", "--resume", str(run_dir), "--no-report"])
        else:
            code = main(train_args(family, Path(path), method, seed, iters, Path(runs_dir), extra))
        if code != 0:
            raise RuntimeError(f"training {run_dir.name} failed with exit code {code}")
    result = {"family": family, "method": method, "seed": seed, "train_s": time.perf_counter() - start,
              "eval_seeds": eval_seeds, "scores": evaluate(run_dir, family, eval_seeds)}
    done.write_text(json.dumps(result))
    return result


def floors(family: str, test: "np.ndarray", pairs: int = 12, train: "np.ndarray | None" = None) -> dict:  # noqa: F821
    """What the exact distribution scores, mean and std over ``pairs`` draws: i.i.d. draws vs the held-out
    rows (the i.i.d. protocol's floor), stratified draw vs stratified draw (the QMC protocol's), and a stratified
    draw vs the held-out rows (how much of the i.i.d. floor is the draw's own mode counts), and the energy
    distance of an i.i.d. ENERGY_N-point draw to the held-out rows (zero in expectation). With ``train``: the
    energy distance of ENERGY_N of the training rows (drawn without replacement) to the held-out rows, what a model
    that reproduced its training data exactly would score (the file is one finite draw of the family), and
    ``file_mass_qmc``: the W2 qmc of the family reweighted to the file's own mode masses (``suite2d.file_masses``),
    what a model that learned its file's masses exactly scores against the population's stratified test draw."""
    import numpy as np
    import torch

    from sinkflow.ot import energy_distance, w2

    t = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    n = len(test)
    vals = {
        "iid": [w2(t(suite2d.sample(family, n, seed=5000 + i)), t(test)) for i in range(pairs)],
        "qmc": [w2(t(suite2d.sample(family, n, seed=6000 + i, stratified=True)),
                   t(suite2d.sample(family, n, seed=7000 + i, stratified=True))) for i in range(pairs)],
        "strat_vs_test": [w2(t(suite2d.sample(family, n, seed=6000 + i, stratified=True)), t(test))
                          for i in range(pairs)],
        "energy": [energy_distance(suite2d.sample(family, ENERGY_N, seed=8000 + i), test) for i in range(pairs)],
    }
    if train is not None:
        pick = [np.random.default_rng(8500 + i).choice(len(train), min(ENERGY_N, len(train)), replace=False)
                for i in range(pairs)]
        vals["train_energy"] = [energy_distance(train[p], test) for p in pick]
        masses = suite2d.file_masses(family, train)
        vals["file_mass_qmc"] = [w2(t(suite2d.sample(family, n, seed=6500 + i, stratified=True, masses=masses)),
                                    t(suite2d.sample(family, n, seed=7000 + i, stratified=True))) for i in range(pairs)]
    return {k: (statistics.fmean(v), statistics.stdev(v)) for k, v in vals.items()}


def trained_on(run_dir: Path, expected: Path) -> None:
    """Refuse a run (kept or in ``--runs-dir``) that trained on another draw of its family than this protocol gives
    its seed, before anything runs: a table mixing the one-file and the per-seed protocols would not say so."""
    import yaml

    if (run_dir / "config.yaml").exists():
        name = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["target"]).name
        if name != expected.name:
            raise SystemExit(f"{run_dir.name} was trained on {name}, but this protocol gives its seed {expected.name} "
                             f"(--one-draw: every seed on draw 0); rerun with the protocol it was trained with, or "
                             f"delete the run and its kept scores to train it again")


def pooled(per_draw: list[dict]) -> dict:
    """Floors of several draws of a family as one: the mean of their means and of their one-draw stds."""
    return {k: (statistics.fmean(d[k][0] for d in per_draw), statistics.fmean(d[k][1] for d in per_draw))
            for k in per_draw[0]}


def diagnose(run_dir: Path, family: str, n: int = 20_000, big_n: int = 4096) -> dict:
    """Where a model's W2 comes from: the mass each mixture component gets and the share of points off the
    support, from n generated points (QMC source) at 10 and 100 steps. A point is given the component of its
    nearest neighbour in 200,000 labelled target points; "off" = farther from them than 99% of fresh target
    points are (so the target itself scores 1%). ``w2_4096``: i.i.d. protocol with 4x the points (4096 i.i.d.
    source draws vs a fresh i.i.d. 4096-point draw of the family, 2 seeds), beside the target's own score there.
    ``tail``: the 99 % and 99.9 % quantiles of the distance to the family's mean of n i.i.d.-source samples, beside
    the target's (how far the extreme draws land: a heavy-tailed family's score is decided there); ``beyond``: the
    share of those samples farther out than the target's 99 % and 99.9 % distances (the target: 0.01, 0.001), i.e.
    how much mass, not just how far. ``file_mass``, ``file_tail``, ``file_beyond``: the same of the run's own
    training rows, the finite draw the model learned from (a model faithful to it inherits its noise). ``spread``:
    per mode, the RMS of the std along x and y of the points given to it (``true_spread``: the family's)."""
    import numpy as np

    from sinkflow.eval.points import generate
    from sinkflow.runtime.run_folder import RunFolder

    tree, labels = suite2d.labelled_reference(family)
    ref = tree.data
    threshold = np.quantile(tree.query(suite2d.sample(family, n, seed=9001))[0], 0.99)
    k = len(suite2d.FAMILIES[family][1])
    out = {"true_mass": [round(m, 4) for m in suite2d.FAMILIES[family][1]]}
    centre = ref.mean(0)

    def tail(points):
        return [round(float(q), 2) for q in np.quantile(np.linalg.norm(points - centre, axis=1), [0.99, 0.999])]

    out["true_tail"] = tail(ref)
    radii = np.quantile(np.linalg.norm(ref - centre, axis=1), [0.99, 0.999])

    def beyond(points):
        r = np.linalg.norm(points - centre, axis=1)
        return [round(float((r > q).mean()), 5) for q in radii]

    import torch

    from sinkflow.ot import w2

    t = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    big = [suite2d.sample(family, big_n, seed=9100 + s) for s in range(2)]
    out["w2_4096_target"] = round(statistics.fmean(w2(t(suite2d.sample(family, big_n, seed=9200 + s)), t(b))
                                                   for s, b in enumerate(big)), 4)
    run = RunFolder.open(run_dir)
    rows = np.load(run.cfg["data"]["target"], allow_pickle=False)[: -suite2d.TEST_ROWS]  # what the model was given
    out["file_mass"] = [round(v, 4) for v in suite2d.file_masses(family, rows, (tree, labels))]
    out["file_tail"], out["file_beyond"] = tail(rows), beyond(rows)

    def spread(points, lab):  # per mode: the root mean square of its points' std along x and y
        return [round(float(np.sqrt((points[lab == j].std(0) ** 2).mean())), 3) if (lab == j).sum() > 1 else None
                for j in range(k)]

    out["true_spread"] = spread(ref, labels)
    for steps in (10, 100):
        x = generate(run, n, steps, seed=1000, protocol="qmc")[0].numpy()
        d, idx = tree.query(x)
        out[steps] = {"mass": [round(float(v), 4) for v in np.bincount(labels[idx], minlength=k) / n],
                      "spread": spread(x, labels[idx]),
                      "off": round(float((d > threshold).mean()), 4),
                      "w2_4096": round(statistics.fmean(w2(generate(run, big_n, steps, seed=1100 + s, protocol="iid")[0],
                                                           t(b)) for s, b in enumerate(big)), 4),
                      "tail": tail(iid := generate(run, n, steps, seed=1200, protocol="iid")[0].numpy()),
                      "beyond": beyond(iid)}
    return out


def table(results, families, fl) -> str:
    """The shared score table (``scoring.table``) and how much of the i.i.d. floor is the draw's own mode counts."""
    return (scoring.table(results, families, fl) + "\n\nThe exact distribution's stratified draw vs the held-out rows "
            "(the i.i.d. floor without the generated draw's own count noise): " + ", ".join(
                f"{f} {fl[f]['strat_vs_test'][0]:.3f} ± {fl[f]['strat_vs_test'][1]:.3f}" for f in families)
            + ". Where a model sits below a W2 floor, `--diagnose` shows the mass each of its modes gets."
            + ("" if not all("train_energy" in fl[f] for f in families) else
               "\n\nThe training rows' own energy distance to the held-out rows (4096 of them; what a model that reproduced "
               "its training file exactly would score, the file being one finite draw): " + ", ".join(
                   f"{f} {fl[f]['train_energy'][0]:.4f} ± {fl[f]['train_energy'][1]:.4f}" for f in families) + ".")
            + ("" if not all("file_mass_qmc" in fl[f] for f in families) else
               "\n\nW2 qmc of the family with its training file's own mode masses (a stratified draw weighted as the "
               "file's 10,000 rows are, against the stratified test draw): what a model that learned its file perfectly "
               "would score in the W2 qmc column, the file being one finite draw: " + ", ".join(
                   f"{f} {fl[f]['file_mass_qmc'][0]:.3f} ± {fl[f]['file_mass_qmc'][1]:.3f}" for f in families) + "."))


def main(argv: list[str] | None = None) -> None:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(suite2d.FAMILIES), choices=list(suite2d.FAMILIES))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--seed-list", type=at_least(0), nargs="+", default=None)
    p.add_argument("--iters", type=positive_int, default=20000)
    p.add_argument("--eval-seeds", type=positive_int, default=20,
                   help="sampling seeds per model: one i.i.d. draw of 1024 points varies by ~0.1 W2 on these targets")
    p.add_argument("--runs-dir", required=True, help="runs and the suite's .npy files live here (resumable)")
    p.add_argument("--collect", action="store_true", help="train nothing: tabulate the runs finished in --runs-dir")
    p.add_argument("--write", action="store_true", help="replace the nsgf_suite section of benchmarks/RESULTS.md")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="also copy each run's scores (bench.json) to DIR/<run>/ (see nsgf_2d.py --keep)")
    p.add_argument("--diagnose", action="store_true",
                   help="train nothing: print component masses and off-support shares of the finished runs")
    p.add_argument("--diagnose-n", type=positive_int, default=20_000,
                   help="generated points per diagnosis (the tail shares want 100000: 0.1 %% of 20000 is 20 points)")
    p.add_argument("--one-draw", action="store_true",
                   help="every training seed trains on the family's draw 0 (the protocol until 2026-11-27); by default "
                        "seed s trains on its own i.i.d. draw s, so the seed spread includes the data's own noise")
    p.add_argument("extra", nargs="*", help="config overrides for every run (probes), e.g. sinkhorn.blur=0.2")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    runs_dir = Path(args.runs_dir).resolve()
    no_runs = (f"no finished runs under {runs_dir} for these families, methods and seeds; --runs-dir is relative to "
               f"the current directory ({Path.cwd()})")
    if (args.collect or args.diagnose) and not runs_dir.is_dir() and not args.keep:
        fail(no_runs)  # before write_suite makes the folder
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    draw_of = (lambda s: 0) if args.one_draw else (lambda s: s)  # noqa: E731
    files = {d: suite2d.write_suite(runs_dir / "suite", args.families, draw=d) for d in {draw_of(s) for s in seeds}}
    jobs = [(f, m, s) for s in seeds for f in args.families for m in args.methods]  # seed-major
    for f, m, s in jobs:  # scores kept from another machine's runs are not made again
        scoring.restore(runs_dir / f"{f}-{m}-s{s}", args.keep)
        trained_on(runs_dir / f"{f}-{m}-s{s}", files[draw_of(s)][f])
    if args.collect or args.diagnose:
        jobs = [j for j in jobs if (runs_dir / f"{j[0]}-{j[1]}-s{j[2]}" / "bench.json").exists()]
        if not jobs:  # an all-'-' table, and with --write one in RESULTS.md, says nothing
            fail(no_runs)
    if args.diagnose:
        for f, m, s in jobs:
            print(f"{f:>8} {m:>6} seed {s}: {json.dumps(diagnose(runs_dir / f'{f}-{m}-s{s}', f, args.diagnose_n))}", flush=True)
        return
    start = time.perf_counter()
    results = []
    with ProcessPoolExecutor(1) as pool:  # one run at a time, one thread: the machine is shared
        for f, m, s in jobs:
            r = pool.submit(one_run, f, str(files[draw_of(s)][f]), m, s, args.iters, str(runs_dir), args.extra,
                            args.eval_seeds).result()
            results.append(r)
            scoring.keep(runs_dir / f"{f}-{m}-s{s}" / "bench.json", args.keep)
            w = {c: [statistics.fmean(r["scores"][c][k]) for k in ("10", "100")] for c in COLUMNS}
            print(f"{f:>8} {m:>6} seed {s}: " + "  ".join(f"{c} {w[c][0]:.{DIGITS[c]}f} / {w[c][1]:.{DIGITS[c]}f}" for c in COLUMNS)
                  + f"  ({r['train_s']:.0f} s)", flush=True)
    rows = {(f, d): np.load(files[d][f]) for d in {draw_of(r["seed"]) for r in results} or {0} for f in args.families
            if d in files}
    fl = {f: pooled([floors(f, x[-suite2d.TEST_ROWS:], train=x[:-suite2d.TEST_ROWS]) for (g, _), x in rows.items()
                     if g == f]) for f in args.families}
    import torch

    machine = (f"{platform.machine()}, {os.cpu_count()} cores visible (shared), 1 run at a time with 1 torch thread, "
               f"torch {torch.__version__}")
    budget = trained_budget([runs_dir / f"{r['family']}-{r['method']}-s{r['seed']}" for r in results], args.iters)
    body = (f"Command: `python benchmarks/nsgf_suite.py {' '.join(argv)}`  \nMachine: {machine}  \n"
            f"Date: {datetime.date.today()}  \nProtocol: `sinkflow train moons --method nsgf|otcfm data.target=F.npy "
            f"data.test_rows=1024` ({budget}, the preset's recipe); training seeds "
            f"{sorted({r['seed'] for r in results})}, "
            + ("all on the family's draw 0 (one file of 10,000 + 1,024 rows)" if args.one_draw else
               "seed s on its own i.i.d. draw s of the family (10,000 training + 1,024 held-out rows), so the spread "
               "over seeds includes the data's own noise; floors averaged over those draws")
            + f"; each W2 (exact, POT emd2, 1024 vs 1024 points) is the mean over "
            f"{args.eval_seeds} sampling seeds, then mean ± std over training seeds. **iid** (primary): i.i.d. source "
            f"draws vs the 1024 held-out rows of the file (never trained on); floor: a fresh i.i.d. draw of the family vs "
            f"those rows. **qmc**: scrambled-Sobol source draws vs a stratified draw of the family; floor: two stratified "
            f"draws. **energy iid**: the unbiased energy distance (a proper score: 0 in expectation only for the exact "
            f"distribution) of {ENERGY_N} i.i.d. generated points to the same held-out rows (mean over {ENERGY_SEEDS} draws); floor: the exact distribution's "
            f"own {ENERGY_N}-point i.i.d. draw. Floors: mean ± std over 12 draws (the std is one draw's, not the mean's). "
            f"Bold: NSGF <= OT-CFM. Wall time {(time.perf_counter() - start) / 60:.1f} min.\n\n"
            f"{table(results, args.families, fl)}\n")
    print(body)
    if args.write:
        write_section("nsgf_suite", body, "NSGF on users' 2D targets (issue 26)", RESULTS, scored=len(results))


if __name__ == "__main__":
    main()
