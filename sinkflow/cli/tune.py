"""`sinkflow tune RUN [--nfe N ...]`: choose a trained image run's sampler on its validation images."""

from __future__ import annotations

import json
import statistics
import sys

from sinkflow.cli.common import add_device_arg
from sinkflow.tools.trained import open_trained


def add_parser(sub):
    p = sub.add_parser(
        "tune", help="choose a trained image run's sampler on its validation images",
        description="Scores every candidate sampler at a budget of network evaluations (NFE) against the run's "
                    "validation split (data.val_fraction > 0, held out of training; never the test split) and "
                    "prints the best one's sample.* settings, ready for `sinkflow sample` and `sinkflow eval`. "
                    "NSGF++: the NSGF steps k, the straight flow's steps (NFE - 1 - k) and the shift of the "
                    "predictor's t_hat; FM / OT-CFM: the time warp of the Euler grid; a normalizing flow: its "
                    "sampling temperature. Scored by FD-CNN (digits, "
                    "mnist) or FID (eval.inception_weights). config.yaml is not changed; the scores go to "
                    "RUN/tune.json.",
        epilog="example: sinkflow train mnist data.val_fraction=0.1 ...; sinkflow tune runs/mnist-nsgfpp-... "
               "--nfe 6 13")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--nfe", type=int, nargs="+", help="total network evaluations per sample (default: what the "
                   "run's own sampler spends)")
    p.add_argument("--n", type=int, help="generated samples per candidate and seed (default eval.n, at most the "
                   "validation split)")
    p.add_argument("--seeds", type=int, default=1, help="sampling seeds per candidate (default 1)")
    add_device_arg(p)
    p.set_defaults(func=run)


def run(args):
    from sinkflow import data, methods
    from sinkflow.config import schema
    from sinkflow.data.memory import check_sample_memory
    from sinkflow.errors import SinkflowError
    from sinkflow.eval.report import check_eval_split
    from sinkflow.runtime.data_record import check_split_files
    from sinkflow.tools import tune

    run_ = open_trained(args.run_dir, args.device)
    cfg = run_.cfg
    key = "sample.t_shift=-0.1" if "sample.t_shift" in schema.used(cfg) else "sample.time_warp=0.5"  # its own keys
    check_eval_split(cfg, "val", who="sinkflow tune chooses on the validation split, but",
                     points_fix=f"compare a run of points' samplers on its test points: sinkflow eval RUN {key} "
                                "(any sample.* key the run reads)")
    totals = list(dict.fromkeys(args.nfe or [tune.current(cfg)[0]]))  # --nfe 13 13: one budget, scored once
    for total in totals:  # every budget's candidates, before anything is decoded or sampled
        if total < 1:
            raise SinkflowError(f"--nfe {total}: a sample needs at least one network evaluation", "use --nfe 1 or more")
        tune.candidates(cfg, total)
    check_split_files(run_, data.target_split_info(cfg), doing="tune")
    run_.require_trained()  # before the classifier and the validation reference are built
    target = data.distributions(cfg)[1]
    metric = tune.metric_of(cfg, target)
    held = len(target.val_index)
    if args.n is not None and not 2 <= args.n <= held:
        raise SinkflowError(f"--n {args.n} images, but the validation split of {target.name} holds {held} (and a "
                            "Fréchet distance needs 2)", f"use --n between 2 and {held}")
    n = min(args.n or cfg["eval"]["n"], held)
    check_sample_memory(n, cfg, "--n" if args.n else "eval.n")
    name = {"fd_cnn": "FD-CNN", "fid": "FID"}[metric]
    for total in totals:
        scored = tune.tune(run_, total, n, args.seeds, metric)
        own_total, own = tune.current(cfg)
        own = own if own_total == total else None
        best, value, kept = tune.recommend(scored, own)
        lowest = tune.choose(scored)
        keys = list(scored[0][0])
        budget = f"{total} NFE" if methods.of(cfg).takes_steps else "one pass"
        print(f"{cfg['experiment']['method']} samplers at {budget}: {name} of {n} samples x {args.seeds} seed(s) "
              f"against the validation split ({held} images); lower is better")
        print("  " + "  ".join(f"{k:>10}" for k in keys) + f"  {name:>8}")
        same = tune.repeats(scored)
        for i, (settings, v, per_seed) in enumerate(scored):
            mark = "  <- best" if settings == best else ("  (the run's own)" if settings == own else "")
            if i in same:  # named by the settings it differs in
                differs = {k: val for k, val in same[i].items() if settings.get(k) != val}
                mark += f"  (the samples of {' '.join(o.removeprefix('sample.') for o in tune.overrides(differs))})"
            spread = f" ± {statistics.stdev(per_seed):.2f}" if args.seeds > 1 else ""
            print("  " + "  ".join(f"{settings[k]:>10g}" for k in keys) + f"  {v:8.2f}{spread}{mark}")
        choice = " ".join(tune.overrides(best))
        mine = next((v for s, v, _ in scored if s == own), None)
        beside = ("" if mine is None else " (the run's own sampler)" if own == best
                  else f" (the run's own sampler: {mine:.2f})")
        print(f"  best at {budget}: {choice}: {name} {value:.2f} on validation{beside}")
        if kept:  # the lowest mean won by less than the noise of the paired seeds: not a better sampler
            print(f"  the lowest ({' '.join(tune.overrides(lowest[0]))}: {lowest[1]:.2f}) beats the run's own by "
                  "less than twice the standard error of their seed-by-seed differences: the run's own is kept")
        elif mine is not None and own != best:
            if args.seeds == 1:
                print(f"  one seed measures no noise: `--seeds 3` shows whether a margin of {mine - value:.2f} is "
                      "more than the sampling noise")
        elif (note := tune.margin_note(scored, best)) is not None:  # nothing of the run's own to compare with
            print(f"  {note}")
        print(f"  sinkflow sample {args.run_dir} {choice} --out samples.png")
        print(f"  sinkflow eval {args.run_dir} {choice}    (the test split: the score to report)")
        record = {"metric": metric, "split": "val", "n": n, "seeds": args.seeds, "best": best,
                  "scores": [{"sample": s, metric: v, f"{metric}_per_seed": per_seed} for s, v, per_seed in scored]}
        keep(run_.dir / "tune.json", str(total), record)  # each budget as it finishes: a stop loses no other


def keep(path, key: str, record: dict) -> None:
    """``record`` under ``key`` in the JSON file ``path``, beside what it holds; a file that cannot be read or written
    is left as it is, with a warning (the scores are printed above). An earlier tune's record of the same budget is
    replaced, and the line says so with what it had scored: a quick `--n 16` after a careful `--n 1000 --seeds 3`
    replaced the careful scores with nothing said."""
    from sinkflow.data.atomic_write import atomic_write_text

    try:
        old = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(old, dict):  # `[]`, `null`: a traceback at the end of the search, its scores unsaved
            raise ValueError("not a JSON object")
        atomic_write_text(path, json.dumps({**old, key: record}, indent=1))
        earlier = old.get(key)
        replaced = (f" (replacing an earlier tune's scores at {key} NFE: {earlier.get('n')} samples x "
                    f"{earlier.get('seeds')} seed(s))" if isinstance(earlier, dict) else "")
        print(f"wrote {path}{replaced}")
    except (OSError, ValueError) as exc:
        print(f"sinkflow: warning: could not record the scores in {path} ({exc})", file=sys.stderr)
