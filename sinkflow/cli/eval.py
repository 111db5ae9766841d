"""`sinkflow eval RUN`: the paper's metric for the run's data, over several sampling seeds."""

from sinkflow.eval.report import evaluate
from sinkflow.runner.run import Run


def add_parser(sub):
    p = sub.add_parser("eval", help="evaluate a trained run",
                       description="2D: exact W2 (POT) at eval.steps Euler steps on eval.n test samples, mean and "
                                   "spread over eval.seeds sampling seeds, beside the paper's Table 1 row. "
                                   "Images: the offline metrics (and FID when Inception weights are configured).",
                       epilog="example: sinkflow eval runs/moons-nsgf-20261122-120000 --seeds 5")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--seeds", type=int, help="sampling seeds (default eval.seeds)")
    p.add_argument("--n", type=int, help="test samples (default eval.n)")
    p.set_defaults(func=run)


def run(args):
    print(evaluate(Run.open(args.run_dir), seeds=args.seeds, n=args.n))
