"""The examples/ scripts, the README's Python API snippet and the docs' Python snippets run, with tiny counts, and do
what they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, cwd: Path) -> str:
    """The example's output; it must not warn (an example that warns teaches the setting the warning is about: the 2D
    loop's pool stopped its solves short of tol, the recipe's own counterexample)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SINKFLOW_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(REPO / "examples" / name), "--tiny", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Warning" not in out.stderr, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_nsgf_2d_own_loop(tmp_path):
    out = run_example("nsgf_2d_own_loop.py", cwd=tmp_path)
    loss, w2 = map(float, re.search(r"final loss ([\d.]+)\s+W2\(samples, fresh moons\) ([\d.]+)", out).groups())
    assert loss < 1.0  # a 200-step regression of O(5) velocities from a zero-ish start
    assert w2 < 2.0  # 8 Gaussians of radius ~5 start ~4 away from the moons: the flow moved them most of the way


@pytest.mark.slow
def test_nsgfpp_digits_through_the_api(tmp_path):
    out = run_example("nsgfpp_digits.py", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert "samples (64, 1, 8, 8)" in out
    grids = list((tmp_path / "runs").glob("*/example_grid.png"))
    assert len(grids) == 1 and grids[0].stat().st_size > 0
    assert (grids[0].parent / "checkpoints" / "time" / "final.pt").is_file()  # every NSGF++ phase finished
    assert grids[0].parent.name.startswith("digits-nsgfpp-")  # named by the resolved method, as the CLI names it


@pytest.mark.slow
def test_glow_constant_memory(tmp_path):
    out = run_example("glow_constant_memory.py", cwd=tmp_path)
    diff = float(re.search(r"largest gradient difference ([\d.e+-]+)", out).group(1))
    assert diff < 1e-4  # invertible backward = plain autograd
    bpd = [float(v) for v in re.findall(r"bits/dim ([\d.]+)", out)]
    assert len(bpd) >= 2 and bpd[-1] < bpd[0]  # it learns
    assert "finite: True" in out


def test_readme_api_snippet_runs(tmp_path, monkeypatch):
    """The README's Python API example is executed as written (with tiny counts substituted)."""
    text = (REPO / "README.md").read_text()
    code = re.search(r"<!-- api-example -->\n```python\n(.*?)```", text, re.S).group(1)
    tiny = code.replace("train_iters=2000", "train_iters=3").replace('"pool.batches": 64', '"pool.batches": 2')
    assert tiny != code, "the README example changed: update the tiny substitutions"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SINKFLOW_PROGRESS", "0")
    scope: dict = {}
    exec(compile(tiny, "README.md", "exec"), scope)
    assert tuple(scope["x"].shape) == (1024, 2)
    assert (tmp_path / "runs").is_dir()


def _docs_snippets() -> dict[str, list[str]]:
    """Every ```python block of docs/*.md, by file name."""
    blocks = {}
    for doc in sorted((REPO / "docs").glob("*.md")):
        found = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
        if found:
            blocks[doc.name] = found
    return blocks


def _snippet_scope(name: str) -> dict:
    """The names a docs snippet takes as given (its reader's own tensors and config), tiny."""
    import torch

    from sinkflow import config

    if name == "data.md":
        return {"cfg": config.resolve("moons"), "generator": torch.Generator().manual_seed(0)}
    if name == "models.md":
        return {"cfg": config.resolve("mnist")}
    if name == "flows.md":
        return {"x_uint8": torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8)}
    if name == "ot.md":
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 2, generator=g), torch.randn(32, 2, generator=g) + 2
        return {"x": x, "y": y, "x0": x.clone(), "X": torch.randn(2, 32, 2, generator=g),
                "Y": torch.randn(2, 32, 2, generator=g) + 2, "samples": x, "test_set": y}
    raise AssertionError(f"docs/{name} has a Python snippet this test does not know: give it a scope here")


def test_every_docs_python_snippet_has_a_scope():
    """A new ```python block in docs/ fails here until _snippet_scope gives it its free names (README's has its own)."""
    assert sorted(_docs_snippets()) == ["data.md", "flows.md", "models.md", "ot.md"]


@pytest.mark.parametrize("name", ["data.md", "flows.md", "models.md", "ot.md"])
def test_docs_python_snippet_runs(name, tmp_path, monkeypatch):
    """Each docs page's Python snippet runs as written, on the reader's names given tiny values (data.md's
    device="cuda" runs on the CPU where there is no card), and its comments' shapes hold."""
    import torch

    monkeypatch.chdir(tmp_path)
    scope = _snippet_scope(name)
    for code in _docs_snippets()[name]:
        if not torch.cuda.is_available():
            code = code.replace('device="cuda"', 'device="cpu"')
        exec(compile(code, f"docs/{name}", "exec"), scope)
    if name == "data.md":
        assert tuple(scope["x"].shape) == (256, *scope["dist"].shape) and scope["x"].dtype == torch.float32
        assert tuple(scope["ref"].shape) == (1024, 2) and scope["ref"].device.type == "cpu"
    elif name == "models.md":
        x = torch.randn(2, 1, 28, 28)
        assert scope["v"](x, torch.rand(2)).shape == x.shape
        t = scope["tp"](x)
        assert t.shape == (2,) and bool(((t >= 0) & (t <= 1)).all())
    elif name == "flows.md":
        assert scope["loss"].requires_grad and not scope["bpd"].requires_grad
        assert tuple(scope["images"].shape) == (64, 1, 28, 28)
    else:
        assert tuple(scope["v"].shape) == (2, 32, 2)  # the batched call, the last v
        assert tuple(scope["xs"].shape) == tuple(scope["vs"].shape) == (5, 32, 2)
        assert isinstance(scope["B"], int) and scope["B"] >= 1
