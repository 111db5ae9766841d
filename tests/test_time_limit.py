"""`--time-limit` / ``time_limit``: a stop requested by the clock, for platforms that end a session without a signal
(a Kaggle notebook past its limit saves nothing it wrote). It stops as SIGTERM does (checkpoint, ``Interrupted``, the
resume line), exits 124, never abandons a pool chunk, and a chain of limited sessions ends bit-equal to one run."""

import json
import signal

import pytest
import torch

from helpers import TINY_2D, cli
from sinkflow.errors import SinkflowError
from sinkflow.tools.status import read_status
from sinkflow.runtime.signals import TIME_LIMIT, TIME_LIMIT_EXIT, Interrupted, format_duration, parse_duration

# the pool: 4 batches in 2 chunks of 2 groups each (a chunk is one unit of work), then 6 velocity steps
ARGS = [a for a in TINY_2D if "=" in a and not a.startswith("pool.")] + [
    "pool.batches=4", "pool.steps=4", "pool.batch_size=32", "pool.chunk=2", "pool.in_flight=1",
    "train.velocity.iters=6", "experiment.device=cpu"]


@pytest.mark.parametrize("text, seconds", [("8h30m", 30600), ("90m", 5400), ("2.5h", 9000), ("45s", 45),
                                           ("1d2h", 93600), ("3600", 3600), ("0.5", 0.5), ("08:30:00", 30600),
                                           ("01:02:00:05", 93605), ("1-02:00:05", 93605), (" 10M ", 600),
                                           (120, 120), (0.25, 0.25)])
def test_durations_a_user_writes_parse(text, seconds):
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds  # what a resume line writes back reads the same


@pytest.mark.parametrize("seconds, text", [(30600, "8h30m"), (9, "9s"), (3600, "1h"), (93605, "1d2h5s"),
                                           (0.5, "0.5"), (1e-6, "0.000001")])
def test_a_resume_line_writes_the_time_limit_compactly(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("text", ["8x", "8h30", "h", "1h1h", "", "-5m", "1-2:3", "1:2", "0", "0s", "nan", float("inf"), -3, True,
                                  "1e-9", "99:99:99", "01:60:00", "1-00:00:60"])
def test_a_bad_duration_is_one_line_naming_the_fix(text):
    with pytest.raises(SinkflowError, match=r"time limit .* (is not a duration|must be a positive).*; .*8h30m"):
        parse_duration(text)


def _cfg(name):
    from sinkflow import config

    return config.resolve("moons", [f"experiment.name={name}", *ARGS])


def _progress(run):
    pool = run / "pool" / "progress.json"
    chunks = len(json.loads(pool.read_text())["chunks"]) if pool.exists() else 0
    steps = sorted(int(p.stem.split("_")[1]) for p in (run / "checkpoints" / "velocity").glob("step_*.pt")) \
        if (run / "checkpoints" / "velocity").is_dir() else []
    return chunks, (steps[-1] if steps else 0), (run / "checkpoints" / "velocity" / "final.pt").exists()


def test_a_chain_of_limited_sessions_makes_progress_each_time_and_ends_bit_equal(tmp_path, monkeypatch):
    """A limit that has passed before the first unit still lets each session finish one unit (a pool chunk: both
    of its groups; one training step) and checkpoint it, so no session is wasted, and the resumed chain's weights
    equal an uninterrupted run's."""
    from sinkflow.engine.experiment import train_run

    monkeypatch.chdir(tmp_path)
    train_run(_cfg("whole"))
    run = tmp_path / "runs" / "limited"
    seen, stops = [], []
    for attempt in range(20):
        try:
            if attempt == 0:
                train_run(_cfg("limited"), time_limit=1e-9)
            else:
                train_run(resume=run, time_limit=1e-9)
            break
        except Interrupted as exc:
            assert exc.signum == TIME_LIMIT and exc.exit_status == TIME_LIMIT_EXIT
            assert "stopped at the time limit in phase" in str(exc) and exc.run_dir.resolve() == run
            stops.append((exc.phase, exc.step))
            # every stop recorded as one, in phase or between two, though this process (a notebook's kernel) lives on
            st = read_status(run)
            assert st["state"] == "stopped" and (st["heartbeat"]["phase"], st["heartbeat"]["step"]) == stops[-1], st
            now = _progress(run)
            assert not seen or now > seen[-1], (seen, now)  # every session moved the run on
            seen.append(now)
    # one session a unit: the pool's first chunk; its last chunk ends the pool (final.pt), and the run stops before
    # the next phase; 5 velocity steps; the session of the last step ends the phase and, with no report to skip
    # (train_run without `then`, `--no-report`), the run: it returns. It had stopped with a step file at the last
    # step, then once more after writing final.pt (exit 124 and a resume line for a finished run)
    assert stops == [("pool", 1), ("pool", 2), *[("velocity", s) for s in range(1, 6)]], stops
    assert _progress(run) == (2, 6, True)
    a = torch.load(tmp_path / "runs/whole/checkpoints/velocity/final.pt", weights_only=True)
    b = torch.load(run / "checkpoints/velocity/final.pt", weights_only=True)
    assert a["step"] == b["step"] == 6
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_a_limit_passed_in_the_last_step_skips_only_the_report(tmp_path, monkeypatch):
    """With a report to follow (`sinkflow train` without --no-report), a limit that has passed when the last phase
    ends stops before the report (minutes on images; the next session writes it); without one the run ends."""
    from sinkflow.engine.experiment import train_run

    monkeypatch.chdir(tmp_path)
    train_run(_cfg("r"))
    final = tmp_path / "runs/r/checkpoints/velocity/final.pt"
    final.unlink()  # the last step again, from step_00000006.pt: nothing trains, the phase ends
    reports = []
    with pytest.raises(Interrupted) as e:
        train_run(resume=tmp_path / "runs/r", time_limit=1e-9, then=reports.append)
    assert (e.value.phase, e.value.step) == ("velocity", 6) and final.is_file() and not reports
    run = train_run(resume=tmp_path / "runs/r", time_limit=3600, then=reports.append)
    assert reports == [run]


def test_an_unreached_limit_changes_nothing(tmp_path, monkeypatch):
    from sinkflow.engine.experiment import train_run
    from sinkflow.runtime import signals

    monkeypatch.chdir(tmp_path)
    reports = []
    run = train_run(_cfg("t"), time_limit=3600, then=reports.append)
    assert reports == [run] and _progress(run.dir) == (2, 6, True)
    assert signals.stop_requested() is None  # the deadline ended with the run: nothing later sees it


def test_the_cli_exits_124_with_the_resume_line_and_status_says_why(tmp_path):
    out = cli("train", "moons", *TINY_2D, "--name", "k", "--no-report", "--time-limit", "0.000001", cwd=tmp_path)
    assert out.returncode == 124, out.stderr[-2000:]
    assert "stopped at the time limit in phase 'pool' after 1/2 batches; checkpoint saved; resume with `sinkflow " \
           "train --resume runs/k --no-report --time-limit 0.000001`" in out.stderr, out.stderr[-2000:]
    status = cli("status", "runs/k", cwd=tmp_path)
    assert "STOPPED (at the time limit at pool batch 1/2, checkpoint saved" in status.stdout, status.stdout
    # the console's command, time limit included (status said a plain resume: the next session had no limit)
    assert "`sinkflow train --resume runs/k --no-report --time-limit 0.000001`" in status.stdout, status.stdout
    out = cli("sample", "runs/k", "--n", "4", "--out", "x.png", cwd=tmp_path)  # so do the commands that need it done
    assert out.returncode == 2 and "phase 'velocity' of runs/k has not finished; finish it with `sinkflow train --resume " \
        "runs/k --no-report --time-limit 0.000001`" in out.stderr, out.stderr[-2000:]
    out = cli("train", "--resume", "runs/k", "--no-report", "--time-limit", "1h", cwd=tmp_path)
    assert out.returncode == 0 and _progress(tmp_path / "runs" / "k")[2], out.stderr[-2000:]


def test_the_python_apis_interrupted_names_the_run_folder_wherever_the_notebook_goes_next(tmp_path, monkeypatch):
    """``Interrupted.run_dir`` was relative (``runs/api``): after an ``os.chdir`` (a notebook's ``%cd``),
    ``sinkflow.resume(e.run_dir)`` said there is no run folder there. It is absolute, as a ``Run``'s folder is."""
    import sinkflow

    monkeypatch.chdir(tmp_path)
    tiny = {"experiment.device": "cpu", "pool.batches": 2, "pool.batch_size": 32, "pool.chunk": 1}
    with pytest.raises(sinkflow.Interrupted) as e:
        sinkflow.train("moons", name="api", time_limit=1e-9, train_iters=4, **tiny)
    assert e.value.run_dir.is_absolute() and e.value.run_dir == tmp_path.resolve() / "runs" / "api"
    # the call that continues it, as the command's line names its --resume (it said "checkpoint saved" alone)
    assert str(e.value).endswith(f"; checkpoint saved; continue it with sinkflow.resume('{e.value.run_dir}', "
                                 "time_limit='0.000000001')")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(sinkflow.Interrupted) as again:
        sinkflow.resume(e.value.run_dir, time_limit=1e-9)
    assert again.value.run_dir == e.value.run_dir


def test_a_bad_time_limit_is_refused_before_a_run_folder_exists(tmp_path, monkeypatch, capsys):
    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "moons", *TINY_2D, "--time-limit", "8h30"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sinkflow: error: time limit '8h30' is not a duration") and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_a_bad_time_limit_under_torchrun_is_said_by_rank_0_alone(tmp_path, monkeypatch, capsys):
    """`torchrun --nproc_per_node 2 -m sinkflow train --time-limit 8h30`: each rank parses the same bad value before
    the ranks connect, and each printed the line (8 lines on 8 processes). Rank 0 says it; every rank exits 2."""
    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "moons", *TINY_2D, "--time-limit", "8h30"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == lines, err
        assert not lines or err[0].startswith("sinkflow: error: time limit '8h30' is not a duration"), err
    assert not (tmp_path / "runs").exists()


def test_the_python_api_stops_at_a_time_limit_and_resumes(tmp_path, monkeypatch):
    """A notebook's chain: ``sinkflow.train(..., time_limit=)`` raises ``sinkflow.Interrupted`` with the run folder,
    ``sinkflow.resume`` continues it (with an override a resume may change) and returns the finished run."""
    import sinkflow

    monkeypatch.chdir(tmp_path)
    with pytest.raises(sinkflow.Interrupted) as e:
        sinkflow.train("moons", name="api", time_limit=1e-9, train_iters=4,
                       **{"experiment.device": "cpu", "pool.batches": 2, "pool.batch_size": 32, "pool.chunk": 1})
    assert e.value.signum == TIME_LIMIT and e.value.run_dir.resolve() == tmp_path / "runs" / "api"
    with pytest.raises(sinkflow.Interrupted):
        sinkflow.resume(e.value.run_dir, time_limit=1e-9)
    run = sinkflow.resume(e.value.run_dir, train_iters=6, time_limit="1h")
    final = torch.load(run.dir / "checkpoints" / "velocity" / "final.pt", weights_only=True)
    assert final["step"] == 6 and run.cfg["train"]["velocity"]["iters"] == 6
    assert run.sample(16, steps=2).shape == (16, 2)
    with pytest.raises(SinkflowError, match="time limit"):
        sinkflow.train("moons", name="bad", time_limit="soon")
    with pytest.raises(SinkflowError, match="unknown override 'iters'.* or one of device, time_limit, train_iters"):
        sinkflow.resume(run.dir, iters=3)
    with pytest.raises(SinkflowError, match="or one of runs_dir, name, device, time_limit, train_iters"):
        sinkflow.train("moons", iters=3)  # the call's own arguments were left out of the list
    assert not (tmp_path / "runs" / "bad").exists()


def test_a_real_signal_still_abandons_a_pool_chunk_but_the_limit_does_not(monkeypatch):
    """The time limit is not a signal: the pool's mid-chunk check (a preempted job has seconds) reads ``signalled``."""
    from sinkflow.runtime import signals

    with signals.graceful_stop(deadline=0.0):
        assert signals.stop_requested() == TIME_LIMIT and signals.signalled() is None
        signals._handler(signal.SIGTERM, None)
        assert signals.stop_requested() == signals.signalled() == signal.SIGTERM  # a real signal wins
    assert signals.stop_requested() is None


def test_a_change_on_resuming_a_half_built_pool_is_recorded_at_its_chunk(tmp_path, monkeypatch):
    """A resume of a pool stopped after its first chunk with a key it may change (pool.in_flight; on another number
    of processes, world_size) recorded the change in meta.json as "from phase pool step 0", as if nothing had been
    built: it took effect at chunk 1, where the heartbeat and `sinkflow status` stood."""
    from sinkflow.engine.experiment import train_run

    monkeypatch.chdir(tmp_path)
    with pytest.raises(Interrupted) as stop:
        train_run(_cfg("half"), time_limit=1e-9)
    assert (stop.value.phase, stop.value.step) == ("pool", 1)
    train_run(resume=tmp_path / "runs" / "half", overrides=["pool.in_flight=2"])
    changes = json.loads((tmp_path / "runs" / "half" / "meta.json").read_text())["changes"]
    assert [(c["key"], c["phase"], c["step"]) for c in changes] == [("pool.in_flight", "pool", 1)], changes


def test_a_resume_of_a_half_built_pool_on_another_world_names_its_chunks(tmp_path, monkeypatch, caplog):
    """The world-size note of a resume in the pool said "world_size 2 -> 1 from phase pool step 1": the 1 is the
    pool's built chunks (2 of its 4 batches here), not a training step. It says the chunks; meta.json keeps step 1."""
    import logging

    from sinkflow.engine.experiment import train_run

    monkeypatch.chdir(tmp_path)
    with pytest.raises(Interrupted):
        train_run(_cfg("grew"), time_limit=1e-9)
    monkeypatch.setattr("sinkflow.runtime.run_folder.ran_on", lambda run_dir: 2)  # the stopped session's 2 processes
    with caplog.at_level(logging.INFO):
        train_run(resume=tmp_path / "runs" / "grew")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("world_size 2 -> 1")]
    assert len(said) == 1 and said[0].startswith("world_size 2 -> 1 from phase pool after 1 built chunk(s): "), said
    changes = json.loads((tmp_path / "runs" / "grew" / "meta.json").read_text())["changes"]
    assert [(c["key"], c["phase"], c["step"]) for c in changes] == [("world_size", "pool", 1)], changes


def test_a_pool_stopped_mid_build_says_its_batches_as_its_bar_counts(tmp_path):
    """A pool stopped by a signal or the limit said "stopped ... in phase 'pool' at step 1" and status "at pool
    step 1" / "pool  step 1": its chunks, while its bar stood at 2/4 batches (40/60 on digits said "step 4"). The
    stop line, status's state and its phase line count the batches built."""
    out = cli("train", "moons", *ARGS, "--name", "c", "--no-report", "--time-limit", "0.000001", cwd=tmp_path)
    assert out.returncode == 124, out.stderr[-2000:]
    assert "stopped at the time limit in phase 'pool' after 2/4 batches; checkpoint saved" in out.stderr, \
        out.stderr[-2000:]
    shown = cli("status", "runs/c", cwd=tmp_path).stdout
    assert "STOPPED (at the time limit at pool batch 2/4, checkpoint saved" in shown, shown
    assert "phase        pool  batches 2/4 (50.0%)" in shown, shown


def test_a_pool_stopped_at_once_or_failed_says_its_batches(tmp_path, monkeypatch):
    """A second signal during the pool build (or an error in it) wrote the heartbeat's step as the batches done, a
    plain stop its chunks: status said "pool  step 40" beside another stop's "pool  step 4". Both record the
    batches, and status counts them as the bar does."""
    import time

    from sinkflow.engine.experiment import train_run
    from sinkflow.methods.pool import PoolTask
    from sinkflow.runtime.signals import StopNow
    from sinkflow.tools.status import format_status

    monkeypatch.chdir(tmp_path)
    real = PoolTask.run_unit

    for name, error in (("once", StopNow(int(signal.SIGTERM))), ("fail", RuntimeError("disk on fire"))):
        def run_unit(self, unit, error=error):
            if self.progress_done >= 2:  # the second chunk: 2 of 4 batches recorded
                raise error
            return real(self, unit)

        monkeypatch.setattr(PoolTask, "run_unit", run_unit)
        with pytest.raises(type(error)):
            train_run(_cfg(name))
        beat = json.loads((tmp_path / "runs" / name / "status.json").read_text())
        assert (beat["done"], beat["of"], beat["unit"]) == (2, 4, "batches"), beat
        beat["time"] = time.time()
        (tmp_path / "runs" / name / "status.json").write_text(json.dumps(beat))
        shown = format_status(read_status(tmp_path / "runs" / name))
        assert "phase        pool  batches 2/4 (50.0%)" in shown, shown
        if name == "fail":
            assert "FAILED (stopped at pool batch 2/4: disk on fire" in shown, shown


def test_a_stop_as_the_pool_ends_says_its_batches(tmp_path, monkeypatch):
    """A signal as the pool's last chunk ends lets the pool finish, and the run stops before the next phase: that
    stop said "at step 2" (the pool's chunks) while every other stop of the pool says its batches."""
    from sinkflow.engine.experiment import train_run
    from sinkflow.methods.pool import PoolTask
    from sinkflow.runtime import signals

    monkeypatch.chdir(tmp_path)
    real = PoolTask.close

    def close(self):  # the pool's last chunk is recorded, and the signal arrives as the phase ends
        real(self)
        signals._requested.append(int(signal.SIGTERM))

    monkeypatch.setattr(PoolTask, "close", close)
    with pytest.raises(signals.Interrupted, match="in phase 'pool' after 4/4 batches; checkpoint saved"):
        train_run(_cfg("end"))
    beat = json.loads((tmp_path / "runs" / "end" / "status.json").read_text())
    assert (beat["phase"], beat["done"], beat["of"], beat["state"]) == ("pool", 4, 4, "stopped"), beat
