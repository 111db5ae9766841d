"""Resume equivalence under SIGKILL, checkpoint-on-SIGTERM, and a pool build killed mid-way."""

import json
import signal
import subprocess
import sys
import time
import os

import numpy as np
import torch

from helpers import TINY_2D, cli

ARGS = ["moons", "pool.batches=4", "pool.steps=5", "pool.batch_size=64", "pool.chunk=1",
        "--train-iters", "600", "train.velocity.ckpt_every=100", "train.velocity.log_every=100",
        "--device", "cpu", "--no-report"]


def start(cwd, name, *extra):
    env = {**os.environ, "SINKFLOW_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "sinkflow", "train", *ARGS, *extra, "--name", name], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(predicate, proc, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def final_weights(run):
    return torch.load(run / "checkpoints/velocity/final.pt", weights_only=True)


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    env = {"OMP_NUM_THREADS": "1"}
    ref = cli("train", *ARGS, "--name", "ref", cwd=tmp_path, env=env)
    assert ref.returncode == 0, ref.stderr
    proc = start(tmp_path, "killed")
    ckdir = tmp_path / "runs/killed/checkpoints/velocity"
    assert wait_for(lambda: ckdir.is_dir() and len(list(ckdir.glob("step_*.pt"))) >= 2, proc), proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (ckdir / "final.pt").exists()
    resumed = cli("train", "--resume", str(tmp_path / "runs/killed"), "--no-report", cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr
    a, b = final_weights(tmp_path / "runs/ref"), final_weights(tmp_path / "runs/killed")
    assert a["step"] == b["step"] == 600
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_sigterm_writes_a_checkpoint_then_resume_finishes(tmp_path):
    proc = start(tmp_path, "term", "train.velocity.ckpt_every=100000")
    ckdir = tmp_path / "runs/term/checkpoints"
    assert wait_for(lambda: (ckdir / "pool/final.pt").exists() and (tmp_path / "runs/term/metrics.jsonl").exists()
                    and "velocity" in (tmp_path / "runs/term/metrics.jsonl").read_text(), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "resume with `sinkflow train --resume" in err and "--no-report`" in err  # resumed as it was started
    steps = list((ckdir / "velocity").glob("step_*.pt"))
    assert len(steps) == 1  # written on SIGTERM even though ckpt_every was never reached
    status = cli("status", str(tmp_path / "runs/term"), cwd=tmp_path)  # a clean stop is not a dead run
    assert status.returncode == 1 and "STOPPED (by signal 15 at velocity step" in status.stdout, status.stdout
    assert "checkpoint saved; resume with `sinkflow train --resume" in status.stdout and "DEAD" not in status.stdout
    assert "--no-report`" in status.stdout  # a plain resume ran the report the run was started without
    resumed = cli("train", "--resume", str(tmp_path / "runs/term"), "--no-report", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert final_weights(tmp_path / "runs/term")["step"] == 600


def test_pool_build_resumes_from_last_finished_chunk(tmp_path):
    """Kill during the pool build; the resumed pool equals an uninterrupted one, chunk for chunk."""
    args = ["moons", "pool.batches=16", "pool.steps=5", "pool.batch_size=128", "pool.chunk=1",
            "--train-iters", "2", "--device", "cpu", "--no-report"]
    ref = cli("train", *args, "--name", "ref", cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    env = {**os.environ, "SINKFLOW_PROGRESS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "sinkflow", "train", *args, "--name", "k"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    progress = tmp_path / "runs/k/pool/progress.json"
    assert wait_for(lambda: progress.exists() and len(json.loads(progress.read_text())["chunks"]) >= 2, proc, timeout=300)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_at_kill = len(json.loads(progress.read_text())["chunks"])
    assert done_at_kill < 16
    resumed = cli("train", "--resume", str(tmp_path / "runs/k"), "--no-report", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    for key in ("x", "v", "t"):
        np.testing.assert_array_equal(np.load(tmp_path / f"runs/ref/pool/{key}.npy"),
                                      np.load(tmp_path / f"runs/k/pool/{key}.npy"))


def test_a_signal_after_the_last_step_skips_the_report_and_keeps_the_run(tmp_path, monkeypatch):
    """A SIGTERM that lands after the last phase's last step check (while final.pt is written) used to be dropped:
    the evaluation report then ran for minutes on an image run. It now stops before the report, with the usual
    resume line; everything is saved, and the resume of the finished run only reports."""
    import pytest

    from helpers import TINY_2D
    from sinkflow import config
    from sinkflow.engine.experiment import train_run
    from sinkflow.runtime.callbacks import Callback
    from sinkflow.runtime.signals import Interrupted

    class SigtermAtTheEnd(Callback):
        def on_phase_end(self, trainer):
            if trainer.name == "velocity":
                os.kill(os.getpid(), signal.SIGTERM)  # the handler only records it: nothing checks it any more

    monkeypatch.chdir(tmp_path)
    reports = []
    cfg = config.resolve("moons", ["experiment.name=t", *[a for a in TINY_2D if "=" in a], "train.velocity.iters=6",
                                   "experiment.device=cpu"])
    with pytest.raises(Interrupted) as e:
        train_run(cfg, callbacks=[SigtermAtTheEnd()], then=reports.append)
    assert (e.value.signum, e.value.phase, e.value.step) == (signal.SIGTERM, "velocity", 6) and reports == []
    assert (tmp_path / "runs" / "t" / "checkpoints" / "velocity" / "final.pt").exists()
    run = train_run(resume=tmp_path / "runs" / "t", then=reports.append)
    assert reports == [run]


def test_a_signal_during_the_final_report_says_the_run_is_saved(tmp_path, monkeypatch, capsys):
    """SIGTERM's default ended a long evaluation report in silence (Ctrl+C with a traceback): one line now says
    training is finished and saved and which command reports it, with the usual exit status."""
    import pytest

    import sinkflow.eval.report
    from helpers import TINY_2D
    from sinkflow.cli import main

    def interrupted_report(run):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        raise AssertionError("the report went on after SIGTERM")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sinkflow.eval.report, "final_report", interrupted_report)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        main(["train", "moons", *TINY_2D, "--name", "r"])
    err = capsys.readouterr().err
    assert e.value.code == 128 + signal.SIGTERM, err
    assert "report was stopped by signal 15; training is finished and saved: `sinkflow eval" in err
    assert (tmp_path / "runs" / "r" / "checkpoints" / "velocity" / "final.pt").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is back


def test_a_resume_inside_a_logging_window_logs_the_uninterrupted_losses(tmp_path):
    """The logged loss is the mean since the last log step. A run resumed from a checkpoint inside that window (step
    3 of a log_every=5 window) restarted the sum: its step-5 loss was the mean of 2 steps, not 5. The checkpoint
    holds the window now; the resumed run's log equals the uninterrupted run's."""
    import shutil

    args = ["moons", "--method", "fm", "--train-iters", "10", "train.velocity.ckpt_every=3",
            "train.velocity.log_every=5", "--device", "cpu", "--no-report"]
    out = cli("train", *args, "--name", "whole", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    whole = tmp_path / "runs" / "whole"
    resumed = tmp_path / "runs" / "resumed"
    shutil.copytree(whole, resumed)
    ckpts = resumed / "checkpoints" / "velocity"
    for name in ("final.pt", "step_00000006.pt", "step_00000009.pt"):
        (ckpts / name).unlink()
    (resumed / "status.json").unlink(missing_ok=True)
    out = cli("train", "--resume", str(resumed), "--no-report", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]

    def losses(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if r.get("phase") == "velocity" and "loss" in r]

    # each step once: the copied log's steps 5 and 10 (past the step-3 checkpoint, as a killed process leaves them)
    # were logged again after them
    assert losses(resumed) == losses(whole) and [s for s, _ in losses(whole)] == [5, 10], (losses(resumed), losses(whole))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resumed / "tb" / "velocity"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("velocity/loss")] == \
        [(s, round(v, 5)) for s, v in losses(whole)]
    # what was set aside is kept, not deleted: the records past the step-3 checkpoint the resume logged again
    aside = [json.loads(x) for x in (resumed / "metrics.rewound.jsonl").read_text().splitlines()]
    assert [r["step"] for r in aside if r["phase"] == "velocity" and "loss" in r] == [5, 10]
    assert "training from step 3; the" in out.stderr and "moved to metrics.rewound.jsonl" in out.stderr

    # checkpoints/ deleted: the phase starts over at 0, saying so, and its whole history is set aside, not wiped
    # (the old metrics.jsonl was rewritten with none of it); a partial last line (a kill mid-write) stays its own line
    gone = tmp_path / "runs" / "gone"
    shutil.copytree(whole, gone)
    shutil.rmtree(gone / "checkpoints" / "velocity")
    (gone / "status.json").unlink(missing_ok=True)
    text = (gone / "metrics.jsonl").read_text()
    (gone / "metrics.jsonl").write_text(text + '{"time": 1, "phase": "velocity", "st')  # cut mid-record
    out = cli("train", "--resume", str(gone), "--no-report", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "velocity: no step checkpoint found: training again from step 0; the" in out.stderr, out.stderr[-2000:]
    aside = [json.loads(x) for x in (gone / "metrics.rewound.jsonl").read_text().splitlines()]
    assert [r["step"] for r in aside if "loss" in r] == [5, 10]
    lines = (gone / "metrics.jsonl").read_text().splitlines()
    assert '{"time": 1, "phase": "velocity", "st' in lines  # the cut line alone, every new record parses
    assert losses_of(lines) == losses(whole)


def losses_of(lines):
    rows = [json.loads(x) for x in lines if x.startswith("{") and x.endswith("}")]
    return [(r["step"], r["loss"]) for r in rows if r.get("phase") == "velocity" and "loss" in r]


def test_a_stop_inside_a_pool_chunk_leaves_it_and_a_second_signal_is_one_line(tmp_path, monkeypatch, capsys):
    """A SIGTERM during a long pool chunk waited for the whole chunk (a preempted job has seconds): the chunk's
    next group of batches is not started, the chunk stays unrecorded and the resume rebuilds it; a second signal
    ("now") printed a 70-line KeyboardInterrupt traceback, and is one line now."""
    import sinkflow.methods.pool as pool
    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SINKFLOW_PROGRESS", "0")
    args = ["moons", "pool.batches=4", "pool.steps=3", "pool.batch_size=32", "pool.chunk=4", "pool.in_flight=1",
            "--train-iters", "2", "--device", "cpu", "--no-report"]
    groups = []
    real = pool.PoolTask._simulate_group
    monkeypatch.setattr(pool.PoolTask, "_simulate_group", lambda self, *a: groups.append(1) or real(self, *a))
    monkeypatch.setattr(pool, "signalled", lambda: signal.SIGTERM if groups else None)
    monkeypatch.setattr("sinkflow.engine.trainer.stop_requested", lambda: signal.SIGTERM if groups else None)
    assert main(["train", *args, "--name", "k"]) == 128 + signal.SIGTERM
    assert len(groups) == 1  # the chunk's other three groups were not started
    progress = tmp_path / "runs/k/pool/progress.json"
    assert not progress.exists() or json.loads(progress.read_text())["chunks"] == []
    assert "resume with `sinkflow train --resume" in capsys.readouterr().err
    monkeypatch.setattr(pool, "signalled", lambda: None)
    monkeypatch.setattr("sinkflow.engine.trainer.stop_requested", lambda: None)
    assert main(["train", "--resume", str(tmp_path / "runs/k"), "--no-report"]) == 0
    assert json.loads(progress.read_text())["chunks"] == [0] and len(groups) == 5

    from sinkflow.runtime import signals

    for second, name in ((signal.SIGTERM, "k2"), (signal.SIGINT, "k3")):
        def now(*a, second=second):  # a SIGTERM, then a second signal: what the handler raises on the second
            with signals.graceful_stop():
                signals._handler(signal.SIGTERM, None)
                signals._handler(second, None)
        monkeypatch.setattr(pool.PoolTask, "_simulate_group", now)
        assert main(["train", *args, "--name", name]) == 128 + second  # 143 for a second SIGTERM (was 130)
        err = capsys.readouterr().err
        assert "stopped at once by a second signal" in err and "sinkflow train --resume" in err
        assert f"runs/{name} --no-report`" in err  # resumed as launched (a plain --resume ran the report it skipped)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        # `sinkflow status` says so (it said DEAD: the heartbeat was the running phase's), though the pid that
        # wrote it, this test's, lives on (as a notebook's kernel does)
        assert main(["status", str(tmp_path / "runs" / name)]) == 1
        assert f"STOPPED (at once by a second signal, {int(second)}, in pool: the work since its last checkpoint " \
            "is lost" in capsys.readouterr().out


def test_tensorboard_hides_a_killed_tail_after_a_resume_that_died_before_logging(tmp_path):
    """kill -9 past the step-500 checkpoint, a resume that moved the rows past it out of metrics.jsonl and died (a
    time limit, a kill) before its first log step, then a resume that finds nothing to move: TensorBoard's purge was
    scheduled only when rows moved, so the killed process's steps 550-700 stayed in view beside the new ones."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sinkflow.runtime.metrics import MetricsLogger

    killed = MetricsLogger(tmp_path)
    for step in range(50, 701, 50):
        killed.log("velocity", step, {"loss": 1.0 / step})
    killed.close()
    # three processes, seconds apart: TensorBoard reads a folder's event files in name order, and a name holds the
    # second and then a per-process counter, so in one process within one second the counter's 9 -> 10 sorted the
    # resumed file first (this test failed after other files' tests had written nine event files)
    time.sleep(1.05)
    died = MetricsLogger(tmp_path)
    assert [r["step"] for r in died.rewind("velocity", 500)] == [550, 600, 650, 700]
    died.close()  # died before its first log step: no writer, no purge written
    time.sleep(1.05)
    resumed = MetricsLogger(tmp_path)
    assert resumed.rewind("velocity", 500) == []
    for step in range(550, 801, 50):
        resumed.log("velocity", step, {"loss": 2.0 / step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb" / "velocity"))
    events.Reload()
    shown = [(e.step, round(e.value, 6)) for e in events.Scalars("velocity/loss")]
    assert shown == [(s, round(1.0 / s, 6)) for s in range(50, 501, 50)] + \
        [(s, round(2.0 / s, 6)) for s in range(550, 801, 50)], shown


def test_histograms_of_non_finite_gradients_do_not_end_the_run(tmp_path, capsys, monkeypatch):
    """hist_every on a float16 run: its first skipped step's gradients are Inf by design, and TensorBoard's
    histogram of them raised "The histogram is empty" out of the run (FAILED, a traceback). Finite values only."""
    from sinkflow.cli import main
    from sinkflow.runtime.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path / "unit")
    logger.histogram("velocity/grads/w", torch.tensor([float("inf"), float("nan")]), 1)  # nothing finite: skipped
    logger.histogram("velocity/grads/w", torch.tensor([1.0, float("inf"), 2.0]), 2)
    logger.close()
    assert list((tmp_path / "unit" / "tb" / "velocity").iterdir())
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY_2D, "train.velocity.precision=fp16", "train.velocity.hist_every=1", "--name", "h",
                 "--no-report"]) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "runs" / "h" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("skipped_steps") for r in rows), rows  # a step with Inf gradients was there to histogram


def test_a_run_without_an_importable_tensorboard_trains_and_says_so_once(tmp_path, monkeypatch, caplog):
    """A broken TensorBoard install (a protobuf clash) raised out of the first log step: the run FAILED with a
    traceback, and every resume and `sinkflow eval` the same. It warns once and logs to metrics.jsonl."""
    import logging

    from sinkflow.cli import main

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` of it raises ImportError
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="sinkflow"):
        assert main(["train", *TINY_2D, "--name", "t"]) == 0
    said = [r.getMessage() for r in caplog.records if "TensorBoard cannot be imported" in r.getMessage()]
    assert len(said) == 1 and "metrics go to metrics.jsonl only" in said[0], said
    rows = [json.loads(x) for x in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("phase") == "velocity" and "loss" in r] == [2, 4, 6]
    assert not (tmp_path / "runs" / "t" / "tb").exists()


def test_a_final_record_at_the_last_log_step_is_one_tensorboard_point(tmp_path):
    """A flow logs its drift report at its last log step and again as the phase's final record: TensorBoard showed
    two values at one step (steps 3, 6, 8, 8), which it cannot tell apart. metrics.jsonl keeps both records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sinkflow.runtime.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path)
    for step in (3, 6, 8):
        logger.log("flow", step, {"max_drift": 0.1 * step})
    logger.log("flow", 8, {"max_drift": 0.8, "fallen_back": 0, "final": True})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb" / "flow"))
    events.Reload()
    assert [e.step for e in events.Scalars("flow/max_drift")] == [3, 6, 8]
    assert [e.step for e in events.Scalars("flow/fallen_back")] == [8]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6, 8, 8] and rows[-1]["final"] is True


def test_each_evaluation_is_its_own_tensorboard_step(tmp_path, capsys, monkeypatch):
    """Every `sinkflow eval` logged at step 0: three evaluations (one with another sampler) were three values on one
    TensorBoard step. The k-th evaluation of a run is at step k."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY_2D, "--name", "e"]) == 0  # the report is the first evaluation
    for extra in ([], ["sample.time_warp=0.5"]):
        assert main(["eval", "runs/e", *extra]) == 0
    rows = [json.loads(x) for x in (tmp_path / "runs" / "e" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [1, 2, 3]
    events = EventAccumulator(str(tmp_path / "runs" / "e" / "tb" / "eval"))
    events.Reload()
    tag = next(t for t in events.Tags()["scalars"] if t.startswith("eval/w2"))
    assert [e.step for e in events.Scalars(tag)] == [1, 2, 3]


def test_a_validation_split_evaluation_is_not_a_point_on_the_test_curve(tmp_path):
    """`sinkflow eval RUN --split val` recorded its scores under the test scores' keys (``fd_cnn_3``), told apart in
    metrics.jsonl by ``split: val`` alone: TensorBoard, which drops strings, drew the validation score as the next
    point of eval/fd_cnn_3. Its scalars go to eval/val/<key>; metrics.jsonl keeps the record as it was."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sinkflow.runtime.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path)
    logger.log_evaluation({"fd_cnn_3": 20.0, "n": 8, "seeds": 1, "protocol": "qmc"})
    logger.log_evaluation({"fd_cnn_3": 30.0, "n": 8, "seeds": 1, "protocol": "qmc", "split": "val"})
    logger.log_evaluation({"fd_cnn_3": 21.0, "n": 8, "seeds": 1, "protocol": "qmc"})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb" / "eval"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/fd_cnn_3")] == [(1, 20.0), (3, 21.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/val/fd_cnn_3")] == [(2, 30.0)]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["fd_cnn_3"], r.get("split")) for r in rows] == [(1, 20.0, None), (2, 30.0, "val"),
                                                                        (3, 21.0, None)]


def test_records_rewound_after_a_rewind_killed_mid_write_stay_lines_of_their_own(tmp_path):
    """metrics.rewound.jsonl is appended to, like metrics.jsonl: a resume killed while it moved records there left a
    partial last line, and the next resume's first moved record was joined to it (lost to every reader)."""
    from sinkflow.runtime.metrics import MetricsLogger

    (tmp_path / "metrics.rewound.jsonl").write_text('{"phase": "velocity", "st')  # a kill -9 mid-append
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"phase": "velocity", "step": s}) + "\n"
                                                    for s in (2, 4, 6)))
    moved = MetricsLogger(tmp_path).rewind("velocity", 2)
    lines = (tmp_path / "metrics.rewound.jsonl").read_text().splitlines()
    assert [m["step"] for m in moved] == [4, 6] and lines[0] == '{"phase": "velocity", "st', lines
    assert [json.loads(x)["step"] for x in lines[1:]] == [4, 6], lines


def test_a_training_key_edited_by_hand_before_a_resume_is_recorded_in_meta_json(tmp_path, monkeypatch, caplog):
    """config.yaml edited by hand between a stop and its resume (train.velocity.lr 0.001 -> 0.002) trained the new
    rate from the step checkpoint on, and meta.json's changes said nothing: the run's record missed what it trained
    with. A step checkpoint holds its phase's train section; the resume compares, warns and records the edit. A
    resume's own override is recorded once (by the resume), and a later resume from a checkpoint older than that
    override does not call it an edit."""
    import logging
    import shutil

    from sinkflow import config
    from sinkflow.engine.experiment import train_run

    monkeypatch.chdir(tmp_path)
    cfg = config.resolve("moons", ["train.velocity.ckpt_every=3", "experiment.name=e"],
                         {"method": "fm", "train_iters": 6, "batch_size": 8, "device": "cpu"})
    train_run(cfg)
    run = tmp_path / "runs" / "e"

    def back_to_step_3():
        for name in ("final.pt", "step_00000006.pt"):
            (run / "checkpoints" / "velocity" / name).unlink(missing_ok=True)

    def changes():
        return [(c["key"], c["from"], c["to"], c["phase"], c["step"], c.get("note"))
                for c in json.loads((run / "meta.json").read_text()).get("changes", [])]

    back_to_step_3()
    shutil.copytree(run / "checkpoints" / "velocity", tmp_path / "at3")
    text = (run / "config.yaml").read_text()
    assert "    lr: 0.001\n" in text
    (run / "config.yaml").write_text(text.replace("    lr: 0.001\n", "    lr: 0.002\n", 1))
    with caplog.at_level(logging.WARNING, logger="sinkflow"):
        train_run(resume=run)
    assert changes() == [("train.velocity.lr", 0.001, 0.002, "velocity", 3, "edited in config.yaml")]
    assert "config.yaml was edited since the step-3 checkpoint of velocity: train.velocity.lr 0.001 -> 0.002" \
        in caplog.text
    back_to_step_3()
    train_run(resume=run, overrides=["train.velocity.lr=0.003"])  # an override: recorded by the resume, once
    assert changes()[1:] == [("train.velocity.lr", 0.002, 0.003, "velocity", 3, None)]
    shutil.rmtree(run / "checkpoints" / "velocity")
    shutil.copytree(tmp_path / "at3", run / "checkpoints" / "velocity")  # the step-3 checkpoint trained at 0.001
    train_run(resume=run)
    assert len(changes()) == 2  # 0.003 is the recorded value: no edit


def test_a_phase_resumed_at_its_last_step_logs_its_end_record_once(tmp_path, monkeypatch):
    """A final.pt deleted (the fix for a damaged one) with a step file at the last step: the phase resumes there and
    writes its end record again (the learning check's verdict, NSGF++'s t_mse, a flow's drift report, all at that
    step). The rewind moved only records past the step, so metrics.jsonl held two end records at step 6, and
    TensorBoard two points; the old one is set aside now, and each tag keeps one point a step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sinkflow import config
    from sinkflow.engine import learning
    from sinkflow.engine.experiment import train_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(learning, "MIN_STEPS", 4)  # the check judges this 6-step phase: an end record at step 6
    cfg = config.resolve("moons", ["experiment.name=r", "experiment.method=fm", "experiment.device=cpu",
                                   "train.velocity.iters=6", "train.velocity.ckpt_every=3",
                                   "train.velocity.log_every=3", "train.velocity.batch_size=16"])
    run = tmp_path / "runs" / "r"
    train_run(cfg).logger.close()
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    train_run(resume=run).logger.close()

    def ends(path):
        return [json.loads(x) for x in path.read_text().splitlines() if '"final": true' in x]

    assert [r["step"] for r in ends(run / "metrics.jsonl")] == [6]
    assert [r["step"] for r in ends(run / "metrics.rewound.jsonl")] == [6]
    events = EventAccumulator(str(run / "tb" / "velocity"))
    events.Reload()
    assert [e.step for e in events.Scalars("velocity/probe_loss_end")] == [6]
    assert [e.step for e in events.Scalars("velocity/loss")] == [3, 6]


def test_a_stop_requested_at_a_phases_last_unit_stops_the_run_as_a_signal_does(tmp_path, monkeypatch):
    """``trainer.request_stop()`` is the callbacks' SIGTERM. At a phase's last step (or the pool's last unit) the
    signal lets the phase end (final.pt) and stops the run before the next phase, or before the report; the request
    was dropped there instead, and the run went on into the next phase (hours of pool or training past a budget)."""
    import pytest

    from sinkflow import config
    from sinkflow.engine.experiment import train_run
    from sinkflow.runtime.callbacks import Callback
    from sinkflow.runtime.signals import Interrupted

    class StopAtTheEnd(Callback):
        def __init__(self, phase):
            self.phase = phase

        def on_train_batch_end(self, trainer, batch, outputs):
            if trainer.name == self.phase and trainer.progress == trainer.total:
                trainer.request_stop()

    monkeypatch.chdir(tmp_path)
    cfg = config.resolve("moons", ["experiment.name=s", *[a for a in TINY_2D if "=" in a], "train.velocity.iters=6",
                                   "experiment.device=cpu"])
    run = tmp_path / "runs" / "s"
    with pytest.raises(Interrupted) as e:
        train_run(cfg, callbacks=[StopAtTheEnd("pool")])
    assert e.value.phase == "pool" and (run / "checkpoints" / "pool" / "final.pt").exists()
    assert not (run / "checkpoints" / "velocity").exists()  # the next phase never started
    reports = []
    with pytest.raises(Interrupted) as e:
        train_run(resume=run, callbacks=[StopAtTheEnd("velocity")], then=reports.append)
    assert (e.value.phase, e.value.step) == ("velocity", 6) and reports == []  # the report skipped, as on SIGTERM
    assert (run / "checkpoints" / "velocity" / "final.pt").exists()
