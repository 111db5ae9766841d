import os

import pytest

os.environ.setdefault("SINKFLOW_PROGRESS", "0")  # keep test logs readable
# pytest-xdist runs one worker per core; more threads per worker only oversubscribe the CPU
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Run everything inside a temp folder (runs/, data/ are relative to the working directory)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs"
