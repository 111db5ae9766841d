"""Imports go one way (docs/architecture.md): a module may import its own layer or lower ones, never higher.

    errors -> config -> data -> ot / models / flows -> runtime -> methods -> engine -> eval -> tools -> cli -> api

"runtime" is the part of ``sinkflow.runner`` that methods build on (run folder, checkpoints, signals, dist,
callbacks, metrics); "engine" is the loop that runs the methods' tasks (``runner.trainer``,
``runner.experiment``). Every import counts, including those inside functions: a lazy import that runs
upwards is still a dependency upwards. The Python API (``sinkflow.api``, re-exported lazily by
``sinkflow/__init__.py``) sits on top, beside the CLI it shares its argument handling with.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sinkflow"
LAYERS = ["errors", "config", "data", "numerics", "runtime", "methods", "engine", "eval", "tools", "cli", "api"]
ENGINE = {"sinkflow.runner.trainer", "sinkflow.runner.experiment"}


def layer_of(module: str) -> str | None:
    """The layer of a ``sinkflow.*`` module (None: the package root or a non-sinkflow module)."""
    parts = module.split(".")
    if parts[0] != "sinkflow" or len(parts) < 2:
        return None
    top = parts[1]
    if top == "runner":
        return "engine" if ".".join(parts[:3]) in ENGINE else "runtime"
    if top in ("ot", "models", "flows"):
        return "numerics"
    if top in ("__main__",):
        return "cli"
    return top if top in LAYERS else None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported sinkflow module, line) for every import statement in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("sinkflow")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("sinkflow"):
            if node.module == "sinkflow":  # from sinkflow import config, methods
                out += [(f"sinkflow.{a.name}", node.lineno) for a in node.names]
            else:
                out.append((node.module, node.lineno))
    return out


def upward_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path)
        mine = layer_of(me)
        if mine is None:
            continue
        for target, line in imports(path):
            theirs = layer_of(target)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                bad.append(f"{me} ({mine}) imports {target} ({theirs}) at line {line}")
    return bad


def test_every_module_has_a_layer():
    unknown = [module_name(p) for p in ROOT.rglob("*.py")
               if layer_of(module_name(p)) is None and module_name(p) != "sinkflow"]
    assert not unknown, f"modules outside the layer map: {unknown}"


def test_imports_go_one_way():
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_checker_catches_an_upward_import(tmp_path):
    """The checker itself: a planted data -> methods import must be reported."""
    pkg = tmp_path / "sinkflow"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "bad.py").write_text("def f():\n    from sinkflow.methods import nsgf\n")
    (pkg / "data" / "ok.py").write_text("from sinkflow.config import schema\nfrom sinkflow.errors import SinkflowError\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        bad = upward_imports(pkg)
    finally:
        ROOT = saved
    assert bad == ["sinkflow.data.bad (data) imports sinkflow.methods (methods) at line 2"]


@pytest.mark.parametrize("module,layer", [("sinkflow.runner.trainer", "engine"), ("sinkflow.runner.checkpoint", "runtime"),
                                          ("sinkflow.ot.sinkhorn", "numerics"), ("sinkflow.cli.train", "cli")])
def test_layer_map(module, layer):
    assert layer_of(module) == layer
