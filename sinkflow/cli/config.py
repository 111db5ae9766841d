"""`sinkflow config PRESET [overrides]`: print the resolved config tree."""

from sinkflow import config
from sinkflow.cli.common import add_config_args, resolve_args


def add_parser(sub):
    p = sub.add_parser("config", help="print the resolved config tree",
                       description="Print the resolved config tree of a preset with overrides applied.",
                       epilog="example: sinkflow config moons --train-iters 500 pool.eta=0.05")
    add_config_args(p)
    p.set_defaults(func=run)


def run(args):
    print(config.dump(resolve_args(args)), end="")
