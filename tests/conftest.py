import gc
import os

import pytest

os.environ.setdefault("SINKFLOW_PROGRESS", "0")  # keep test logs readable
# pytest-xdist runs one worker per core; more threads per worker only oversubscribe the CPU
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_runtest_setup(item):
    """Before each test, the objects still alive (modules torch, sympy and the tests imported, session and module
    fixtures) leave the collector's view (``gc.freeze``) once the previous test's cyclic garbage is collected: a
    worker's heap holds some 350,000 such objects and every full collection walked them all, about 0.3 s each time,
    and ``RunFolder.release`` collects after every phase of every in-process run (test_doctor.py spent 21 s of
    46 in the collector). Only the time of the collections changes: the current test's objects are collected as
    before (frozen ones are those that outlived their test)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def sinkflow_log_level():
    """A test that plays rank 1 of a torchrun job (``dist.init`` quiets a non-main rank's "sinkflow" logger to
    WARNING and "sinkflow.data" to ERROR, as it should in that process) left the level behind for the worker's later tests, whose INFO lines
    then went uncaptured: each test starts at the level the worker began with."""
    import logging

    loggers = [logging.getLogger(name) for name in ("sinkflow", "sinkflow.data")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


@pytest.fixture(autouse=True)
def ieee_subnormals():
    """Torch 2.4 (also 2.5; pytorch/pytorch#126848) builds a compiled step's CPU kernels with -ffast-math, and loading
    them switches the process to flushing subnormal floats to zero (FTZ/DAZ) for good: hypothesis then refuses to draw
    a float at all (test_fuzz.py, after a test that compiled on the CPU in the same worker). Each test starts with
    IEEE subnormals, whatever an earlier test's compile left."""
    import sys

    torch = sys.modules.get("torch")  # not imported yet: nothing of torch's can have changed the mode
    if torch is not None:
        torch.set_flush_denormal(False)


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Run everything inside a temp folder (runs/, data/ are relative to the working directory)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs"


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A finished tiny moons NSGF run (pool; velocity steps 3 and 6 and final.pt), built once per worker.
    Tests copy it (``shutil.copytree``) before changing anything."""
    from helpers import TINY_2D, train_in

    return train_in(tmp_path_factory.mktemp("tiny"), ["moons", *TINY_2D, "--name", "base", "--no-report"]) / "base"
