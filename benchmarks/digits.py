"""NSGF++ vs FM vs OT-CFM on the embedded 8x8 digits, same UNet, batch, lr and UNet gradient steps (CPU).

    OMP_NUM_THREADS=1 python benchmarks/digits.py [--train-seeds 0 1 2] [--workers 2] [--baselines otcfm] [--out R] [--quick]
    python benchmarks/digits.py --smoke --nfe 3 --seeds 1 --train-seeds 0   # seconds: a check that the script runs

Budget: NSGF++ trains the velocity UNet (train.velocity.iters) and the NSF UNet (train.nsf.iters) plus a
small time-predictor CNN; FM and OT-CFM train ONE UNet of the same config for velocity.iters + nsf.iters
steps, so every method gets the same number of UNet gradient steps on the same batch size. Sampling:
NSGF++ at each total NFE budget of --nfe and at its preset NFE, split into NSGF steps, 1 predictor call and NSF
steps on a validation split carved from train (``choose_split``; every method trains without those
images), FM / OT-CFM at 100 Euler steps and at every budget, uniform (the paper's sampler) and with the Euler
grid's ``sample.time_warp`` chosen on the same validation split (one tuned sampler knob each). Metrics (sinkflow.eval.images): exact pixel W2 to the held-out split, predicted-class
histogram TV distance and mean confidence of a LogisticRegression digit classifier, NFE counted by hooks;
the real training images are a reference row. Every method is trained once per training seed; the table is the
mean ± std over training seeds (one training run decides nothing here: the seed moves TV and confidence by as
much as the methods differ), followed by each seed's numbers. Writes grids of 64 samples per run and results.json
(every score, split, grid and validation score per training seed, for re-analysis) into --out.

--out: a new or empty folder, or one this script wrote (only results.json and seed<N>/ folders in it). A rerun
there replaces the seed<N>/ folders of its own --train-seeds (their runs are trained again) and results.json; other
seeds' folders stay. A folder holding anything else is refused before any work: it is not this script's to delete.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from sinkflow import config, methods
from sinkflow.cli import main as cli
from sinkflow.data.atomic_write import atomic_write_text
from sinkflow.eval.images import class_stats, digit_classifier, image_metrics, save_grid
from sinkflow.eval.points import generate
from sinkflow.ot import w2
from sinkflow.runtime.run_folder import RunFolder
from sinkflow.tools.tune import WARPS  # sample.time_warp candidates for FM / OT-CFM (1.0 = uniform Euler, the paper's)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402

HOLD_OUT = ["data.val_fraction=0.1"]  # every method fits the same images; the validation split picks NSGF++'s split


def train(out: Path, name: str, *args) -> tuple[RunFolder, float]:
    t0 = time.perf_counter()
    rc = cli(["train", "digits", *args, f"experiment.runs_dir={out}", "--name", name, "--device", "cpu", "--no-report"])
    if rc != 0:
        sys.exit(f"training {name} failed (exit {rc})")
    return RunFolder.open(out / name), time.perf_counter() - t0


def scores(result) -> dict:
    r = result["rows"][0]
    return {"nfe": r["nfe"], "w2": r["w2"], "tv": r["tv"], "conf": r["confidence"]}


def timed_metrics(run, seeds, steps=None):
    t0 = time.perf_counter()
    result = image_metrics(run, seeds=seeds, steps_list=[steps] if steps else None)
    return result, (time.perf_counter() - t0) / seeds


def real_floor(cfg, seeds) -> dict:
    """Real training images vs the held-out split: a reference (smooth, averaged samples can score a lower W2).
    W2 on as many images as the split has, the classifier columns on eval.class_n, as for the models."""
    _, target = methods.distributions(cfg)
    clf = digit_classifier(target, cfg["data"]["root"])
    real = target.test_set(len(target.test_images))
    class_n = max(len(real), cfg["eval"]["class_n"] or len(real))
    ref = class_stats(clf, real)
    w, tv, conf = [], [], []
    for s in range(seeds):
        x = target.sample(class_n, torch.Generator().manual_seed(3000 + s))
        w.append(w2(x[: len(real)], real))
        st = class_stats(clf, x)
        tv.append(0.5 * float(np.abs(st["hist"] - ref["hist"]).sum()))
        conf.append(st["confidence"])
    return {"w2": statistics.fmean(w), "tv": statistics.fmean(tv), "conf": statistics.fmean(conf)}


def split_candidates(total: int) -> list[int]:
    """NSGF step counts k to try for a total NFE budget: every k from 1 to total - 2 (k NSGF steps + 1 predictor
    call + at least one NSF step). k > T is valid because the field is trained on the pool's Euler segments: k
    uniform steps integrate the same span of T pool steps more finely (measured: finer NSGF steps and a single
    NSF step give the best W2 and confidence at 13 and 26 NFE, docs/nsgfpp.md)."""
    return list(range(1, total - 1))


def choose_split(run, total: int, seeds: int) -> tuple[int, int, dict]:
    """(NSGF steps, NSF steps) for a total NFE budget, chosen on the validation split (never the test split):
    each k of ``split_candidates``, one predictor call, the rest NSF steps; the split with the best mean rank
    over pixel W2, class-histogram TV and classifier confidence (the three metrics of the target; W2 alone
    favours smooth, blurred samples), ties to the lower W2. Returns the choice and each candidate's
    validation (W2, TV, confidence)."""
    if total < 3:
        raise SystemExit(f"an NFE budget of {total} leaves no NSF step: use at least 3")
    val = {}
    for k in split_candidates(total):
        val[k] = val_scores(run.variant(sample={"nsgf_steps": k}), total - 1 - k, seeds)
    k = rank_choice(val)
    return k, total - 1 - k, {j: (w, tv, -c) for j, (w, tv, c) in val.items()}




def val_scores(run, steps: int, seeds: int) -> tuple[float, float, float]:
    """(W2, TV, -confidence) on the validation split: every column lower is better."""
    r = image_metrics(run, seeds=seeds, steps_list=[steps], split="val")["rows"][0]
    return r["w2"], r.get("tv", 0.0), -r.get("confidence", 0.0)


def rank_choice(val: dict) -> object:
    """The candidate with the best mean rank over (W2, TV, -confidence) on validation; ties to the lower W2."""
    ranks = {k: 0 for k in val}
    for m in range(3):
        for place, k in enumerate(sorted(val, key=lambda k: val[k][m])):
            ranks[k] += place
    return min(val, key=lambda k: (ranks[k], val[k][0]))


def choose_warp(run, steps: int, seeds: int) -> tuple[float, dict]:
    """FM / OT-CFM's Euler time grid for a budget, chosen on the validation split like NSGF++'s split: each
    method gets one sampler knob tuned on validation, so a difference is the models', not the samplers'."""
    val = {}
    for warp in WARPS:
        val[warp] = val_scores(run.variant(sample={"time_warp": warp}), steps, seeds)
    return rank_choice(val), {w: (a, b, -c) for w, (a, b, c) in val.items()}


BASELINES = ("otcfm", "fm")
LABEL = {"otcfm": "OT-CFM", "fm": "FM"}
METRICS = (("w2", "pixel W2 ↓", False), ("tv", "class-histogram TV ↓", False), ("conf", "classifier confidence ↑", True))


def bench_seed(out: Path, train_seed: int, quick: list, extra: list, seeds: int, nfe: list[int],
               baselines: tuple = BASELINES, ref_steps: int = 100) -> dict:
    """One training seed: NSGF++ (split per budget chosen on validation), FM and OT-CFM, scored on the test
    split. Returns {"scores": {method: {nfe: {metric: mean over sampling seeds}}}, "split", "val", "wall"}."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("SINKFLOW_PROGRESS", "0")
    out = out / f"seed{train_seed}"
    common = [*quick, *HOLD_OUT, f"experiment.seed={train_seed}"]
    res = {"scores": {"NSGF++": {}, **{k: {} for b in baselines for k in (LABEL[b], LABEL[b] + " warped")}}, "split": {},
           "val": {}, "warp": {}, "wall": {}, "sample_s": {}}
    run, res["wall"]["NSGF++"] = train(out, "nsgfpp", *common, *extra)
    for total in nfe:
        k, nsf_steps, val = choose_split(run, total, seeds)
        res["split"][total], res["val"][total] = k, val
        result, res["sample_s"][("NSGF++", total)] = timed_metrics(run.variant(sample={"nsgf_steps": k}), seeds,
                                                                   nsf_steps)
        res["scores"]["NSGF++"][total] = scores(result)
    save_grid(generate(run, 64, None, seed=7)[0], out / "nsgfpp_grid.png", nrow=8)
    unet_steps = run.cfg["train"]["velocity"]["iters"] + run.cfg["train"]["nsf"]["iters"]
    for method in baselines:
        label = LABEL[method]
        keys = [a for a in common if "=" in a]  # the baseline gets only the overrides it reads (no pool, nsf, time)
        base = [a for a in common if "=" not in a] + config.read_overrides("digits", method, keys)
        run, res["wall"][label] = train(out, method, "--method", method, *base, f"train.velocity.iters={unet_steps}")
        for steps in [*nfe, ref_steps]:
            result, res["sample_s"][(label, steps)] = timed_metrics(run, seeds, steps)
            res["scores"][label][steps] = scores(result)
        for steps in nfe:  # the same model with its Euler grid chosen on validation
            warp, _ = choose_warp(run, steps, seeds)
            res["warp"][(label, steps)] = warp
            warped = run.variant(sample={"time_warp": warp})
            res["scores"][f"{label} warped"][steps] = scores(timed_metrics(warped, seeds, steps)[0])
        save_grid(generate(run, 64, ref_steps, seed=7)[0], out / f"{method}_grid.png", nrow=8)
    return res


def plain(obj):
    """JSON-ready copy of a result (tuple keys such as ("OT-CFM", 6) become "OT-CFM 6")."""
    if isinstance(obj, dict):
        return {" ".join(map(str, k)) if isinstance(k, tuple) else str(k): plain(v) for k, v in obj.items()}
    return [plain(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


def mean_std(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def table(per_seed: list[dict], nfe: list[int], real: dict, ref_steps: int = 100) -> str:
    """Mean ± std over training seeds of each seed's mean over sampling seeds."""
    lines = ["| method | NFE | " + " | ".join(h for _, h, _ in METRICS) + " | train wall (s) |",
             "|---|---|---|---|---|---|"]
    for total in nfe:
        for label in [lb for lb in ("NSGF++", "OT-CFM", "OT-CFM warped", "FM", "FM warped") if lb in per_seed[0]["scores"]]:
            cells = [mean_std([r["scores"][label][total][m] for r in per_seed]) for m, _, _ in METRICS]
            base = label.split()[0]
            if label == "NSGF++":
                name = label + " (" + "/".join(str(r["split"][total]) for r in per_seed) + " NSGF + 1 t̂ + rest NSF)"
            elif label.endswith("warped"):
                name = f"{base} (Euler {total}, time_warp " + "/".join(f"{r['warp'][(base, total)]:g}" for r in per_seed) + ")"
            else:
                name = f"{label} (Euler {total})"
            wall = statistics.fmean(r["wall"][base] for r in per_seed)
            lines.append(f"| {name} | {total} | " + " | ".join(cells) + f" | {wall:.0f} |")
    for label in [lb for lb in ("OT-CFM", "FM") if lb in per_seed[0]["scores"]]:
        cells = [mean_std([r["scores"][label][ref_steps][m] for r in per_seed]) for m, _, _ in METRICS]
        lines.append(f"| {label} (Euler {ref_steps}) | {ref_steps} | " + " | ".join(cells) + " | |")
    lines.append("| real training images (reference) | - | " + " | ".join(f"{real[m]:.3f}" for m, _, _ in METRICS)
                 + " | |")
    return "\n".join(lines)


def per_seed_table(per_seed: list[dict], seeds_used: list[int], nfe: list[int]) -> str:
    """NSGF++ and OT-CFM per training seed (W2 / TV / confidence), to show how the verdict moves with the seed."""
    lines = ["| NFE | training seed | NSGF++ (split) W2 / TV / conf | OT-CFM W2 / TV / conf | NSGF++ wins | "
             "OT-CFM warped (warp) W2 / TV / conf | NSGF++ wins |", "|---|---|---|---|---|---|---|"]
    fmt = lambda d: " / ".join(f"{d[m]:.3f}" for m, _, _ in METRICS)  # noqa: E731
    for total in nfe:
        for seed, r in zip(seeds_used, per_seed):
            pp, ot, otw = (r["scores"][k][total] for k in ("NSGF++", "OT-CFM", "OT-CFM warped"))
            lines.append(f"| {total} | {seed} | {fmt(pp)} ({r['split'][total]}) | {fmt(ot)} | "
                         f"{', '.join(wins(pp, ot)) or 'none'} | {fmt(otw)} ({r['warp'][('OT-CFM', total)]:g}) | "
                         f"{', '.join(wins(pp, otw)) or 'none'} |")
    return "\n".join(lines)


def wins(pp: dict, ot: dict) -> list[str]:
    return [m for m, _, higher in METRICS if (pp[m] > ot[m] if higher else pp[m] < ot[m])]


def verdict(per_seed: list[dict], nfe: list[int]) -> str:
    """The issue's target per budget, on the means over training seeds: NSGF++ better than OT-CFM at equal NFE
    on at least 2 of 3 metrics."""
    lines = []
    for total in nfe:
        mean = lambda label: {m: statistics.fmean(r["scores"][label][total][m] for r in per_seed)  # noqa: E731
                              for m, _, _ in METRICS}
        for label, what in (("OT-CFM", "uniform Euler"), ("OT-CFM warped", "Euler grid chosen on validation")):
            w = wins(mean("NSGF++"), mean(label))
            lines.append(f"NFE {total}: NSGF++ better than OT-CFM ({what}) on {len(w)} of 3 ({', '.join(w) or 'none'}), "
                         "means over training seeds")
    return "\n".join(lines)


OWN = re.compile(r"results\.json|seed\d+")  # what this script writes into --out


def clear_out(out: Path, train_seeds: list[int], error) -> None:
    """Make ``out`` ready for a run of ``train_seeds``: refuse (``error``, one line) a file or a folder holding
    anything this script does not write; in one of its own, remove the seed folders this run writes again."""
    if out.exists() and not out.is_dir():
        error(f"--out {out} is a file: give a new or empty folder")
    foreign = sorted(p.name for p in out.iterdir() if not OWN.fullmatch(p.name)) if out.is_dir() else []
    if foreign:
        error(f"--out {out} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which this script "
              "did not write: give a new or empty folder (or one of its earlier --out); nothing was deleted")
    for s in train_seeds:
        if (out / f"seed{s}").exists():
            shutil.rmtree(out / f"seed{s}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-digits")
    # counts are whole numbers >= 1: '--workers 0' was the process pool's ValueError traceback, '--ref-steps 0'
    # silently the default (``args.ref_steps or ...``), '--seeds 0' a failure after every run was trained
    ap.add_argument("--seeds", type=positive_int, default=3, help="sampling seeds per trained model")
    ap.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="experiment.seed of every method's training runs; the table averages over them")
    ap.add_argument("--workers", type=positive_int, default=1, help="training seeds run in parallel, one thread each")
    ap.add_argument("--quick", action="store_true", help="tiny budget, to check the script runs")
    ap.add_argument("--smoke", action="store_true",
                    help="smaller than --quick (2 steps, 8-channel UNets, 32 scored samples, 1 NSGF + 1 NSF step): "
                         "checks that the script runs end to end in seconds (the test suite's smoke test)")
    ap.add_argument("--ref-steps", type=positive_int, default=None,
                    help="Euler steps of the baselines' reference row and grids (default 100; --smoke: 4)")
    ap.add_argument("--nfe", type=positive_int, nargs="+", default=[6, 13, 26], help="total NFE budgets compared")
    ap.add_argument("--baselines", nargs="+", choices=BASELINES, default=list(BASELINES),
                    help="baseline methods trained beside NSGF++ (OT-CFM is the one the target compares with)")
    ap.add_argument("extra", nargs="*", help="config overrides for the NSGF++ run only, e.g. nsgf.segment=0.5")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if "otcfm" not in args.baselines:
        ap.error("--baselines must include otcfm: the verdict compares NSGF++ with it")
    out = Path(args.out)
    clear_out(out, args.train_seeds, ap.error)
    try:
        os.nice(10)  # the machine is shared
    except OSError:
        pass
    quick = ["--train-iters", "20", "pool.batches=2", "train.time.iters=20", "eval.class_n=359"] if args.quick else []
    if args.smoke:
        quick = ["--train-iters", "2", "pool.batches=1", "pool.batch_size=32", "pool.steps=2", "train.time.iters=2",
                 *[f"train.{p}.batch_size=8" for p in ("velocity", "nsf", "time")], "model.velocity.channels=8",
                 "model.nsf.channels=8", "model.time.channels=[4,4,4,4]", "eval.n=32",
                 "eval.class_n=32", "sample.nsgf_steps=1", "sample.nsf_steps=1"]
    iters = {"train_iters": int(quick[1])} if quick else {}
    cfg = config.resolve("digits", [a for a in [*quick, *args.extra] if "=" in a], iters)
    ref_steps = args.ref_steps or (4 if args.smoke else 100)
    preset_nfe = (cfg["sample"]["nsgf_steps"] or cfg["pool"]["steps"]) + 1 + cfg["sample"]["nsf_steps"]
    nfe = sorted(set(args.nfe) | {preset_nfe})
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        per_seed = list(pool.map(bench_seed, *zip(*[(out, s, quick, args.extra, args.seeds, nfe, tuple(args.baselines),
                                                      ref_steps) for s in args.train_seeds])))
    real = real_floor(cfg, args.seeds)
    atomic_write_text(out / "results.json", json.dumps({"argv": argv, "train_seeds": args.train_seeds, "real": real,
                                                         "per_seed": plain(per_seed)}, indent=1))
    unet_steps = cfg["train"]["velocity"]["iters"] + cfg["train"]["nsf"]["iters"]

    label = "preset" + (" + " + " ".join(args.extra) if args.extra else "")
    label = "smoke" if args.smoke else "quick" if args.quick else label
    print(f"\n## digits benchmark ({label})\n")
    print(f"Command: `python benchmarks/digits.py {' '.join(argv)}`. Machine: {platform.node()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), torch {torch.__version__}, "
          f"{args.workers} training seed(s) in parallel with 1 thread each; date {time.strftime('%Y-%m-%d %H:%M')}; "
          f"wall {(time.perf_counter() - start) / 60:.1f} min.")
    print(f"Budget: UNet {cfg['model']['velocity']['channels']} ch, batch {cfg['train']['velocity']['batch_size']}; "
          f"NSGF++ = pool {cfg['pool']['batches']}x{cfg['pool']['batch_size']}x{cfg['pool']['steps']} + "
          f"{cfg['train']['velocity']['iters']} velocity + {cfg['train']['nsf']['iters']} NSF UNet steps + "
          f"{cfg['train']['time']['iters']} time-predictor steps; FM / OT-CFM = {unet_steps} UNet steps.")
    n = min(len(methods.distributions(cfg)[1].test_images), cfg["eval"]["n"])  # image_metrics scores n of them
    print(f"Protocol: training seeds {args.train_seeds}; per trained model {args.seeds} sampling seeds; W2 = exact POT "
          f"emd2 on [-1,1] pixels, {n} generated vs the {n} held-out digits; TV / confidence of a sklearn "
          f"LogisticRegression (trained on the training split) on {cfg['eval']['class_n'] or n} generated digits vs "
          "the held-out ones; NFE counted by forward hooks. Cells: mean ± std over training seeds.\n")
    print(table(per_seed, nfe, real, ref_steps))
    print("\nPer training seed (means over sampling seeds; NSGF++'s split chosen on the validation digits, "
          "data.val_fraction=0.1, never the test split, by the mean rank over W2 / TV / confidence):\n")
    print(per_seed_table(per_seed, args.train_seeds, nfe))
    print("\n" + verdict(per_seed, nfe))


if __name__ == "__main__":
    main()
