"""Imports go one way (docs/architecture.md): a module may import its own layer or lower ones, never higher,
and no set of modules imports itself round in a cycle.

    errors, torch_floor, processes -> config -> data -> ot -> flows -> models -> runtime -> methods -> engine
    -> eval -> tools -> cli -> api

Each layer is a package of ``sinkflow`` (``runtime``: the run folder, checkpoints, signals, dist, callbacks that
methods build on; ``engine``: the loop that runs the methods' tasks). Every import counts, including those inside
functions: a lazy import that runs upwards, or round in a cycle, is still a dependency. The Python API
(``sinkflow.api``, re-exported lazily by ``sinkflow/__init__.py``) sits on top, beside the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sinkflow"
LAYERS = ["errors", "torch_floor", "processes", "config", "data", "ot", "flows", "models", "runtime", "methods",
          "engine", "eval", "tools", "cli", "api"]


def layer_of(module: str) -> str | None:
    """The layer of a ``sinkflow.*`` module (None: the package root or a non-sinkflow module)."""
    parts = module.split(".")
    if parts[0] != "sinkflow" or len(parts) < 2:
        return None
    if parts[1] == "__main__":
        return "cli"
    return parts[1] if parts[1] in LAYERS else None


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported sinkflow module, line) for every import statement in the file, at any depth.

    ``from sinkflow.pkg import name`` counts as an import of ``sinkflow.pkg.name`` where that is a module (a
    submodule is what it loads), else of the package ``sinkflow.pkg`` itself."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("sinkflow")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("sinkflow"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub if sub in known else node.module, node.lineno))
    return out


def graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported sinkflow module: first line}, the package root excluded (it only re-exports lazily)."""
    mods = modules(root)
    g = {}
    for me, path in mods.items():
        if me == "sinkflow":
            continue
        g[me] = {}
        for target, line in imports(path, set(mods)):
            if target != me and target in mods and target != "sinkflow":
                g[me].setdefault(target, line)
    return g


def upward_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for me, targets in graph(root).items():
        mine = layer_of(me)
        for target, line in targets.items():
            theirs = layer_of(target)
            if mine is not None and theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                bad.append(f"{me} ({mine}) imports {target} ({theirs}) at line {line}")
    return bad


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted; a package and its own
    submodule count too (``config/__init__`` importing ``config.schema`` which imports back from ``config``)."""
    g = graph(root)
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def test_every_module_has_a_layer():
    unknown = [m for m in modules(ROOT) if layer_of(m) is None and m != "sinkflow"]
    assert not unknown, f"modules outside the layer map: {unknown}"


def test_imports_go_one_way():
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def imports_of_the_cli(root: Path = ROOT) -> list[str]:
    """Modules outside ``cli`` that import it: the CLI is argument handling on top; what the Python API shares with a
    command (opening a trained run, the out-of-memory line) lives in ``tools``, below both."""
    return [f"{me} imports {target} at line {line}" for me, targets in graph(root).items() if layer_of(me) != "cli"
            for target, line in targets.items() if layer_of(target) == "cli"]


def test_nothing_but_the_cli_imports_the_cli():
    bad = imports_of_the_cli()
    assert not bad, "imports of the cli:\n" + "\n".join(bad)


def test_checker_catches_an_import_of_the_cli(tmp_path):
    pkg = plant(tmp_path, {"api.py": "def f():\n    from sinkflow.cli.common import open_trained\n",
                           "cli/common.py": "from sinkflow.tools import trained\n", "tools/trained.py": ""})
    assert imports_of_the_cli(pkg) == ["sinkflow.api imports sinkflow.cli.common at line 2"]


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "sinkflow"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        for parent in (pkg / rel).parents:
            if parent == pkg.parent:
                break
            (parent / "__init__.py").touch()
        (pkg / rel).write_text(text)
    return pkg


def test_checker_catches_an_upward_import(tmp_path):
    """The checker itself: a planted data -> methods import must be reported, a downward one must not."""
    pkg = plant(tmp_path, {"data/bad.py": "def f():\n    from sinkflow.methods import nsgf\n",
                           "data/ok.py": "from sinkflow.config import schema\nfrom sinkflow.errors import SinkflowError\n",
                           "methods/nsgf.py": "", "config/schema.py": "", "errors.py": ""})
    assert upward_imports(pkg) == ["sinkflow.data.bad (data) imports sinkflow.methods.nsgf (methods) at line 2"]


def test_checker_orders_ot_flows_models(tmp_path):
    """ot, flows and models are layers of their own: models may use flows, flows never models, ot neither."""
    pkg = plant(tmp_path, {"models/flow.py": "from sinkflow.flows import model\n",
                           "flows/model.py": "from sinkflow.ot import sinkhorn\n",
                           "ot/sinkhorn.py": "import sinkflow.models.flow\n"})
    assert upward_imports(pkg) == ["sinkflow.ot.sinkhorn (ot) imports sinkflow.models.flow (models) at line 1"]


def test_checker_catches_a_cycle(tmp_path):
    """A planted three-module cycle inside one layer (no upward import) and a package <-> submodule cycle."""
    pkg = plant(tmp_path, {"ot/a.py": "from sinkflow.ot import b\n", "ot/b.py": "def f():\n    import sinkflow.ot.c\n",
                           "ot/c.py": "from sinkflow.ot.a import thing\n", "ot/d.py": "from sinkflow.ot import a\n",
                           "config/__init__.py": "from sinkflow.config import schema\n",
                           "config/schema.py": "def g():\n    from sinkflow.config import parse_value\n"})
    assert upward_imports(pkg) == []
    assert import_cycles(pkg) == [["sinkflow.config", "sinkflow.config.schema"],
                                  ["sinkflow.ot.a", "sinkflow.ot.b", "sinkflow.ot.c"]]


@pytest.mark.parametrize("module,layer", [("sinkflow.engine.trainer", "engine"), ("sinkflow.runtime.checkpoint", "runtime"),
                                          ("sinkflow.ot.sinkhorn", "ot"), ("sinkflow.models.flow", "models"),
                                          ("sinkflow.cli.train", "cli"), ("sinkflow.__main__", "cli")])
def test_layer_map(module, layer):
    assert layer_of(module) == layer
