"""One config tree for every experiment.

A preset is a readable YAML file in ``presets/``; it may ``inherit`` another preset (``_base`` holds
every key that exists). The resolved tree is a nested dict whose leaves' types are fixed by the base:
an override ``key.sub=value`` must name an existing key and match its type, so a typo can never be
silently ignored. Shorthand flags (``--train-iters``...) expand to *every* key they concern.
"""

from __future__ import annotations

import copy
import difflib
import math
from importlib import resources
from typing import Any

import yaml

from sinkflow.errors import SinkflowError

PRESET_PACKAGE = "sinkflow.config.presets"

# Shorthand flag -> glob-like key patterns ("*" matches one level). Every matching key is set.
SHORTHANDS: dict[str, tuple[str, ...]] = {
    "train_iters": ("train.*.iters",),
    "batch_size": ("train.*.batch_size",),
    "lr": ("train.*.lr",),
    "seed": ("experiment.seed",),
    "device": ("experiment.device",),
    "method": ("experiment.method",),
    "pool_batches": ("pool.batches",),
    "sinkhorn_batch": ("pool.batch_size",),
    "name": ("experiment.name",),
}


def preset_names() -> list[str]:
    """Public presets (files starting with ``_`` are building blocks, not presets)."""
    files = resources.files(PRESET_PACKAGE).iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml") and not f.name.startswith("_"))


def _read_preset(name: str) -> dict:
    path = resources.files(PRESET_PACKAGE) / f"{name}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(name, preset_names(), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"choose one of: {', '.join(preset_names())}"
        raise SinkflowError(f"unknown preset '{name}'", hint)
    return yaml.safe_load(path.read_text()) or {}


def _merge(base: dict, over: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, f"{where}{key}.")
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge(base: dict, over: dict) -> dict:
    """``over``'s values on top of ``base``'s tree (a new tree)."""
    return _merge(base, over)


def load_preset(name: str) -> dict:
    """Resolve a preset through its ``inherit`` chain into a full tree."""
    raw = _read_preset(name)
    parent = raw.pop("inherit", None)
    tree = load_preset(parent) if parent else {}
    tree = _merge(tree, raw)
    if parent is None and name != "_base":
        tree = _merge(load_preset("_base"), tree)
    return tree


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (leaves only; lists are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, full + "."))
        else:
            out[full] = value
    return out


def get(tree: dict, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        node = node[part]
    return node


def _set(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node[part]
    node[leaf] = value


def parse_value(text: str) -> Any:
    """Parse an override's value the way YAML would, accepting ``1e-3`` as a float too."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value) if value.lower() not in ("nan", "inf", "-inf", "infinity") else value
        except ValueError:
            return value
    return value


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def coerce(key: str, old: Any, new: Any) -> Any:
    """Return ``new`` converted to the type of ``old``, or raise a one-line error."""
    if old is None or new is None:
        return new
    if isinstance(old, bool):
        if isinstance(new, bool):
            return new
    elif isinstance(old, int):
        if isinstance(new, int) and not isinstance(new, bool):
            return new
        if isinstance(new, float) and new.is_integer():
            return int(new)
    elif isinstance(old, float):
        if isinstance(new, (int, float)) and not isinstance(new, bool) and math.isfinite(new):
            return float(new)
    elif isinstance(old, str):
        if isinstance(new, str):
            return new
        if isinstance(new, (int, float)) and not isinstance(new, bool):
            return str(new)
    elif isinstance(old, list):
        if isinstance(new, list):
            return new
        if isinstance(new, (int, float, str)) and not isinstance(new, bool):
            return [new]
    raise SinkflowError(
        f"config key '{key}' expects {_type_name(old)} (default {old!r}) but got {_type_name(new)} {new!r}",
        f"pass a {_type_name(old)}, e.g. {key}={old if not isinstance(old, list) else old!r}",
    )


def expand_key(tree: dict, pattern: str) -> list[str]:
    """Keys of ``tree`` matching a pattern whose ``*`` matches exactly one level."""
    parts = pattern.split(".")
    return [
        key
        for key in flatten(tree)
        if len(key.split(".")) == len(parts)
        and all(p == "*" or p == k for p, k in zip(parts, key.split(".")))
    ]


def set_key(tree: dict, key: str, value: Any) -> None:
    """Set an existing leaf with type checking; unknown keys name the closest valid key."""
    leaves = flatten(tree)
    if key not in leaves:
        close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.5)
        if not close:  # match on the last component, e.g. "iters" -> "train.velocity.iters"
            close = [k for k in leaves if k.split(".")[-1] == key.split(".")[-1]][:1]
        hint = f"did you mean '{close[0]}'?" if close else "run `sinkflow config PRESET` to list the keys"
        raise SinkflowError(f"unknown config key '{key}'", hint)
    _set(tree, key, coerce(key, leaves[key], value))


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` strings in order; returns a new tree."""
    tree = copy.deepcopy(tree)
    for item in overrides:
        if "=" not in item:
            raise SinkflowError(f"override '{item}' is not of the form key.sub=value", "write e.g. train.velocity.lr=1e-3")
        key, _, text = item.partition("=")
        set_key(tree, key.strip(), parse_value(text.strip()))
    return tree


def apply_shorthands(tree: dict, values: dict[str, Any]) -> dict:
    """Expand shorthand values (``{"train_iters": 5}``) onto every key they concern."""
    tree = copy.deepcopy(tree)
    for name, value in values.items():
        if value is None:
            continue
        for pattern in SHORTHANDS[name]:
            for key in expand_key(tree, pattern):
                set_key(tree, key, value)
    return tree


def resolve(preset: str, overrides: list[str] | None = None, shorthands: dict[str, Any] | None = None) -> dict:
    """Preset -> shorthands -> explicit overrides (explicit keys win), validated."""
    tree = load_preset(preset)
    tree["experiment"]["preset"] = preset
    tree = apply_shorthands(tree, shorthands or {})
    tree = apply_overrides(tree, overrides or [])
    validate(tree)
    return tree


METHODS = ("nsgf", "nsgfpp", "fm", "otcfm", "flow")


def validate(tree: dict) -> None:
    """Cross-key checks that a type check cannot do."""
    method = tree["experiment"]["method"]
    if method not in METHODS:
        close = difflib.get_close_matches(method, METHODS, n=1)
        raise SinkflowError(
            f"unknown method '{method}'", f"did you mean '{close[0]}'?" if close else f"choose one of {METHODS}"
        )
    for key, value in flatten(tree).items():
        last = key.split(".")[-1]
        if last in ("iters", "batch_size", "batches", "steps", "ckpt_every", "log_every") and isinstance(value, int) \
                and value < 1:
            raise SinkflowError(f"config key '{key}' must be >= 1 (got {value})", f"set {key} to a positive integer")
        if last in ("lr", "blur", "eta") and isinstance(value, float) and value <= 0:
            raise SinkflowError(f"config key '{key}' must be > 0 (got {value})", f"set {key} to a positive number")


def dump(tree: dict) -> str:
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)
