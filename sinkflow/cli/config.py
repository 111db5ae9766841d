"""`sinkflow config PRESET [overrides]`: print the resolved keys a run of it reads (``--all``: every key).

A 2D NSGF run reads no UNet, flow or time-predictor key: printing them would hide the ones that matter.
``--doc`` and ``--base`` print docs/config.md and presets/_base.yaml, both generated from the schema.
"""

from sinkflow import config
from sinkflow.cli.common import add_config_args, preset_given, resolve_args, shorthands, split_preset
from sinkflow.config import render, schema
from sinkflow.errors import SinkflowError


def add_parser(sub):
    p = sub.add_parser("config", help="print the resolved config tree",
                       description="Print the keys of a preset, with overrides applied, that its method, model "
                                   "kinds and data read, each with its meaning.",
                       epilog="example: sinkflow config moons --train-iters 500 pool.eta=0.05")
    add_config_args(p)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--all", action="store_true", help="every key of the tree, also those this run does not read")
    out.add_argument("--plain", action="store_true", help="every key, plain YAML without comments (as config.yaml)")
    out.add_argument("--doc", action="store_true", help="print the reference of every key (docs/config.md)")
    out.add_argument("--base", action="store_true", help="print every default (sinkflow/config/presets/_base.yaml)")
    p.set_defaults(func=run)


def run(args):
    if args.doc or args.base:  # the schema's, whatever the preset: a preset or override beside them was dropped
        named = [args.preset] if preset_given(args) else []  # `config --doc pool.eta=1`: an override, not a preset
        split_preset(args)
        given = [*named, *args.overrides,
                 *(f"--{k.replace('_', '-')}" for k, v in shorthands(args).items() if v is not None)]
        if given:
            flag = "--doc" if args.doc else "--base"
            raise SinkflowError(f"`sinkflow config {flag}` prints the schema's every key and default; {given[0]} "
                                "would be ignored", f"drop it, or see a preset's resolved keys: `sinkflow config "
                                f"{given[0] if named else 'PRESET ' + given[0]}`")
    if args.doc:
        print(render.doc_markdown(), end="")
        return
    if args.base:
        print(render.base_yaml(), end="")
        return
    tree = resolve_args(args)
    if args.plain:
        print(config.dump(tree), end="")
        return
    specs = schema.keys(tree) if args.all else schema.used(tree)
    exp = tree["experiment"]
    hidden = len(schema.keys(tree)) - len(specs)
    print(f"# preset {exp['preset']}, method {exp['method']}: "
          + ("every key" if args.all else f"the keys this run reads ({hidden} others: --all)"))
    print(render.to_yaml(tree, specs), end="")
