"""Arguments shared by every command that resolves a config: PRESET, key=value overrides, shorthands."""

from __future__ import annotations

import argparse

from sinkflow import config
from sinkflow.config import schema

DEFAULT_PRESET = "8gaussians-moons"


def add_config_args(p: argparse.ArgumentParser, preset_required: bool = False) -> None:
    p.add_argument("preset", nargs=None if preset_required else "?", default=DEFAULT_PRESET,
                   help=f"preset name (see `sinkflow presets`; default {DEFAULT_PRESET})")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, e.g. pool.eta=0.05")
    g = p.add_argument_group("shorthands (each sets every key it names)")
    g.add_argument("--train-iters", type=int, help="train.*.iters: every training phase")
    g.add_argument("--batch-size", type=int, help="train.*.batch_size: every training phase")
    g.add_argument("--lr", type=float, help="train.*.lr: every training phase")
    g.add_argument("--seed", type=int, help="experiment.seed")
    g.add_argument("--device", help="experiment.device (auto, cpu, cuda, cuda:1)")
    g.add_argument("--method", help=f"experiment.method ({', '.join(schema.METHODS)})")
    g.add_argument("--pool-batches", type=int, help="pool.batches")
    g.add_argument("--sinkhorn-batch", type=int, help="pool.batch_size (the Sinkhorn batch)")
    g.add_argument("--name", help="experiment.name (the run folder's name)")


def shorthands(args) -> dict:
    return {k: getattr(args, k, None) for k in config.SHORTHANDS}


def split_preset(args) -> None:
    """`sinkflow train key=value` (no preset) means the default preset with overrides."""
    if args.preset and "=" in args.preset:
        args.overrides = [args.preset, *args.overrides]
        args.preset = DEFAULT_PRESET


def resolve_args(args) -> dict:
    split_preset(args)
    return config.resolve(args.preset, args.overrides, shorthands(args))
