"""The examples/ scripts and the README's Python API snippet run, with tiny counts, and do what they say."""

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
