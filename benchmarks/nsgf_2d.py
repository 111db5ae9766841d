"""Table 1 of arXiv:2401.14069 with NSGF, FM and OT-CFM trained by the same runner.

For every 2D task and method, trains with the paper's budget (batch 256, 20k steps) over 3 training seeds,
then scores each model at 10 and 100 Euler steps in the columns of ``scoring.py``, as the suite of users' targets
(``nsgf_suite.py``) does:

- **W2 iid** (the draws a user makes): exact W2 (POT) between 1024 samples from i.i.d. source draws and a fresh
  i.i.d. 1024-point draw of the task (never trained on: the toy samplers are infinite), ``--iid-seeds`` draws;
- **energy iid**: the unbiased energy distance of 4096 such samples to a fresh i.i.d. 1024-point draw (a proper
  score: 0 in expectation only for the exact distribution);
- **W2 qmc** (the paper's table's protocol here): 1024 samples from scrambled-Sobol source draws against a
  stratified 1024-point test draw, ``--eval-seeds`` draws.

Prints a markdown table and (with --write) replaces the matching section of benchmarks/RESULTS.md. A kept run
(``--runs-dir``) is never retrained; one scored by an older version of this script is scored again. ``--keep DIR``
copies each run's scores (``bench.json``) to DIR, from which ``--collect --runs-dir DIR`` makes the table again
without the run folders: ``benchmarks/scores/`` holds those of the tables in RESULTS.md. A run whose scores are kept
in DIR is not trained again, so the same command resumes the benchmark on a machine without the old run folders.

    python benchmarks/nsgf_2d.py                      # full protocol, 2 runs in parallel
    python benchmarks/nsgf_2d.py --iters 2000 --tasks moons --methods nsgf   # quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import fail, positive_int  # noqa: E402
from results_md import RESULTS, trained_budget, write_section  # noqa: E402
from scoring import COLUMNS, DIGITS, ENERGY_N, ENERGY_SEEDS  # noqa: E402
import scoring  # noqa: E402

TASKS = ["8gaussians", "8gaussians-moons", "moons", "scurve", "checkerboard"]
METHODS = ["nsgf", "fm", "otcfm"]


IID_SEEDS = 20  # one i.i.d. draw of 1024 points varies by ~0.05-0.1 W2 on the multimodal tasks


def one_run(task: str, method: str, seed: int, iters: int, runs_dir: str, extra: list[str], eval_seeds: int,
            eval_n: int = 1024, iid_seeds: int = IID_SEEDS) -> dict:
    """Train one (task, method, seed) in this process and evaluate it; returns numbers and wall time."""
    import torch

    torch.set_num_threads(1)
    os.environ["SINKFLOW_PROGRESS"] = "0"
    from sinkflow import config
    from sinkflow.cli import main

    name = f"{task}-{method}-s{seed}"
    run_dir = Path(runs_dir) / name
    done = run_dir / "bench.json"
    if done.exists():  # a kept --runs-dir: finished runs are not retrained (the benchmark resumes)
        result = json.loads(done.read_text())
        # scored with another n: every column again; with other draws or a column missing: those columns
        redo = (list(COLUMNS) if result.get("eval_n", 1024) != eval_n
                else scoring.stale(result.get("scores", {}), scoring.draws(iid_seeds, eval_seeds)))
        if redo:
            scoring.rescorable(run_dir, redo)
            new = evaluate(run_dir, eval_seeds, eval_n, iid_seeds, columns=redo)
            result.update({**new, "scores": {**result.get("scores", {}), **new["scores"]}})
            done.write_text(json.dumps(result))
        return result
    start = time.perf_counter()
    if run_dir.exists():  # interrupted: continue from its checkpoints
        code = main(["train", "--resume", str(run_dir), "--no-report"])
    else:
        code = main(["train", task, "--method", method, "--seed", str(seed), "--train-iters", str(iters),
                     "--device", "cpu", "--name", name, "--no-report", f"experiment.runs_dir={runs_dir}",
                     *config.read_overrides(task, method, list(extra))])
    train_s = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"training {name} failed with exit code {code}")
    result = {"task": task, "method": method, "seed": seed, "train_s": train_s,
              **evaluate(run_dir, eval_seeds, eval_n, iid_seeds)}
    done.write_text(json.dumps(result))
    return result


def _finished(run_dir: Path) -> bool:
    if (run_dir / "bench.json").exists():
        return True
    try:
        return json.loads((run_dir / "status.json").read_text()).get("state") == "finished"
    except (OSError, ValueError):
        return False


def evaluate(run_dir: Path, eval_seeds: int, eval_n: int = 1024, iid_seeds: int = IID_SEEDS, columns=COLUMNS) -> dict:
    """The ``columns`` of ``scoring`` at 10 and 100 steps, one value per sampling seed (``scores``), each draw with its
    own source and test draw of ``eval_n`` points; ``w2_<steps>`` keeps the QMC mean (older result files)."""
    from sinkflow.eval.points import generate, protocol_pair, w2_table
    from sinkflow.ot import energy_distance
    from sinkflow.runtime.run_folder import RunFolder

    run = RunFolder.open(run_dir)
    steps_list = run.cfg["eval"]["steps"]
    qmc = w2_table(run, n=eval_n, seeds=eval_seeds, protocol="qmc") if "qmc" in columns else []
    test = protocol_pair(run.cfg, "iid")[1]
    scores = {"qmc": {str(r["steps"]): r["w2_all"] for r in qmc}} if qmc else {}
    if "iid" in columns:
        scores["iid"] = {str(r["steps"]): r["w2_all"] for r in w2_table(run, n=eval_n, seeds=iid_seeds, protocol="iid")}
    if "energy" in columns:
        scores["energy"] = {str(k): [energy_distance(generate(run, ENERGY_N, k, seed=3000 + s, protocol="iid")[0],
                                                     test.test_set(eval_n, seed=4000 + s)) for s in range(ENERGY_SEEDS)]
                            for k in steps_list}
    out = {"eval_seeds": eval_seeds, "eval_n": eval_n, "iid_seeds": iid_seeds, "scores": scores}
    for r in qmc:
        out[f"w2_{r['steps']}"] = r["w2_mean"]
        out[f"w2_{r['steps']}_all"] = r["w2_all"]
    return out


def floors(task: str, n: int = 1024, pairs: int = 12, iid_seeds: int = IID_SEEDS) -> dict:
    """What the exact distribution scores in each column, (mean, std) over ``pairs`` draws: two stratified draws
    (qmc), two i.i.d. draws (iid), an i.i.d. ENERGY_N-point draw against an i.i.d. n-point one (energy, 0 in
    expectation). ``iid_paired``: an i.i.d. draw against each of the ``iid_seeds`` test draws the models' W2 iid
    is scored on (``w2_table``'s seeds), so "would the exact distribution be <= OT-CFM" compares on the same test
    draws: one 1,024-point draw of 8gaussians varies by ~0.17, half of it the test draw's."""
    import torch

    from sinkflow import config, data
    from sinkflow.eval.floor import measure_floor
    from sinkflow.ot import energy_distance, w2

    target = data.distributions(config.resolve(task))[1]
    iid = data.iid_twin(target)
    energy = [energy_distance(iid.sample(ENERGY_N, torch.Generator().manual_seed(8000 + i)), iid.test_set(n, seed=8500 + i))
              for i in range(pairs)]
    paired = [w2(iid.sample(n, torch.Generator().manual_seed(9500 + s)), iid.test_set(n, seed=2000 + s))
              for s in range(iid_seeds)]  # w2_table's test draws: target.test_set(n, seed=2000 + s)
    return {"qmc": measure_floor(target, n=n, pairs=pairs)[:2], "iid": measure_floor(iid, n=n, pairs=pairs)[:2],
            "energy": (statistics.fmean(energy), statistics.stdev(energy)),
            "iid_paired": (statistics.fmean(paired), statistics.stdev(paired) if len(paired) > 1 else 0.0)}


def table(results: list[dict], fl: dict, args) -> str:
    """``scoring.table`` with the paper's NSGF row (its protocol: the qmc column's) and NSGF's training time."""
    from sinkflow.eval.paper import TABLE1_NSGF

    def train_s(task, steps):
        times = [r["train_s"] for r in results if r["task"] == task and r["method"] == "nsgf"]
        return f"{statistics.fmean(times):.0f}" if times else "-"

    return scoring.table(results, args.tasks, fl, methods=args.methods,
                         extra=[("paper NSGF (W2 qmc)", lambda t, k: f"{TABLE1_NSGF[t][k]:.3f}"),
                                ("NSGF pool + train s (mean)", train_s)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=TASKS)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    # counts are whole numbers >= 1: '--workers 0' was a ValueError traceback from the process pool, and a 0 count
    # of seeds or draws an empty table or a StatisticsError after the training
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--seed-list", type=int, nargs="+", default=None,
                   help="train only these training seeds (e.g. a second process taking the last seed)")
    p.add_argument("--iters", type=positive_int, default=20000)
    p.add_argument("--eval-seeds", type=positive_int, default=3, help="QMC sampling seeds averaged per trained model")
    p.add_argument("--iid-seeds", type=positive_int, default=IID_SEEDS,
                   help="i.i.d. sampling seeds averaged per trained model")
    p.add_argument("--eval-n", type=positive_int, default=1024,
                   help="generated and test points per W2 (the paper's 1024; more points shrink the draw's noise)")
    p.add_argument("--workers", type=positive_int, default=2, help="runs in parallel, one thread each")
    p.add_argument("--runs-dir", default=None,
                   help="keep the runs here (default: a temporary folder, removed at the end: about 1 GB of runs)")
    p.add_argument("--write", action="store_true", help="replace the nsgf_2d section of benchmarks/RESULTS.md")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="also copy each run's scores (bench.json) to DIR/<run>/: --collect --runs-dir DIR tabulates "
                        "them again once the run folders are gone (benchmarks/scores/ keeps the tables' own)")
    p.add_argument("--collect", action="store_true",
                   help="train nothing: tabulate (evaluating where needed) the runs finished in --runs-dir")
    p.add_argument("extra", nargs="*", help="config overrides applied to every run, e.g. pool.eta=0.1")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.collect and args.runs_dir is None:
        p.error("--collect tabulates the runs of a --runs-dir: name it (relative to the current directory)")
    if args.runs_dir is None:  # the default's runs (about 1 GB) go with their temporary folder
        with tempfile.TemporaryDirectory(prefix="sinkflow-bench-") as tmp:
            print(f"runs in {tmp}, removed at the end (--runs-dir keeps them)", flush=True)
            return bench(args, argv, tmp)
    return bench(args, argv, args.runs_dir)


def bench(args, argv: list[str], runs_dir: str) -> None:
    """Train (or, with --collect, gather) the runs in ``runs_dir``, score them and print (and --write) the table."""
    # seed-major: an interrupted benchmark has every task and method for its first seeds
    seeds = args.seed_list if args.seed_list is not None else range(args.seeds)
    jobs = [(t, m, s) for s in seeds for t in args.tasks for m in args.methods]
    for t, m, s in jobs:  # scores kept from another machine's runs are not made again
        scoring.restore(Path(runs_dir) / f"{t}-{m}-s{s}", args.keep)
    start = time.perf_counter()
    if args.collect:  # runs evaluated before, or trained to the end but not evaluated (e.g. a killed benchmark)
        jobs = [(t, m, s) for t, m, s in jobs if _finished(Path(runs_dir) / f"{t}-{m}-s{s}")]
        if not jobs:  # an all-'-' table, and with --write one in RESULTS.md, says nothing
            fail(f"no finished runs under {runs_dir} for these tasks, methods and seeds; --runs-dir is relative to "
                 f"the current directory ({Path.cwd()})")
    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(one_run, t, m, s, args.iters, runs_dir, args.extra, args.eval_seeds, args.eval_n,
                               args.iid_seeds) for t, m, s in jobs]
        floors_f = {t: pool.submit(floors, t, args.eval_n, 12, args.iid_seeds) for t in args.tasks}
        results = []
        for f in futures:
            r = f.result()
            results.append(r)
            scoring.keep(Path(runs_dir) / f"{r['task']}-{r['method']}-s{r['seed']}" / "bench.json", args.keep)
            w = {c: [statistics.fmean(r["scores"][c][k]) for k in ("10", "100")] for c in COLUMNS}
            print(f"{r['task']:>17} {r['method']:>6} seed {r['seed']}: " + "  ".join(
                f"{c} {w[c][0]:.{DIGITS[c]}f} / {w[c][1]:.{DIGITS[c]}f}" for c in COLUMNS) + f"  ({r['train_s']:.0f} s)",
                flush=True)
        fl = {t: f.result() for t, f in floors_f.items()}
    total = time.perf_counter() - start
    import torch

    machine = (f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores visible, "
               f"{args.workers} runs in parallel with 1 torch thread each, torch {torch.__version__}")
    cmd = "python benchmarks/nsgf_2d.py " + " ".join(argv)
    budget = trained_budget([Path(runs_dir) / f"{r['task']}-{r['method']}-s{r['seed']}" for r in results], args.iters)
    body = (f"Command: `{cmd}`  \nMachine: {machine}  \nDate: {datetime.date.today()}  \n"
            f"Protocol: training seeds {sorted({r['seed'] for r in results})}, {budget}. **W2 iid** "
            f"(primary): exact W2 (POT emd2) between {args.eval_n} samples from i.i.d. source draws and a fresh i.i.d. "
            f"{args.eval_n}-point draw of the task, mean over {args.iid_seeds} sampling seeds; **energy iid**: the unbiased "
            f"energy distance of {ENERGY_N} such samples to a fresh i.i.d. {args.eval_n}-point draw, mean over "
            f"{ENERGY_SEEDS}; **W2 qmc** (the protocol of the paper column here): scrambled-Sobol source draws vs a "
            f"stratified test draw, mean over {args.eval_seeds} sampling seeds; then mean ± std over training seeds. "
            f"Floors: the exact distribution's own score in each column, mean ± std over 12 draws. Bold: NSGF <= OT-CFM. "
            f"Total wall time {total / 60:.1f} min.\n\n{table(results, fl, args)}\n")
    print(body)
    if args.write:
        write_section("nsgf_2d", body, "NSGF on the 2D tasks (issue 2, Table 1)", RESULTS, scored=len(results))


if __name__ == "__main__":
    main()
