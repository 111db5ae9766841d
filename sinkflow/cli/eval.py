"""`sinkflow eval RUN`: the paper's metric for the run's data, over several sampling seeds."""

import sys

from sinkflow.cli.common import add_device_arg
from sinkflow.errors import SinkflowError
from sinkflow.tools.trained import open_trained, unrecorded, with_sample_overrides


def add_parser(sub):
    p = sub.add_parser("eval", help="evaluate a trained run",
                       description="2D: exact W2 (POT) at eval.steps Euler steps on eval.n test samples, mean and "
                                   "spread over eval.seeds sampling seeds, beside the paper's Table 1 row. "
                                   "Images: pixel W2, the digit classifier's histogram TV and confidence, FD-CNN "
                                   "(and FID when Inception weights are configured). A normalizing flow: first "
                                   "validation and test bits/dim (exact likelihood), then the image metrics of its "
                                   "samples. Scores are appended to the run's metrics.jsonl.",
                       epilog="example: sinkflow eval runs/moons-nsgf-20261122-120000 --seeds 5; "
                              "sinkflow eval runs/mnist-nsgfpp-... sample.t_shift=-0.1 sample.nsf_steps=1")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("overrides", nargs="*", default=[], metavar="sample.key=value",
                   help="sampling settings for this evaluation only, e.g. sample.t_shift=-0.1 (the run is not changed; "
                        "the record in metrics.jsonl names them)")
    p.add_argument("--split", choices=("test", "val"), default="test",
                   help="the held-out images scored against: test (default), or val, the validation split of a run "
                        "trained with data.val_fraction > 0, to choose sample.* settings without reading the test "
                        "split (the record in metrics.jsonl says split: val)")
    p.add_argument("--seeds", type=int, help="sampling seeds (default eval.seeds)")
    p.add_argument("--n", type=int, help="samples per seed for every metric (default eval.n, and eval.class_n for "
                   "the image classifier's columns; a flow's validation bits/dim is on every validation image, as "
                   "model selection scores it)")
    add_device_arg(p)
    p.set_defaults(func=run)


def run(args):
    from sinkflow.eval.report import evaluate  # torch loads here: `--help` stays fast
    run_ = open_trained(args.run_dir, args.device, log_best_effort=True)  # a read-only run folder: scores printed, record skipped
    steps = [o for o in args.overrides if o.partition("=")[0].strip() == "sample.steps"]
    if steps:  # recorded with the scores as applied, while the table scored eval.steps
        raise SinkflowError(f"`sinkflow eval` scores at the run's eval.steps, so '{steps[0]}' would not be used",
                            f"score other step counts by setting them in the run: `sinkflow train --resume "
                            f"{args.run_dir} 'eval.steps=[2, 10]'` (then `sinkflow eval {args.run_dir}`), or "
                            f"`sinkflow sample {args.run_dir} --steps N`")
    qmc = [o for o in args.overrides if o.partition("=")[0].strip() == "sample.qmc"]
    if qmc:  # so too: recorded as {"sample": {"qmc": true}} beside scores drawn as eval.protocol says, unchanged
        raise SinkflowError(f"`sinkflow eval` draws its source as the run's eval.protocol says, so '{qmc[0]}' "
                            "would not be used", f"set it in the run: `sinkflow train --resume {args.run_dir} "
                            f"eval.protocol=iid` (or qmc), then `sinkflow eval {args.run_dir}`")
    run_ = with_sample_overrides(run_, args.overrides, "eval", args.run_dir, {"eval.n": "--n", "eval.seeds": "--seeds"})
    changed = run_.sampling_changes()
    if changed:  # the table did not say it was another sampler's (its record did)
        print("sampled with " + ", ".join(f"sample.{k}={v}" for k, v in changed.items()) + " for this evaluation "
              "(recorded with its scores; the run's config.yaml keeps its own)")
    try:
        print(evaluate(run_, seeds=args.seeds, n=args.n, split=args.split))
    finally:
        run_.logger.close()
    if run_.logger.failed is not None:
        print(f"sinkflow: warning: {unrecorded(run_.dir / 'metrics.jsonl', run_.logger.failed)}", file=sys.stderr)
