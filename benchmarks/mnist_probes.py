"""Sampling-side probes of a trained NSGF++ MNIST run from benchmarks/mnist.py: one factor changed at a time.

    OMP_NUM_THREADS=1 python benchmarks/mnist_probes.py --out runs/bench-mnist --seed 0 --nfe 13

Each probe re-scores the seed's NSGF++ model at one total NFE with the split (k NSGF steps) the benchmark chose on
validation, on the same test digits and sample count as the table, changing one thing:

* ``as benchmarked``: nothing (must reproduce the table's cell);
* ``t̂ = batch mean``: the time predictor's per-sample t̂ replaced by its mean over the batch (is the per-sample
  prediction worth anything?);
* ``t̂ − 0.15`` / ``t̂ + 0.15``: the NSF starts earlier / later than predicted (is the predictor biased? clamped
  to the NSF's trained range [nsgf.nsf_t_min, 1]);
* ``t̂ = T`` for each ``--fixed T``: every sample's NSF starts at T (how much of a seed's score is where its
  predictor happened to put the states, and where the best start is).

``--split val`` scores on the validation digits instead (what a choice may read; ``--n`` defaults to the
benchmark's validation count there).

Training-side probes (the split of UNet steps, the NSF's training range, pool size or blur) retrain NSGF++; they
are ``benchmarks/mnist.py --methods nsgfpp --train-seeds 0 --out R2 [--velocity V --nsf N | nsgf.nsf_t_min=0.5 |
--pool P | sinkhorn.blur=0.5]``, whose table sits beside the main one (same OT-CFM scores apply: same seed, data
and protocol). Writes ``<out>/probes-seed<S>-nfe<N>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

from sinkflow.data.atomic_write import atomic_write_text
from sinkflow.runtime.run_folder import RunFolder


def bench():
    spec = importlib.util.spec_from_file_location("bench_mnist", Path(__file__).with_name("mnist.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TimeEdit(torch.nn.Module):
    """The trained time predictor with its output changed by ``edit`` (t̂ -> edit(t̂))."""

    def __init__(self, predictor, edit):
        super().__init__()
        self.predictor, self.edit = predictor, edit

    def forward(self, x):
        return self.edit(self.predictor(x))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the benchmark's --out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nfe", type=int, default=13)
    ap.add_argument("--n", type=int, default=None, help="generated digits per score (default: the benchmark's)")
    ap.add_argument("--fixed", type=float, nargs="*", default=[], help="also start every NSF at each of these times")
    ap.add_argument("--split", choices=("test", "val"), default="test")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    m = bench()
    out = Path(args.out)
    res = json.loads((out / f"seed{args.seed}" / "scores.json").read_text())
    val = {int(k.rsplit(" k", 1)[1]): v for k, v in res.items() if k.startswith(f"val NSGF++ {args.nfe} k")}
    if not val:
        sys.exit(f"no validation scores for NSGF++ at {args.nfe} NFE in {out}/seed{args.seed}/scores.json")
    k = m.choose_split(val)
    n = args.n or m.SCALES["cpu"]["val_n" if args.split == "val" else "n"]
    run = RunFolder.open(out / f"seed{args.seed}" / "nsgfpp")
    predictor = run.model("time")
    t_min = float(run.cfg["nsgf"]["nsf_t_min"])
    probes = {
        "as benchmarked": (k, None),
        "t̂ = batch mean": (k, lambda t: t.mean().expand_as(t)),
        "t̂ − 0.15": (k, lambda t: (t - 0.15).clamp(t_min, 1)),
        "t̂ + 0.15": (k, lambda t: (t + 0.15).clamp(t_min, 1)),
        **{f"t̂ = {T:g}": (k, lambda t, T=T: torch.full_like(t, T)) for T in args.fixed},
    }
    results = {}
    for name, (steps_k, edit) in probes.items():
        run._models["time"] = predictor if edit is None else TimeEdit(predictor, edit)
        run.cfg["sample"]["nsgf_steps"] = steps_k
        results[name] = m.score(run, args.nfe - 1 - steps_k, n, split=args.split)
        m.log(f"probe {name}: k={steps_k} {results[name]}")
    run._models["time"] = predictor
    path = out / f"probes-seed{args.seed}-nfe{args.nfe}{'-val' if args.split == 'val' else ''}.json"
    atomic_write_text(path, json.dumps({"k": k, "n": n, "nfe": args.nfe, "split": args.split, "probes": results},
                                       indent=1))
    print(f"NSGF++ seed {args.seed}, {args.nfe} NFE ({k} NSGF + 1 t̂ + {args.nfe - 1 - k} NSF), {n} generated vs the "
          f"{'validation' if args.split == 'val' else 'test'} digits:\n\n"
          "| probe | FD-CNN | pixel W2 | TV | confidence | mean t̂ |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        t_hat = f"{r['t_hat']:.3f}" if r.get("t_hat") is not None else "-"
        print(f"| {name} | {r['fd_cnn']:.2f} | {r['w2']:.3f} | {r['tv']:.3f} | {r['conf']:.3f} | {t_hat} |")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
