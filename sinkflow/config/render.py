"""Text made from the schema: commented YAML (``sinkflow config``, ``presets/_base.yaml``) and docs/config.md.

Both files are generated, never edited by hand, so they cannot disagree with the code; tests regenerate
them and compare (``sinkflow config --base`` / ``--doc`` rewrite them).
"""

from __future__ import annotations

from typing import Any

import yaml

from sinkflow.config import SHORTHANDS, flatten, schema
from sinkflow.config.schema import Key

COMMENT_COLUMN = 30


def scalar(value: Any) -> str:
    """A value as YAML writes it inline: ``0.001``, ``null``, ``''``, ``[1, 2, 2]``."""
    return yaml.safe_dump([value], default_flow_style=True, width=10**6).strip()[1:-1]


def _section_doc(path: tuple[str, ...]) -> str:
    if len(path) == 1:
        return schema.SECTIONS[path[0]][0]
    if len(path) == 2 and path[0] == "model":
        return schema.MODEL[path[1]].doc
    if len(path) == 2 and path[0] == "train":
        return schema.TRAIN_DOCS[path[1]]
    return ""


def _line(indent: int, text: str, doc: str) -> str:
    line = "  " * indent + text
    return f"{line.ljust(COMMENT_COLUMN - 1)} # {doc}" if doc else line


def to_yaml(tree: dict, specs: dict[str, Key], comments: bool = True) -> str:
    """``tree``'s keys listed in ``specs`` (in the schema's order) as YAML, each with its doc as a comment."""
    flat = flatten(tree)
    out: list[str] = []
    opened: tuple[str, ...] = ()
    for name, key in specs.items():
        *parents, leaf = name.split(".")
        common = 0
        while common < min(len(opened), len(parents)) and opened[common] == parents[common]:
            common += 1
        for depth in range(common, len(parents)):
            if depth == 0 and out:
                out.append("")
            path = tuple(parents[:depth + 1])
            out.append(_line(depth, f"{parents[depth]}:", _section_doc(path) if comments else ""))
        opened = tuple(parents)
        out.append(_line(len(parents), f"{leaf}: {scalar(flat[name])}", key.doc if comments else ""))
    return "\n".join(out) + "\n"


BASE_HEADER = """\
# Every key with its default, generated from sinkflow/config/schema.py by `sinkflow config --base`: do not
# edit (tests/test_config.py checks it is current). Presets inherit these defaults and change only what they
# need. A model section holds the keys of its kind (shown: the default kinds); every kind's keys, types and
# ranges: docs/config.md.
"""


def base_yaml() -> str:
    return BASE_HEADER + to_yaml(schema.defaults(), schema.keys())


# ---- docs/config.md ---------------------------------------------------------------------------------------

def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _type(key: Key) -> str:
    return key.rule.describe() + (", or null" if key.nullable else "")


def _default(value: Any) -> str:
    return f"`{scalar(value)}`"


def _table(keys: dict[str, Key], used: bool = True, section_when=None) -> list[str]:
    rows = ["| key | type | default | " + ("read when | " if used else "") + "meaning |",
            "|---|---|---|" + ("---|" if used else "") + "---|"]
    for k, key in keys.items():
        when = key.when or section_when
        when = (f"{_md(when.text) if when else 'always'} | ") if used else ""
        rows.append(f"| `{k}` | {_md(_type(key))} | {_md(_default(key.default))} | {when}{_md(key.doc)} |")
    return rows


DOC_INTRO = """\
# Config keys

Generated from `sinkflow/config/schema.py` by `sinkflow config --doc > docs/config.md`: do not edit
(tests/test_config.py checks it is current). The schema declares every key once: its type, range or
choices, default and meaning. Defaults, validation, `presets/_base.yaml` and this page all come from it.

- A preset (`sinkflow/config/presets/*.yaml`) holds only what differs from these defaults.
- `sinkflow config PRESET [key.sub=value ...] [--train-iters N ...]` prints the resolved keys that the
  preset's method, model kinds and data read; `--all` prints every key of the tree.
- A config file of your own: `sinkflow config moons > my.yaml`, edit it, then `sinkflow train my.yaml` (every
  command that takes a preset takes a `.yaml` / `.yml` file). Its keys go over the preset it names in
  `experiment.preset` (the schema's defaults if none), each checked as an override is; overrides and shorthands
  still apply on top. A name that is no preset is the run's label only where the file sets every key the run
  reads (`sinkflow config` writes them all); otherwise it is refused, naming the closest preset.
- Values read the same in a file and on the command line: numbers are decimal as typed (`010` is 10, `1e-3` and
  `5e-05` are floats; YAML 1.1 read `010` as octal 8, `1:30` as 90, `0123` as 83 and `1e-3` as text), text keys
  keep their text (`name: 0123`, `12:30`, `2024-01-05`), `yes`/`no`/`true`/`false` are booleans, `~` and `null`
  are null (not your home folder: `data.target=~/pts.npy` is a path, `~` alone is null). A key given twice in one
  section of a file is refused, naming both lines (YAML keeps the last in silence). Relative paths in a file are
  relative to the folder you run sinkflow from, as on the command line, not to the file's folder.
- A key that does not exist is an error that names the closest key; a value that breaks its rule is an
  error that names the rule. Both are one line; in a file (yours, or a run's config.yaml) it names the line, and
  its example is written as the file writes it (`lr: 0.001`).
- `null` is accepted only where a key says "or null".
- A model section `model.<phase>` has a `kind`, and its other keys are that kind's. Setting
  `model.<phase>.kind` starts the section from the new kind's defaults, so set the kind first:
  `model.velocity.kind=unet model.velocity.channels=64`.
- "read when" says which runs read a key (`sinkflow config` hides the others). Each method declares its
  phases, its own keys and the shared keys it reads in `sinkflow.config.schema.METHOD_REGISTRY`.
- Overriding a key the run does not read (`sinkflow train moons train.nsf.ema=0.5`: NSGF has no `nsf` phase) is
  an error naming the method; a preset may set keys for other methods (listed in one line at the start of a run: a note when another
  method reads them, else a warning).
"""


def _shorthand_table() -> list[str]:
    rows = ["| flag | sets |", "|---|---|"]
    for name, patterns in SHORTHANDS.items():
        rows.append(f"| `--{name.replace('_', '-')}` | {', '.join(f'`{p}`' for p in patterns)} |")
    return rows


def doc_markdown() -> str:
    out = [DOC_INTRO, "## Methods", "", "`experiment.method` (`--method`): each method's `MethodSpec` in "
           "`schema.METHOD_REGISTRY`, a method added there listed with the rest.", "",
           "| method | phases | what |", "|---|---|---|",
           *(f"| `{m}` | {', '.join(f'`{p}`' for p in spec.phases)} | {_md(spec.doc)} |"
             for m, spec in schema.METHOD_REGISTRY.items()), "",
           "## Shorthand flags", "", "Each flag sets every key it names (`*`: every training phase).",
           "", *_shorthand_table(), ""]
    for section, (doc, keys, when) in schema.SECTIONS.items():
        out += [f"## `{section}`", "", doc[0].upper() + doc[1:] + "."
                + (f" Read when: {when.text}." if when else ""), ""]
        if section == "model":
            out += ["| section | kinds (first: default) | read when | what |", "|---|---|---|---|"]
            for phase, sec in keys.items():
                out.append(f"| `model.{phase}` | {', '.join(f'`{k}`' for k in sec.kinds)} | {sec.when.text} "
                           f"| {_md(sec.doc)} |")
            out.append("")
            for kind, kind_keys in schema.MODEL_KINDS.items():
                phases = [p for p, sec in keys.items() if kind in sec.kinds]
                out += [f"### kind `{kind}`", "", f"In {', '.join(f'`model.{p}`' for p in phases)}.", "",
                        *_table(kind_keys, used=False), ""]
        elif section == "train":
            phases = list(keys)
            out += [f"`train.<phase>` for phase {', '.join(f'`{p}`' for p in phases)}: the same keys, read when "
                    "the method has that phase; defaults per phase.", ""]
            out += ["| key | type | " + " | ".join(f"default `{p}`" for p in phases) + " | meaning |",
                    "|---|---|" + "---|" * len(phases) + "---|"]
            for k, key in keys[phases[0]].items():
                defaults = " | ".join(_default(keys[p][k].default) for p in phases)
                out.append(f"| `{k}` | {_md(_type(key))} | {defaults} | {_md(key.doc)} |")
            out += [""] + [f"- `{p}`: {schema.TRAIN_DOCS[p]}" for p in phases] + [""]
        else:
            out += [*_table(keys, section_when=when), ""]
    return "\n".join(out).rstrip() + "\n"
