"""Arguments shared by every command that resolves a config: PRESET, key=value overrides, shorthands; the count
flags' checks and the trained-run commands' ``--device`` (opening such a run, and its ``sample.key=value``, are
``sinkflow.tools.trained``'s, which the Python API shares)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from sinkflow import config
from sinkflow.config import schema
from sinkflow.errors import SinkflowError

DEFAULT_PRESET = "8gaussians-moons"


class _Default(str):
    """The preset argparse fills in when none is named (so `train --resume RUN` can tell it was not given)."""


def preset_given(args) -> bool:
    return bool(args.preset) and not isinstance(args.preset, _Default) and "=" not in args.preset


def number(text: str):
    """A numeric shorthand's value read as ``key=value`` reads it (``schema.parse_value``), then checked by its key's
    type: argparse's int / float refused ``--train-iters 1e3`` (``train.velocity.iters=1e3`` is 1000) and took
    ``--lr 1_000`` (``train.velocity.lr=1_000`` is refused). Not a number: the text, which its key refuses in one
    line naming the flag."""
    value = schema.parse_value(text)
    return value if schema.is_number(value) else text


def add_config_args(p: argparse.ArgumentParser, preset_required: bool = False) -> None:
    p.add_argument("preset", nargs=None if preset_required else "?", default=_Default(DEFAULT_PRESET),
                   help=f"preset name (see `sinkflow presets`; default {DEFAULT_PRESET}), or a .yaml config file "
                        "(`sinkflow config PRESET > my.yaml`)")
    p.add_argument("overrides", nargs="*", default=[], metavar="key.sub=value",  # default: optional in the usage error
                   help="config overrides, e.g. pool.eta=0.05")
    g = p.add_argument_group("shorthands (each sets every key it names)")
    g.add_argument("--train-iters", type=number, help="train.*.iters: every training phase")
    g.add_argument("--batch-size", type=number, help="train.*.batch_size: every training phase")
    g.add_argument("--lr", type=number, help="train.*.lr: every training phase")
    g.add_argument("--precision", help="train.*.precision: every training phase (auto, fp32, bf16, fp16; sampling "
                                       "has its own sample.precision)")
    g.add_argument("--seed", type=number, help="experiment.seed")
    g.add_argument("--device", help="experiment.device (auto, cpu, cuda, cuda:1)")
    g.add_argument("--method", help=f"experiment.method ({', '.join(schema.METHODS)})")
    g.add_argument("--pool-batches", type=number, help="pool.batches")
    g.add_argument("--sinkhorn-batch", type=number, help="pool.batch_size (the Sinkhorn batch)")
    g.add_argument("--name", help="experiment.name (the run folder's name)")


def shorthands(args) -> dict:
    return {k: getattr(args, k, None) for k in config.SHORTHANDS}


def split_preset(args) -> None:
    """`sinkflow train key=value` (no preset) means the default preset with overrides."""
    if args.preset and "=" in args.preset:
        args.overrides = [args.preset, *args.overrides]
        args.preset = DEFAULT_PRESET


def refuse_plain_folder(path: Path, command: str) -> None:
    """A folder given where a preset or run goes that is no run (no config.yaml, meta.json or checkpoints/; a run that
    lost its config.yaml is ``read_config``'s): most often the user's own images, for which the fix is the folder
    preset. ``sinkflow train imgs/`` named it (``config._own_data_hint``); preflight, doctor and lr-find said only
    "not a sinkflow run folder", a user's first check of their folder left without the command that checks it."""
    if any((path / name).exists() for name in ("config.yaml", "meta.json", "checkpoints")):
        return
    raise SinkflowError(f"{path} is a folder without config.yaml: not a sinkflow run folder",
                        "name a run folder (it holds config.yaml), a preset or a .yaml config; for a folder of your "
                        f"own images: `sinkflow {command} folder {shlex.quote(f'data.path={path}')}` (docs/data.md)")


def run_folder_arg(args, command: str) -> Path | None:
    """The run folder a tool (doctor, lr-find) was pointed at in place of a preset, or None. Such a tool reads the
    run's own config.yaml, so an override or shorthand given beside it would be dropped in silence: refused. All but
    ``--device``, where this call runs (as for sample / eval / tune: ``add_device_arg``): a run trained with
    ``--device cuda`` was refused on a CPU with the fix "use --device cpu", which these commands then refused."""
    if not str(args.preset).strip() or not Path(str(args.preset)).is_dir():  # "" (an unset $RUN) is no folder
        return None
    refuse_plain_folder(Path(str(args.preset)), command)
    given = [*args.overrides, *(f"--{k.replace('_', '-')}" for k, v in shorthands(args).items()
                                if v is not None and k != "device")]
    if given:
        raise SinkflowError(f"`sinkflow {command} RUN` runs on the run's own config.yaml; {given[0]} would be ignored",
                            f"drop it, or check a new config: `sinkflow {command} PRESET {given[0]} ...`")
    return Path(str(args.preset))


def resolve_args(args) -> dict:
    split_preset(args)
    return config.resolve(str(args.preset), args.overrides, shorthands(args))  # a plain str: config.yaml dumps it


# ---- counts and sizes: one place, the same one-line errors for every command ------------------------------

# flag: (example, sanity bound). --n is bounded by memory (check_sample_memory, once the data shape is known);
# --steps / --seeds by time: 10^5 Euler steps or 10^3 sampling seeds is far past any use, a typo past it would
# run for days
COUNT_FLAGS = {"n": ("--n", 1024, None), "steps": ("--steps", 10, schema.MAX_EULER_STEPS),
               "seeds": ("--seeds", 3, 1000),
               "overfit_batch": ("--overfit-batch", 16, None)}


def check_counts(args) -> None:
    """Every count flag a command has (``--n``, ``--steps``, ``--seeds``, ``--overfit-batch``) is >= 1 when given: a 0 never means
    "the default" in silence and a negative never runs (``sample --steps -1`` used to write the source noise)."""
    for attr, (flag, example, most) in COUNT_FLAGS.items():
        value = getattr(args, attr, None)
        if value is not None and value < 1:
            raise SinkflowError(f"{flag} {value} must be a whole number >= 1",
                                f"e.g. {flag} {example}, or leave it out for the default")
        if value is not None and most is not None and value > most:
            raise SinkflowError(f"{flag} {value} is more than {most:,}", f"use {flag} {most:,} or fewer")


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """`--device` of the commands that read a trained run (sample, eval, tune): a run trained with `--device cuda` was
    refused on a machine without CUDA with the fix "use --device cpu", which these commands did not take."""
    p.add_argument("--device", help="where the networks run for this call: auto, cpu, cuda or cuda:N (default: the "
                   "run's experiment.device; config.yaml is unchanged)")
