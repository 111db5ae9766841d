"""One config tree for every experiment.

Every key, its type, range or choices, default and doc are declared once in ``schema.py``. A preset is
a readable YAML file in ``presets/`` holding only what differs from those defaults; it may ``inherit``
another preset (``_base.yaml`` is generated from the schema, for reading). The resolved tree is a
nested dict with every key of the schema; a model section holds the keys of its ``kind`` only. An
override ``key.sub=value`` must name a key of the tree and match its rule, so a typo can never be
silently ignored. Shorthand flags (``--train-iters``...) expand to *every* key they concern.
"""

from __future__ import annotations

import copy
import difflib
import logging
import math
from importlib import resources
from typing import Any

import yaml

from sinkflow.config import schema
from sinkflow.config.schema import Key, parse_value  # noqa: F401  (config.parse_value is public)
from sinkflow.errors import SinkflowError

log = logging.getLogger("sinkflow")

PRESET_PACKAGE = "sinkflow.config.presets"

# Shorthand flag -> glob-like key patterns ("*" matches one level). Every matching key is set.
SHORTHANDS: dict[str, tuple[str, ...]] = {
    "train_iters": ("train.*.iters",),
    "batch_size": ("train.*.batch_size",),
    "lr": ("train.*.lr",),
    "precision": ("train.*.precision",),
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


def is_config_file(name: str) -> bool:
    """A ``.yaml`` / ``.yml`` name is a config file of the user's (``sinkflow config moons > my.yaml``), not a preset."""
    return name.lower().endswith((".yaml", ".yml"))


def lost_run_config(run_dir) -> SinkflowError:
    """The refusal of a run folder (meta.json or checkpoints/ there) whose config.yaml is gone: every command that
    reads a run says it so (``run_folder.read_config``; ``sinkflow preflight RUN`` before torch loads)."""
    return SinkflowError(f"run folder {run_dir} has lost its config.yaml", "restore it from a copy of the run folder "
                         "(meta.json's argv is the command that made it: the same command with --name NEW writes the "
                         "same config.yaml, if sinkflow's defaults have not changed)")


def load_config_file(name: str) -> dict:
    """A full tree from a config file: its keys over the preset it names (``experiment.preset``, as `sinkflow config`
    writes it; the schema's defaults if it names none), every value checked. Missing file, bad YAML or a tree that
    is not one: one line naming the file."""
    from pathlib import Path

    path = Path(name).expanduser()
    if path.is_dir():  # "does not exist" was said of a folder named like a config file
        raise SinkflowError(f"config file {name} is a folder, not a file", "name the .yaml file itself")
    if not path.is_file():
        stem = path.stem
        hint = (f"did you mean the preset '{stem}'? (sinkflow train {stem})" if stem in preset_names() else
                f"write one with `sinkflow config PRESET > {name}`")
        raise SinkflowError(f"config file {name} does not exist", hint)
    text = read_yaml_text(path, f"config file {name}", "fix it, or write a fresh one with `sinkflow config PRESET > FILE`")
    refuse_cut_short(text, path)  # a run folder's config.yaml, trained as a config file
    raw = parse_yaml(text, f"config file {name}", "fix it, or write a fresh one with `sinkflow config PRESET > FILE`")
    if raw is None:  # trained the schema's defaults under the file's name
        raise SinkflowError(f"config file {name} is empty (no keys, comments at most)",
                            f"a failed `sinkflow config PRESET > {name}` leaves it empty: write it again, e.g. "
                            f"`sinkflow config moons > {name}`")
    if not isinstance(raw, dict):
        raise SinkflowError(f"config file {name} is not a config tree", "write it as nested key: value sections "
                            "(`sinkflow config PRESET` prints one)")
    preset = raw["experiment"].get("preset") if isinstance(raw.get("experiment"), dict) else None
    base = load_preset(preset) if preset in preset_names() else None
    tree = complete(raw, base, where=f"config file {name}", lines=key_lines(text))
    if isinstance(preset, str) and preset and base is None:  # a label only where the file sets every key itself
        unset = set(schema.used(tree)) - set(flatten(raw))  # the keys this run reads that the file does not set
        if unset:  # a typo ('moon') would otherwise run the schema's defaults under the typo's name
            close = difflib.get_close_matches(preset, preset_names(), n=1)
            raise SinkflowError(f"config file {name} names experiment.preset '{preset}', which is no preset, and "
                                f"leaves {len(unset)} keys the run reads unset (e.g. {sorted(unset)[0]})",
                                f"did you mean '{close[0]}'?" if close else
                                f"name one of: {', '.join(preset_names())} (or write the whole tree: `sinkflow config "
                                f"PRESET > {name}`)")
    if not isinstance(preset, str) or not preset:
        unset = set(schema.used(tree)) - set(flatten(raw))
        if path.stem in preset_names() and unset:  # `moons.yaml` read as moons, trained the schema's defaults
            raise SinkflowError(f"config file {name} names no experiment.preset, so its keys go over the schema's "
                                f"defaults, not preset '{path.stem}''s, though the run would be labelled "
                                f"'{path.stem}'", f"add `experiment: {{preset: {path.stem}}}` to start from it, or "
                                "name the file otherwise")
        tree["experiment"]["preset"] = path.stem
    run_file = text.startswith(RUN_CONFIG_HEADER)
    if run_file:
        _warn_run_changes(name, path)
    _warn_unread(name, raw, tree, base, run_file)
    return tree


def _warn_run_changes(name: str, path) -> None:
    """A run's config.yaml holds the values the run ended with: a run of the file trains a key changed mid-run (a
    resume's ``train.velocity.lr=0.02`` at step 377) from step 0, which meta.json's ``changes`` records and the file
    cannot. Said once, naming them."""
    import json

    try:
        changes = json.loads((path.parent / "meta.json").read_text()).get("changes") or []
    except (OSError, ValueError, AttributeError):
        return
    keys = [f"{c['key']}={c['to']} (from {c.get('phase')} step {c.get('step')})" for c in changes
            if isinstance(c, dict) and c.get("key") and c.get("key") != "world_size"]
    if keys and (name, tuple(keys)) not in _WARNED:
        _WARNED.add((name, tuple(keys)))
        log.warning("config file %s is a run's config: it holds the values the run ended with, and a run of it trains "
                    "them from step 0 (%s; meta.json's changes)", name, ", ".join(keys[:3]) + (", ..." if len(keys) > 3
                                                                                            else ""))


_WARNED: set = set()  # (file, keys) already warned about in this process: a command resolves a file more than once


def _warn_unread(name: str, raw: dict, tree: dict, base: dict | None, run_file: bool = False) -> None:
    """Keys the file sets, away from its preset's value, that this run does not read: said once, where the same key
    on the command line is an error (a file from `sinkflow config --all` lists every key, so not refused here). In a
    run's own config.yaml (``run_file``) the keys the run wrote itself are left out: a shorthand's keys of phases the
    method has not (`--train-iters` sets train.nsf.iters on an nsgf run) and data.root, kept resolved; a hand edit of
    another unread key (sample.t_shift in an fm run's file) is still named."""
    before = flatten(base if base is not None else schema.defaults(tree))
    now, used, known = flatten(tree), schema.used(tree), schema.keys(tree)
    written = {k for patterns in SHORTHANDS.values() for p in patterns for k in expand_key(tree, p)} | {"data.root"} \
        if run_file else set()
    unread = [k for k in flatten(raw) if k in known and k not in used and k not in written
              and now.get(k) != before.get(k)]
    if unread and (name, tuple(unread)) not in _WARNED:
        _WARNED.add((name, tuple(unread)))
        log.warning("config file %s sets %d key(s) this %s run does not read (%s): unused", name, len(unread),
                    tree["experiment"]["method"], ", ".join(unread[:4]) + (", ..." if len(unread) > 4 else ""))


def read_yaml_text(path, what: str, fix: str) -> str:
    """The text of the YAML file ``path``: UTF-8, or UTF-16 with its byte-order mark (what Windows PowerShell 5's
    `sinkflow config moons > my.yaml` writes, which YAML allows; it was refused, and the fix named rewrote it so);
    other bytes are refused as ``parse_yaml`` refuses."""
    raw = path.read_bytes()
    try:
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            return raw.decode("utf-16")
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise SinkflowError(f"{what} is not valid YAML (neither UTF-8 nor UTF-16 text)", fix) from None


class _ConfigLoader(schema.TextNumbers):
    """PyYAML's safe loader without YAML 1.1's numbers and dates, and refusing a key twice in one mapping.

    YAML 1.1 read a hand-edited ``iters: 010`` as octal 8, ``1:30`` as the base-60 90, ``name: 0123`` as '83' and
    refused ``lr: 1e-3`` (a string to it) that the command line takes; a second ``train:`` section replaced the
    first in silence. Plain scalars that were numbers or dates stay text here, and ``complete`` reads each as the
    command line reads a value (``parse_value``) where its key holds a number: the same text, the same value."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by SafeLoader, later keys win
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key '{key}' is given twice (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}): the second would replace the first", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, what: str, fix: str) -> Any:
    """``text`` read by ``_ConfigLoader``, refused in one line that names ``what``, the line YAML stopped at and
    why: every YAML file a user may edit (a config file, a run's config.yaml, lr-find's target) reads and reports
    its errors the same way (the shipped presets are read by ``yaml.safe_load``: their numbers are decimal)."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader: no Python objects are built)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        why = getattr(exc, "problem", None)
        raise SinkflowError(f"{what} is not valid YAML{at}{': ' + why if why else ''}", fix) from None


def key_lines(text: str) -> dict[str, int]:
    """The line of each dotted key in YAML ``text`` (``{'train.velocity.lr': 5}``), for errors about a value the
    file gave: 'line 5' finds it in a file of a hundred keys. Keys YAML cannot place (merged, unreadable): none."""
    try:
        root = yaml.compose(text, Loader=_ConfigLoader)  # noqa: S506 (nodes only: nothing is constructed)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    lines[prefix + key.value] = key.start_mark.line + 1
                    walk(value, f"{prefix}{key.value}.")

    walk(root, "")
    return lines


def _own_data_hint(name: str) -> str | None:
    """`sinkflow train pts.npy` / `sinkflow train imgs/`: the user's own data named where a preset goes. The hint
    is the command that trains on it (its data is a key of a preset's recipe, not a preset)."""
    from pathlib import Path

    if not name.strip():  # `sinkflow train "$PRESET"` of an unset variable: "" is the working folder to Path
        return None
    if name.lower().endswith(schema.POINT_FILE_SUFFIXES):
        return (f"to train on your own points, name them as a preset's data.target: `sinkflow train moons "
                f"data.target={name}` (the 2D recipe on your file; docs/data.md)")
    if (Path(name).expanduser() / "config.yaml").is_file():  # `bench runs/X`: not a folder of images
        return (f"{name} is a run folder: its config.yaml is a config file (`... {Path(name) / 'config.yaml'}`), "
                f"and `sinkflow train --resume {name}` continues the run")
    if Path(name).expanduser().is_dir():
        return f"a folder of your own images: `sinkflow train folder data.path={name}` (docs/data.md)"
    return None


def _read_preset(name: str) -> dict:
    own = _own_data_hint(name)
    if own is not None:
        raise SinkflowError(f"unknown preset '{name}'", own)
    if "/" in name or "\\" in name or name.startswith("."):  # a path joined onto the preset folder loaded other files
        raise SinkflowError(f"unknown preset '{name}'", "a config file of your own ends in .yaml: `sinkflow config "
                            "PRESET > my.yaml`, edit it, then `sinkflow train my.yaml`")
    path = resources.files(PRESET_PACKAGE) / f"{name}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(name, preset_names(), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"choose one of: {', '.join(preset_names())}"
        raise SinkflowError(f"unknown preset '{name}'", hint)
    return yaml.safe_load(path.read_text()) or {}


def _merge(base: dict, over: dict) -> dict:
    """``over``'s values on top of ``base``'s tree (a new tree)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _raw_preset(name: str) -> dict:
    """A preset's own keys over its ``inherit`` chain's, without the schema's defaults.

    A section that names another model ``kind`` than its parent's replaces it: the parent's keys belong to
    the parent's kind."""
    raw = _read_preset(name)
    parent = raw.pop("inherit", None)
    if parent in (None, "_base"):
        return raw
    tree = _raw_preset(parent)
    for phase, sec in (raw.get("model") or {}).items():
        old = (tree.get("model") or {}).get(phase)
        if isinstance(sec, dict) and isinstance(old, dict) and sec.get("kind", old.get("kind")) != old.get("kind"):
            del tree["model"][phase]
    return _merge(tree, raw)


def load_preset(name: str) -> dict:
    """Resolve a preset through its ``inherit`` chain into a full tree (``_base``: the schema's defaults)."""
    if name == "_base":
        return schema.defaults()
    return complete(_raw_preset(name), where=f"preset '{name}'")


def _empty_sections(tree: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the empty mappings in ``tree`` (``flatten`` has no leaf for them)."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _empty_sections(value, f"{prefix}{key}.") if value else [f"{prefix}{key}"]
    return out


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


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _example(spec: Key) -> Any:
    """A valid value for a hint: the default, else the smallest value the rule allows."""
    if spec.default is not None:
        return spec.default
    rule = spec.rule
    if isinstance(rule, schema.Options):
        return rule.choices[0]
    if isinstance(rule, (schema.Int, schema.Float)):
        return rule.lo if rule.lo is not None and not getattr(rule, "lo_open", False) else 1
    return {"bool": "true", "list": "[1]"}.get(rule.type_name, "...")


def _yaml(value: Any) -> str:
    """How a value is written on the command line."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def check_value(name: str, spec: Key, value: Any) -> Any:
    """``value`` converted to ``spec``'s type and checked against its range or choices; else a one-line error."""
    if value is None:
        if spec.nullable:
            return None
        raise SinkflowError(f"config key '{name}' cannot be null", f"set it, e.g. {name}={_yaml(_example(spec))}")
    try:
        out = spec.rule.coerce(value)
    except TypeError:
        non_finite = isinstance(value, str) and value.strip().lstrip("+-.").lower() in ("nan", "inf", "infinity")
        if schema.is_number(value) and not math.isfinite(value) or non_finite:  # "got float nan" said nothing
            raise SinkflowError(f"config key '{name}' must be a finite number (got {value!r})",
                                f"e.g. {name}={_yaml(_example(spec))}") from None
        if isinstance(spec.rule, schema.ListOf) and isinstance(value, list):  # name the element that is not one
            for item in value:
                try:
                    spec.rule.item.coerce(item)
                except TypeError:
                    raise SinkflowError(f"config key '{name}' expects a {spec.rule.describe()}, but its element "
                                        f"{item!r} is {'an' if _type_name(item)[0] in 'aeiou' else 'a'} "
                                        f"{_type_name(item)}", f"e.g. {name}={_yaml(_example(spec))}") from None
        expected = spec.rule.type_name + (" or null" if spec.nullable else "")
        if isinstance(spec.rule, schema.Options):  # `prefetch=on` parses as YAML's true: name the choices
            raise SinkflowError(f"config key '{name}' must be one of {', '.join(map(str, spec.rule.choices))} (got "
                                f"{_type_name(value)} {value!r}{', YAML for on/off/yes/no' if isinstance(value, bool) else ''})",
                                f"e.g. {name}={_yaml(_example(spec))}") from None
        raise SinkflowError(
            f"config key '{name}' expects {expected} (default {spec.default!r}) but got {_type_name(value)} {value!r}",
            f"pass {'an' if spec.rule.type_name[0] in 'aeiou' else 'a'} {spec.rule.type_name}, e.g. {name}={_yaml(_example(spec))}") from None
    bad = spec.rule.violation(out)
    if bad:
        close = spec.rule.closest(out) if isinstance(spec.rule, schema.Options) else None
        hint = f"did you mean '{close}'?" if close else f"e.g. {name}={_yaml(_example(spec))}"
        raise SinkflowError(f"config key '{name}' {bad} (got {out!r})", hint)
    return out


def coerce(key: str, old: Any, new: Any) -> Any:
    """``new`` as the value key ``key`` would hold (``old`` is its current value, kept for callers)."""
    spec = schema.all_keys().get(key)
    return new if spec is None else check_value(key, spec, new)


def unknown_key(tree: dict, key: str, where: str = "") -> SinkflowError:
    """The one-line error for a key the tree has not: a key of another model kind says so, else the closest key."""
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "model" and parts[1] in schema.MODEL:
        owners = schema.kinds_with(parts[1], parts[2])
        kind = tree["model"][parts[1]]["kind"]
        if owners:
            return SinkflowError(f"{where}config key '{key}' is a {' / '.join(owners)} key but model.{parts[1]}.kind "
                                 f"is {kind}", f"set model.{parts[1]}.kind={owners[0]} first, or drop the key")
    specs = list(schema.keys(tree))
    inside = [k for k in specs if k.startswith(key + ".")]
    if inside:  # `pool=3`: a section given a value was "unknown", with a did-you-mean of one of its keys
        return SinkflowError(f"{where}config key '{key}' is a section, not a key",
                             f"set one of its keys, e.g. {inside[0]}=...; `sinkflow config PRESET` lists them")
    close = closest_key(key, specs)
    hint = f"did you mean '{close}'?" if close else "run `sinkflow config PRESET` to list the keys"
    return SinkflowError(f"{where}unknown config key '{key}'", hint)


# Keys users look for in another section (where the paper or older sinkflow put them): leaf name -> the key.
MOVED = {"eta": "pool.eta", "eta_growth": "pool.eta_growth", "blur": "sinkhorn.blur", "scaling": "sinkhorn.scaling",
         "steps": "pool.steps", "seed": "experiment.seed", "device": "experiment.device",
         "inherit": "experiment.preset", "preset": "experiment.preset", "base": "experiment.preset"}


def closest_key(key: str, leaves: list[str]) -> str | None:
    """The key a typo most likely meant, in this order: a key of the same section whose name begins with the one
    typed (``model.flow.hidden`` -> ``hidden_channels``); a close key of the same section (``pool.etaa`` ->
    ``pool.eta``); a key whose last part is the same or nearly (``nsgf.eta`` -> ``pool.eta``,
    ``nsgf.blurr`` -> ``sinkhorn.blur``; the same section first, then the known moved keys of ``MOVED``);
    then any close key."""
    parts = key.split(".")
    depth = 2 if parts[0] in ("model", "train") and len(parts) > 2 else 1
    section = ".".join(parts[:depth]) + "."
    same = [k for k in leaves if k.startswith(section)]
    prefixed = [k for k in same if len(parts[-1]) >= 3 and k.split(".")[-1].startswith(parts[-1])]
    if prefixed:  # a shortened name: model.flow.hidden -> model.flow.hidden_channels (difflib offered `kind`)
        return min(prefixed, key=len)
    close = difflib.get_close_matches(key, same, n=1, cutoff=0.8)
    if close:
        return close[0]
    if MOVED.get(parts[-1]) in leaves and MOVED[parts[-1]].split(".")[-1] != parts[-1]:  # a word of other tools
        return MOVED[parts[-1]]  # (`inherit: moons` -> experiment.preset; difflib offered sinkhorn.tol)
    names = sorted({k.split(".")[-1] for k in leaves})
    for name in [parts[-1], *difflib.get_close_matches(parts[-1], names, n=3, cutoff=0.75)]:
        owners = [k for k in leaves if k.split(".")[-1] == name]
        if not owners:
            continue
        for pick in ([k for k in owners if k.startswith(section)], [MOVED[name]] if MOVED.get(name) in owners else [],
                     owners):
            if pick:
                return pick[0]
    close = difflib.get_close_matches(key, same, n=1, cutoff=0.6) or difflib.get_close_matches(key, leaves, n=1, cutoff=0.5)
    return close[0] if close else None


def _reset_model(tree: dict, phase: str, kind: str) -> None:
    tree["model"][phase] = {"kind": kind, **schema.model_defaults(kind)}


def set_key(tree: dict, key: str, value: Any) -> None:
    """Set an existing leaf, checked against the schema; unknown keys name the closest valid key.

    Setting ``model.<phase>.kind`` to another kind starts that section from the new kind's defaults."""
    specs = schema.keys(tree)
    if key not in specs:
        raise unknown_key(tree, key)
    value = check_value(key, specs[key], value)
    parts = key.split(".")
    if parts[0] == "model" and parts[2] == "kind":
        if value != tree["model"][parts[1]]["kind"]:
            _reset_model(tree, parts[1], value)
        return
    _set(tree, key, value)


def complete(raw: dict, base: dict | None = None, *, where: str = "", lenient: bool = False,
             lines: dict[str, int] | None = None) -> dict:
    """A full tree from a partial one (a preset, a run folder's config.yaml): ``raw``'s values over ``base``
    (default: the schema's defaults), every value checked.

    ``lines`` (``key_lines`` of the file's text): an error about a key names its line, and its example is written
    as the file writes it (``lr: 0.001``), not as the command line does (``train.velocity.lr=0.001``).

    ``lenient`` drops model keys of another kind than the section's: run folders written before the schema
    held every kind's keys in every model section (the model builder ignored the others)."""
    if not isinstance(raw, dict):
        raise SinkflowError(f"{where or 'config'} is not a config tree", "write it as nested key: value sections")
    tree = copy.deepcopy(base) if base is not None else schema.defaults()
    for phase, sec in (raw.get("model") or {}).items():
        if phase in schema.MODEL and isinstance(sec, dict) and "kind" in sec:
            set_key(tree, f"model.{phase}.kind", sec["kind"])
    specs = schema.keys(tree)
    for key in _empty_sections(raw):  # `poool: {}` has no leaves to flag: a misspelt section passed in silence
        if not any(k.startswith(key + ".") for k in specs):
            line = (lines or {}).get(key)
            prefix = f"{where}{f', line {line}' if line else ''}: " if where else ""
            depth = key.count(".") + 1
            sections = sorted({".".join(k.split(".")[:depth]) for k in specs if k.count(".") >= depth})
            close = difflib.get_close_matches(key, sections, n=1)
            raise SinkflowError(f"{prefix}unknown config section '{key}'", f"did you mean '{close[0]}'?" if close
                                else "run `sinkflow config PRESET` to list the sections")
    for key, value in flatten(raw).items():
        line = (lines or {}).get(key)
        prefix = f"{where}{f', line {line}' if line else ''}: " if where else ""
        if key not in specs and any(k.startswith(key + ".") for k in specs):  # `pool:` with nothing indented below
            what = "empty" if value is None else "a list" if isinstance(value, list) else f"the value {value!r}"
            example = next(k for k in specs if k.startswith(key + ".")).split(".")
            raise SinkflowError(f"{prefix}section '{key}' is {what}, not keys (misindented, or a missing colon?)",
                                f"indent its keys below it (`{example[-1]}: ...` on the next line, indented), or "
                                f"give {'.'.join(example)}=... on the command line")
        if key not in specs:
            parts = key.split(".")
            if lenient and len(parts) == 3 and parts[0] == "model" and any(
                    parts[2] in schema.MODEL_KINDS[k] for k in schema.MODEL_KINDS):
                continue
            raise unknown_key(tree, key, prefix)
        try:
            _set(tree, key, check_value(key, specs[key], _as_typed(specs[key].rule, value)))
        except SinkflowError as exc:
            fix = exc.fix.replace(f"{key}=", f"{key.rsplit('.', 1)[-1]}: ") if line and exc.fix else exc.fix
            raise SinkflowError(prefix + exc.problem, fix) from None
    return tree


def _as_typed(rule, value: Any) -> Any:
    """A file's text where its key holds numbers read as the command line reads it (``_ConfigLoader`` leaves YAML
    1.1's numbers as text): ``010`` is 10, ``1e-3`` a float; list items alike. Text keys keep their text."""
    if isinstance(value, list) and isinstance(rule, schema.ListOf):
        return [_as_typed(rule.item, v) for v in value]
    if isinstance(value, str) and rule.type_name in ("int", "float", "number", "list"):
        return schema.parse_value(value.strip()) if rule.type_name == "list" else schema.as_decimal(value)
    return value


def expand_key(tree: dict, pattern: str) -> list[str]:
    """Keys of ``tree`` matching a pattern whose ``*`` matches exactly one level."""
    parts = pattern.split(".")
    return [
        key
        for key in flatten(tree)
        if len(key.split(".")) == len(parts)
        and all(p == "*" or p == k for p, k in zip(parts, key.split(".")))
    ]


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` strings in order; returns a new tree."""
    tree = copy.deepcopy(tree)
    for item in overrides:
        if "=" not in item:
            raise SinkflowError(f"override '{item}' is not of the form key.sub=value", "write e.g. train.velocity.lr=1e-3")
        key, _, text = item.partition("=")
        key, text = key.strip(), text.strip()
        spec = schema.keys(tree).get(key)
        set_key(tree, key, _string(text, spec.nullable) if spec is not None and isinstance(spec.rule, schema.Str)
                else parse_value(text))
    return tree


def _string(text: str, nullable: bool) -> str | None:
    """A string key's override as typed (one pair of surrounding quotes removed): YAML read ``0123`` as octal 83,
    ``12:30`` as 750 and ``yes`` as true, and a quoted ``'0123'`` still became ``123.0`` (runs/83 was created)."""
    if nullable and text in ("null", "~", ""):
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def apply_shorthands(tree: dict, values: dict[str, Any]) -> dict:
    """Expand shorthand values (``{"train_iters": 5}``) onto every key they concern."""
    tree = copy.deepcopy(tree)
    for name, value in values.items():
        if value is None:
            continue
        specs = schema.keys(tree)
        for pattern in SHORTHANDS[name]:
            for key in expand_key(tree, pattern):
                spec = specs.get(key)  # `--name null` is `experiment.name=null`, not a folder "null"
                null = isinstance(value, str) and value.strip() in ("null", "~") and spec is not None and spec.nullable
                if spec is not None:  # the flag typed is named: `--lr 0` said "config key 'train.velocity.lr' ..."
                    try:
                        check_value(key, spec, None if null else value)
                    except SinkflowError as exc:
                        flag, usual = f"--{name.replace('_', '-')}", spec.default if spec.default is not None else \
                            _example(spec)
                        raise SinkflowError(f"{flag} {value}: {exc.problem}", f"e.g. {flag} {_yaml(usual)} "
                                            f"({key}'s default)") from None
                set_key(tree, key, None if null else value)
    return tree


def resolve(preset: str, overrides: list[str] | None = None, shorthands: dict[str, Any] | None = None,
            unread: str = "error") -> dict:
    """Preset -> shorthands -> explicit overrides (explicit keys win), validated; an explicit override of a
    key the resolved run does not read is an error (``check_read``), unless ``unread="ignore"`` (a script that
    applies one list of overrides to several methods: the unread ones stay in the tree, unused)."""
    if unread not in ("error", "ignore"):
        raise ValueError(f"unread={unread!r}: use 'error' or 'ignore'")
    for item in overrides or []:  # a relabel: the keys stayed the first preset's, the folder took the new name
        key, _, value = item.partition("=")
        if key.strip() == "experiment.preset":
            raise SinkflowError(f"{item.strip()} would only relabel the run: its keys are still {preset}'s",
                                f"name the preset instead: `sinkflow train {value.strip() or 'PRESET'}`")
    if is_config_file(preset):
        tree = load_config_file(preset)
    else:
        if preset.startswith("_"):  # `train _nsgf2d` trained a building block (`_base`: the schema's defaults)
            raise SinkflowError(f"'{preset}' is a building block of presets, not a preset (`sinkflow presets` lists "
                                f"them)", f"choose one of: {', '.join(preset_names())}")
        tree = load_preset(preset)
        tree["experiment"]["preset"] = preset
    tree = apply_shorthands(tree, shorthands or {})
    tree = apply_overrides(tree, overrides or [])
    validate(tree)
    if unread == "error":  # a one-key shorthand (--pool-batches) of a method that has no pool: as its key would be
        one_key = [SHORTHANDS[n][0] for n, v in (shorthands or {}).items()
                   if v is not None and len(SHORTHANDS[n]) == 1 and "*" not in SHORTHANDS[n][0]]
        check_read(tree, override_keys(overrides or []) + [k for k in one_key if k not in override_keys(overrides or [])])
    return tree


def override_keys(overrides: list[str]) -> list[str]:
    """The keys ``key.sub=value`` overrides name."""
    return [item.partition("=")[0].strip() for item in overrides if "=" in item]


def check_read(tree: dict, names: list[str], where: str = "") -> None:
    """Refuse a key the user set that the run of ``tree`` does not read (``sinkflow train moons
    train.nsf.ema=0.5``: NSGF has no nsf phase): one line naming the method and when the key is read.

    Only keys the user names count: shorthands set every phase's key on purpose, and a preset may set keys for
    another method than the one run (``unread_preset_keys``: a warning, not an error)."""
    used = schema.used(tree)
    specs = schema.keys(tree)
    for name in names:
        if name in used or name not in specs:
            continue
        method = tree["experiment"]["method"]
        when = specs[name].when.text if specs[name].when is not None else "never"
        # a method that would read it on this very tree (sinkhorn.backend under sinkhorn.solver=converged is read by
        # no method: another --method is no fix there)
        other = [m for m in schema.METHOD_REGISTRY if m != method
                 and name in schema.used({**tree, "experiment": {**tree["experiment"], "method": m}})]
        if other:
            raise SinkflowError(f"{where}config key '{name}' is not read by method {method} (read when: {when})",
                                f"drop it, or train a method that reads it (--method {other[0]})")
        raise SinkflowError(f"{where}config key '{name}' is not read by this run of method {method} (read when: "
                            f"{when})", "drop it: it matters only then")


def read_overrides(preset: str, method: str, overrides: list[str]) -> list[str]:
    """The ``key=value`` overrides a run of ``method`` on ``preset`` reads (a script that applies one list to
    several methods, e.g. a benchmark's pool keys to OT-CFM too, passes each method only its own)."""
    tree = resolve(preset, [f"experiment.method={method}", *overrides], unread="ignore")
    used = schema.used(tree)
    return [item for item in overrides if item.partition("=")[0].strip() in used]


def unread_preset_keys(tree: dict) -> list[str]:
    """Keys the run's preset (with its ``inherit`` chain) sets that the resolved run does not read: a preset may
    hold keys for several methods (``digits``: NSGF++'s nsf and time phases), so ``--method fm`` on it is
    allowed; ``sinkflow train`` names them in a warning."""
    preset = tree["experiment"].get("preset")
    if not preset or preset == "_base":
        return []
    try:
        raw = flatten(_raw_preset(preset))
    except SinkflowError:
        return []
    used = schema.used(tree)
    return [k for k in raw if k in schema.keys(tree) and k not in used]


def read_by_other_methods(tree: dict, keys: list[str]) -> bool:
    """Whether every key in ``keys`` is read by some other registered method on the same tree: a preset's keys for
    its ``--method`` alternatives (``mnist``'s ``sample.steps`` for FM / OT-CFM), not a slip in the preset."""
    others = [m for m in schema.METHOD_REGISTRY if m != tree["experiment"]["method"]]
    read = set()
    for m in others:
        read |= set(schema.used({**tree, "experiment": {**tree["experiment"], "method": m}}))
    return all(k in read for k in keys)


def read_run_config(cfg: Any, path, lines: dict[str, int] | None = None) -> dict:
    """A run folder's config.yaml as a full tree: keys added to sinkflow since the run was made take the
    schema's default (a key is added with the default that keeps the behaviour before it, so a resumed run goes on
    as it started, whatever its preset says today), or where the default changed that, the value in
    ``schema.BEFORE_ADDED``; keys of another model kind (older run folders held them all) are dropped."""
    if not isinstance(cfg, dict):
        raise SinkflowError(f"{path} does not hold a config tree", "restore it from a copy of the run folder")
    method = cfg.get("experiment", {}).get("method") if isinstance(cfg.get("experiment"), dict) else None
    if isinstance(method, str) and method not in schema.METHOD_REGISTRY:  # a method added at run time (a plugin,
        # schema.register_method) and not in this process: "must be one of ...; edit that file (e.g. method: nsgf)"
        # told the user to rewrite the run as another method's
        raise SinkflowError(f"{path}: the run was trained by method '{method}', which is not registered here "
                            f"(registered: {', '.join(schema.METHOD_REGISTRY)})",
                            "register it first, as when the run trained (schema.register_method, or its "
                            "METHOD_REGISTRY entry)")
    written = flatten(cfg)
    try:
        tree = complete(cfg, None, where=str(path), lenient=True, lines=lines)
        for pattern, before in schema.BEFORE_ADDED.items():
            for key in expand_key(tree, pattern) if "*" in pattern else [pattern]:
                if key not in written:
                    set_key(tree, key, before)
    except SinkflowError as exc:
        problem = exc.problem.replace(": unknown config key", " has unknown key", 1)
        # the file is read before any override: `--resume RUN key=value` cannot mend it, an edit of the file does
        fix = f"edit that file ({exc.fix})" if exc.fix else "fix it or start a new run"
        raise SinkflowError(problem, fix) from None
    return tree


def __getattr__(name: str):
    if name == "METHODS":  # the registry may grow at run time (schema.register_method)
        return schema.METHODS
    raise AttributeError(f"module 'sinkflow.config' has no attribute {name!r}")


def validate(tree: dict) -> None:
    """Every key of the schema is there, no other, and every value follows its key's rule."""
    specs = schema.keys(tree)
    leaves = flatten(tree)
    for key in leaves:
        if key not in specs:
            raise unknown_key(tree, key)
    for key, spec in specs.items():
        if key not in leaves:
            raise SinkflowError(f"config key '{key}' is missing", f"set it, e.g. {key}={_yaml(_example(spec))}")
        check_value(key, spec, leaves[key])
    method, target = tree["experiment"]["method"], tree["data"]["target"]
    if schema.METHOD_REGISTRY[method].images_only and target in schema.POINT_TARGETS_2D:
        raise SinkflowError(f"experiment.method={method} models images (C, H, W) but data.target={target} gives 2-D "
                            "points", f"use an image target ({', '.join(schema.IMAGE_TARGETS)}) or another method")
    for phase, train in tree.get("train", {}).items():  # one rule across two keys of a phase
        batch, accum = train.get("batch_size"), train.get("accum", 1)
        if isinstance(batch, int) and isinstance(accum, int) and batch % accum:
            raise SinkflowError(f"train.{phase}.accum={accum} does not divide train.{phase}.batch_size={batch}: the "
                                "micro-batches would differ in size (their means weighted alike) or be fewer than asked",
                                f"set train.{phase}.accum to a divisor of {batch} (e.g. "
                                f"{max(d for d in range(1, min(accum, batch) + 1) if batch % d == 0)})")


def dump(tree: dict) -> str:
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)


# A run folder's config.yaml opens with this line and ends with YAML's document end, "...": a copy cut short (an
# interrupted rsync, a full disk on another machine) lacks the end and is refused; read without it, the keys it lost
# would take their defaults in silence, as keys added to sinkflow since a run was made do (read_run_config). A file
# without the header (a run made before it was written, a file rewritten by hand) is read as it is.
RUN_CONFIG_HEADER = "# sinkflow run config; it ends with the line '...' (a copy without it was cut short)"


def dump_run_config(tree: dict) -> str:
    """``dump`` between ``RUN_CONFIG_HEADER`` and the document end ``refuse_cut_short`` looks for."""
    return f"{RUN_CONFIG_HEADER}\n{dump(tree)}...\n"


def read_run_file(path) -> dict:
    """A run folder's config.yaml (``path``) read as every command reads it: its text, refused when cut short, parsed,
    and completed by ``read_run_config`` (a bad value or an unknown key named with its line). No torch: `sinkflow
    status` reads it so too."""
    fix = "fix it there by hand, or restore it from a copy of the run folder"
    text = read_yaml_text(path, str(path), fix)
    refuse_cut_short(text, path)
    return read_run_config(parse_yaml(text, str(path), fix), path, key_lines(text))


def refuse_cut_short(text: str, path) -> None:
    """One line when ``text`` (a file at ``path``) opens with ``RUN_CONFIG_HEADER`` but lacks its end line."""
    if text.startswith(RUN_CONFIG_HEADER) and text.rstrip().rsplit("\n", 1)[-1].strip() != "...":
        lines = text.splitlines()
        end = next((i for i, line in enumerate(lines) if line.strip() == "..."), None)
        if end is not None:  # keys added below the end line (a hand edit): whole, but YAML reads nothing after it
            raise SinkflowError(f"{path} has text after its end line '...' (line {end + 2}): YAML reads nothing "
                                "past that line", "move the added lines above the '...' line")
        raise SinkflowError(f"{path} is cut short (it lacks its last line, '...'): the keys it lost would be read at "
                            "their defaults", "copy the run folder again from where it was made, or restore its "
                            "config.yaml from a backup")
