import os

import pytest

os.environ.setdefault("SINKFLOW_PROGRESS", "0")  # keep test logs readable


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Run everything inside a temp folder (runs/, data/ are relative to the working directory)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs"
