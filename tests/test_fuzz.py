"""Property-based tests (hypothesis) of the run folder's contract (docs/reliability.md, "Fuzzed"):
whatever a checkpoint holds, whatever override or count argument a user types, a command either works
(exit 0) or stops with exit 2 and exactly one line ``sinkflow: error: ...``, never a traceback, and a
refused command leaves the run folder byte-identical (status.json and .lock included).

Generated: the content of a step checkpoint and of ``final.pt`` (any entry replaced by junk of any type,
dtype or shape, or removed), config overrides (any schema key or a typo of one, with values of any
type), and the count arguments of ``sample`` / ``eval`` (zero, negative, huge, not a number). Kept fast:
few examples, deterministic (``derandomize``), one shared tiny run copied per example.
"""

import contextlib
import io
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import bytes_snapshot
from sinkflow.cli import main

# SINKFLOW_FUZZ=N: N random (not derandomized) examples per test, for a longer hunt than the suite's
_LONG = int(os.environ.get("SINKFLOW_FUZZ", "0"))
FAST = settings(max_examples=_LONG or 12, deadline=None, derandomize=not _LONG, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DELETE = object()


def run_cli(*argv) -> tuple[int, str]:
    """``main(argv)`` with stderr captured; an exception other than SystemExit fails the test (a traceback)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:
            rc = exc.code
    return rc, err.getvalue()


def assert_contract(rc, err, before, after, changed_ok=False):
    assert rc in (0, 2), (rc, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    if rc == 2:
        assert len(lines) == 1 and lines[0].startswith("sinkflow: error: "), err
        assert after == before, "a refused command changed the run folder"
    elif not changed_ok:
        assert after == before


@contextlib.contextmanager
def copy_of(run: Path):
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "runs" / "r"
        shutil.copytree(run, dst)
        yield dst


# ---- generated checkpoint contents ------------------------------------------------------------------------

def leaf_paths(obj, prefix=()):
    """Every entry a fuzzer may replace: dict keys and short-list items, down to tensors and numbers."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) and len(obj) <= 8 else []
    for key, value in items:
        path = (*prefix, key)
        if path[:2] == ("identity", "frozen"):
            continue  # each is refused by the identity check, tested elsewhere
        out.append(path)
        out += leaf_paths(value, path)
    return out


def junk_tensor(dtype, shape):
    return torch.ones(shape, dtype=dtype) if dtype != torch.bool else torch.ones(shape, dtype=torch.bool)


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.integers(-3, 3), max_size=4), st.just({}),
    st.builds(junk_tensor, st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.bool,
                                            torch.uint8]),
              st.lists(st.integers(0, 3), max_size=3).map(tuple)),
    st.just(DELETE))


def mutate(path: Path, where: tuple, value) -> None:
    state = torch.load(path, weights_only=True)
    d = state
    for k in where[:-1]:
        d = d[k]
    if value is DELETE:
        del d[where[-1]]
    else:
        d[where[-1]] = value
    torch.save(state, path)


@pytest.fixture(scope="module")
def step_paths(tiny_run):
    return leaf_paths(torch.load(tiny_run / "checkpoints/velocity/step_00000003.pt", weights_only=True))


@pytest.fixture(scope="module")
def final_paths(tiny_run):
    return leaf_paths(torch.load(tiny_run / "checkpoints/velocity/final.pt", weights_only=True))


@FAST
@given(data=st.data())
def test_fuzzed_step_checkpoint_resumes_or_is_refused_untouched(tiny_run, step_paths, data):
    where = data.draw(st.sampled_from(step_paths), label="entry")
    value = data.draw(JUNK, label="value")
    with copy_of(tiny_run) as run:
        ck = run / "checkpoints" / "velocity"
        (ck / "final.pt").unlink()
        (ck / "step_00000006.pt").unlink()  # resume at step 3: three steps use what was loaded
        mutate(ck / "step_00000003.pt", where, value)
        before = bytes_snapshot(run)
        rc, err = run_cli("train", "--resume", run, "--no-report")
        assert_contract(rc, err, before, bytes_snapshot(run), changed_ok=True)


@FAST
@given(data=st.data())
def test_fuzzed_final_samples_or_is_refused_untouched(tiny_run, final_paths, data):
    where = data.draw(st.sampled_from(final_paths), label="entry")
    value = data.draw(JUNK, label="value")
    with copy_of(tiny_run) as run:
        mutate(run / "checkpoints/velocity/final.pt", where, value)
        before = bytes_snapshot(run)
        rc, err = run_cli("sample", run, "--n", "4", "--out", run.parent / "s.npy")
        assert_contract(rc, err, before, bytes_snapshot(run))
        rc, err = run_cli("train", "--resume", run, "--no-report")  # a finished run: its final.pt is checked
        assert_contract(rc, err, before, bytes_snapshot(run), changed_ok=True)


# ---- generated config overrides ---------------------------------------------------------------------------

def _keys():
    from sinkflow import config
    from sinkflow.config import schema

    return sorted(schema.used(config.resolve("moons", [])))


KEYS = _keys()
VALUES = st.one_of(
    st.sampled_from(["0", "-1", "1", "1e400", "nan", "inf", "true", "null", "[]", "[1, 2]", "{}", "{a: 1}", "''",
                     "2020-01-01", "0x10", "moons", "cpu", "cuda:9", "~", "!!python/object:os.system", "[", "é"]),
    st.integers(-10**20, 10**20).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=6))
KEY = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k + "x"),
                st.sampled_from(KEYS).map(lambda k: k.split(".")[-1]))


@FAST
@given(key=KEY, value=VALUES)
def test_fuzzed_override_resolves_or_is_one_line(key, value):
    rc, err = run_cli("config", "moons", f"{key}={value}")
    assert_contract(rc, err, None, None)


@FAST
@given(key=KEY, value=VALUES)
def test_fuzzed_resume_override_is_applied_or_refused_untouched(tiny_run, key, value):
    with copy_of(tiny_run) as run:
        before = bytes_snapshot(run)
        rc, err = run_cli("train", "--resume", run, f"{key}={value}", "--no-report")
        assert_contract(rc, err, before, bytes_snapshot(run), changed_ok=True)


# ---- generated CLI arguments ------------------------------------------------------------------------------

COUNT = st.one_of(st.integers(-10, 4).map(str), st.integers(10**12, 10**20).map(str), st.text(max_size=4),
                  st.sampled_from(["1.5", "1e3", "0x10", " 3", "", "-0"]))


@FAST
@given(flag=st.sampled_from(["--n", "--steps", "--seed"]), value=COUNT)
def test_fuzzed_sample_arguments(tiny_run, flag, value):
    with copy_of(tiny_run) as run:
        before = bytes_snapshot(run)
        rc, err = run_cli("sample", run, flag, value, "--out", run.parent / "s.npy")
        assert_contract(rc, err, before, bytes_snapshot(run))


@FAST
@given(flag=st.sampled_from(["--n", "--seeds"]), value=COUNT)
def test_fuzzed_eval_arguments(tiny_run, flag, value):
    with copy_of(tiny_run) as run:
        before = bytes_snapshot(run)
        rc, err = run_cli("eval", run, flag, value)
        assert_contract(rc, err, before, bytes_snapshot(run), changed_ok=True)  # a score is appended on success
