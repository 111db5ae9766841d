"""Half-precision sampling against fp32 on trained MNIST runs of benchmarks/mnist.py: same noise, same sampler.

    OMP_NUM_THREADS=1 python benchmarks/sample_precision.py --out R --train-seeds 0 1 2 3 4 --workers 2
    python benchmarks/sample_precision.py --out R --device cuda      # the same on a GPU's own kernels

``sample.precision`` runs the sampled networks under bf16 or fp16 autocast (the Euler state and its updates stay
float32). Does that change the digits? For each training seed, method (NSGF++, OT-CFM, FM) and total NFE of --nfe,
the sampler the benchmark chose on validation (NSGF++'s k and t̂ shift, a baseline's time warp) draws --n digits
from the same source noise under each precision, for --sampling-seeds noise draws. Reported per method and NFE:
FD-CNN under fp32; each half precision's paired change (same noise, mean ± sd over training x sampling seeds) beside
fp32's own sampling-seed sd (how far a new noise draw moves the score: a change well inside it is no change a user
sees); the samples' mean and largest |Δ| from fp32's (pixels in [-1, 1]); for NSGF++ the mean |Δt̂| of the predicted
start. A CPU's autocast rounds the networks' inputs and outputs to the same formats as a GPU's, so the CPU answers
what the formats do to samples; how each library accumulates its products is its own (cuBLAS may reduce fp16 products
in fp16), so ``--device cuda`` on a GPU is the confirmation; what the formats do to speed is the GPU's
(``sampling.py``).

Resumable: each training seed's numbers are written to ``<out>/seed<S>/precision.json`` as they are made. Writes
``<out>/sample_precision.json`` and ``<out>/sample_precision.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from sinkflow import data
from sinkflow.data.atomic_write import atomic_write_text
from sinkflow.eval import fd_cnn
from sinkflow.eval.images import fd_cnn_reference
from sinkflow.eval.points import generate
from sinkflow.runtime.run_folder import RunFolder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import at_least, checked_device, one_line_errors, positive_int  # noqa: E402
import mnist as bench_mnist  # noqa: E402  (benchmarks/mnist.py: its runs, sampler choices and ``sampling`` block)

LABELS = {"nsgfpp": "NSGF++", "otcfm": "OT-CFM (warped)", "fm": "FM (warped)"}  # each method's chosen sampler's row


def sampler_keys(method: str, tag: str | None, total: int) -> tuple[dict, int]:
    """(``sample.*`` values, steps) of a method's chosen sampler at ``total`` NFE (untagged: the run's own)."""
    if method == "nsgfpp":
        k, shift = bench_mnist.parse_sampler(tag) if tag else (None, 0.0)
        if k is None:
            raise SystemExit(f"no NSGF++ sampler chosen at {total} NFE: run benchmarks/mnist.py with --nfe {total}")
        return {"nsgf_steps": k, "t_shift": shift}, total - 1 - k
    return ({"time_warp": float(tag[1:])} if tag else {}), total


def seed_precision(out: Path, seed: int, methods: list[str], nfe: list[int], precisions: list[str], n: int,
                   sampling_seeds: int, device: str) -> dict:
    """One training seed: ``{method: {nfe: {precision: [per sampling seed {fd, dpix, dmax, dt}]}}}``, resumable."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    path = out / f"seed{seed}" / "precision.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    chosen = bench_mnist.from_scores(out, seed, nfe)["sampler"]
    cnn = None
    for method in methods:
        run = RunFolder.open(out / f"seed{seed}" / method, [f"experiment.device={device}"])
        if cnn is None:
            target = data.distributions(run.cfg)[1]
            cnn = fd_cnn_reference(target, run.cfg["data"]["root"], target.test_set(len(target.test_images)), n,
                                   False)
            done[f"floor n{n}"] = cnn["floor"]  # as many real training digits: the score's value at this n
        for total in nfe:
            key = f"{method} {total} n{n}"
            have = done.get(key, {})
            if all(len(have.get(p, [])) >= sampling_seeds for p in precisions):
                continue
            keys, steps = sampler_keys(method, chosen.get(LABELS[method], {}).get(total), total)
            rows = {p: [] for p in precisions}
            for s in range(sampling_seeds):
                x = {}
                for p in precisions:
                    x[p], info = generate(run.variant(sample={"precision": p, **keys}), n, steps, seed=1000 + s)
                    t_hat = info.get("t_hat")
                    x[p] = (x[p].float().cpu(), None if t_hat is None else t_hat.float().cpu())
                ref, ref_t = x[precisions[0]]
                for p in precisions:
                    xs, ts = x[p]
                    rows[p].append({"fd": fd_cnn.fd(fd_cnn.features(cnn["net"], xs), cnn["real"]),
                                    "dpix": float((xs - ref).abs().mean()), "dmax": float((xs - ref).abs().max()),
                                    "dt": None if ts is None else float((ts - ref_t).abs().mean())})
            done[key] = {"sampler": keys, "steps": steps, **rows}
            atomic_write_text(path, json.dumps(done, indent=1))
            bench_mnist.log(f"seed {seed}: {method} NFE {total}: " + ", ".join(
                f"{p} {statistics.fmean(r['fd'] for r in rows[p]):.2f}" for p in precisions))
    return done


def summary(per_seed: dict[int, dict], methods: list[str], nfe: list[int], precisions: list[str], n: int,
            sampling_seeds: int) -> list[dict]:
    """One row per (method, NFE): fp32's FD-CNN, its sampling-seed sd, and each half precision's paired change, over
    the first ``sampling_seeds`` noise draws (an earlier invocation may have stored more)."""
    base, rows = precisions[0], []
    for method in methods:
        for total in nfe:
            cells = [{p: d[f"{method} {total} n{n}"][p][:sampling_seeds] for p in precisions}
                     for d in per_seed.values() if f"{method} {total} n{n}" in d]
            if not cells:
                continue
            ref = [r["fd"] for c in cells for r in c[base]]
            within = [statistics.stdev([r["fd"] for r in c[base]]) for c in cells if len(c[base]) > 1]
            row = {"method": LABELS[method], "nfe": total, "fd": statistics.fmean(ref), "pairs": len(ref),
                   "seed_sd": statistics.fmean(within) if within else None}
            for p in precisions[1:]:
                delta = [r["fd"] - b["fd"] for c in cells for r, b in zip(c[p], c[base])]
                dts = [r["dt"] for c in cells for r in c[p] if r["dt"] is not None]
                row[p] = {"delta": statistics.fmean(delta), "delta_sd": statistics.stdev(delta) if len(delta) > 1
                          else 0.0, "dpix": statistics.fmean(r["dpix"] for c in cells for r in c[p]),
                          "dmax": max(r["dmax"] for c in cells for r in c[p]),
                          "dt": statistics.fmean(dts) if dts else None}
            rows.append(row)
    return rows


def table(rows: list[dict], precisions: list[str]) -> str:
    head = "| " + " | ".join(["method", "NFE", "FD-CNN, fp32", "sampling-seed sd"] + [
        f"{p}: ΔFD-CNN (paired) | {p}: mean / max \\|Δx\\| | {p}: mean \\|Δt̂\\|" for p in precisions[1:]]) + " |"
    lines = [head, "|" + "---|" * (4 + 3 * (len(precisions) - 1))]
    for r in rows:
        sd = f"{r['seed_sd']:.2f}" if r["seed_sd"] is not None else "-"
        cells = []
        for p in precisions[1:]:
            c = r[p]
            cells += [f"{c['delta']:+.2f} ± {c['delta_sd']:.2f}", f"{c['dpix']:.4f} / {c['dmax']:.3f}",
                      f"{c['dt']:.4f}" if c["dt"] is not None else "-"]
        lines.append("| " + " | ".join([r["method"], str(r["nfe"]), f"{r['fd']:.2f}", sd, *cells]) + " |")
    return "\n".join(lines)


@one_line_errors
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="benchmarks/mnist.py's --out (its runs and validation choices)")
    ap.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", choices=tuple(LABELS), default=list(LABELS))
    ap.add_argument("--nfe", type=positive_int, nargs="+", default=[6, 13, 60])
    ap.add_argument("--precisions", nargs="+", choices=("fp32", "bf16", "fp16"), default=["fp32", "bf16", "fp16"],
                    help="the first is the reference the others are paired with")
    # '--sampling-seeds 0' skipped every cell (none short of 0 draws) and wrote an empty table; a Fréchet distance
    # needs 2 digits
    ap.add_argument("--n", type=at_least(2), default=1000, help="generated digits per score (the CPU table's 1,000)")
    ap.add_argument("--sampling-seeds", type=positive_int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=positive_int, default=1, help="training seeds in parallel, one thread each")
    args = ap.parse_args(argv)
    checked_device(args.device, ap.error)
    if args.precisions[0] != "fp32":
        ap.error("the first of --precisions is the reference: fp32")
    out, nfe = Path(args.out), sorted(set(args.nfe))
    start = time.perf_counter()
    jobs = [(out, s, args.methods, nfe, args.precisions, args.n, args.sampling_seeds, args.device)
            for s in args.train_seeds]
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            per_seed = dict(zip(args.train_seeds, pool.map(seed_precision, *zip(*jobs))))
    else:
        per_seed = {j[1]: seed_precision(*j) for j in jobs}
    rows = summary(per_seed, args.methods, nfe, args.precisions, args.n, args.sampling_seeds)
    floor = next(iter(per_seed.values()))[f"floor n{args.n}"]
    head = (f"Command: `python benchmarks/sample_precision.py {' '.join(sys.argv[1:] if argv is None else argv)}`; "
            f"device {args.device}, torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}; wall "
            f"{(time.perf_counter() - start) / 60:.1f} min. FD-CNN of {args.n} generated digits vs the test digits "
            f"(floor: {args.n} real training digits, {floor:.2f}), each method's sampler chosen on validation by "
            f"benchmarks/mnist.py; paired = the same source noise; "
            f"{len(args.train_seeds)} training x {args.sampling_seeds} sampling seeds.")
    text = head + "\n\n" + table(rows, args.precisions)
    atomic_write_text(out / "sample_precision.json", json.dumps({"argv": sys.argv[1:] if argv is None else argv,
                                                                 "floor": floor, "rows": rows}, indent=1))
    atomic_write_text(out / "sample_precision.md", text + "\n")
    print(text)


if __name__ == "__main__":
    main()
