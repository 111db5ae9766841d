"""`sinkflow status` on a live, a finished and a dead run; a non-finite loss keeps the last checkpoint intact."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import TINY_2D, cli, snapshot
from sinkflow.tools.status import format_status, read_status
from sinkflow.runtime.lock import run_lock

LONG = ["moons", "pool.batches=2", "pool.steps=4", "pool.batch_size=32", "--train-iters", "100000",
        "train.velocity.log_every=5", "train.velocity.ckpt_every=50", "--device", "cpu", "--no-report"]


def start(cwd, name):
    env = {**os.environ, "SINKFLOW_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "sinkflow", "train", *LONG, "--name", name], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(pred, proc, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def test_status_live_then_dead(runs_dir):
    proc = start(runs_dir.parent, "live")
    run = runs_dir / "live"
    try:
        assert wait_for(lambda: (run / "checkpoints/velocity").is_dir() and
                        any((run / "checkpoints/velocity").glob("step_*.pt")), proc), proc.stderr.read()
        st = read_status(run)
        assert st["state"] == "running" and st["pid_alive"]
        assert st["heartbeat"]["phase"] == "velocity" and st["heartbeat"]["total"] == 100000
        assert st["eta_s"] > 0 and st["latest_metrics"]["velocity"]["loss"] > 0
        out = cli("status", str(run), cwd=runs_dir.parent)
        assert out.returncode == 0 and "RUNNING" in out.stdout and "ETA" in out.stdout, out.stdout
        assert "step_" in out.stdout and "disk" in out.stdout
        # the same heartbeat seen 10 minutes later is stale
        assert read_status(run, now=time.time() + 600)["state"] == "stale"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    st = read_status(run)
    assert st["state"] == "dead" and st["pid_alive"] is False
    out = cli("status", str(run), cwd=runs_dir.parent)
    assert out.returncode == 1 and "DEAD" in out.stdout and "--resume" in out.stdout


def test_a_killed_run_whose_pid_was_reused_is_dead_not_running(tiny_run, tmp_path, capsys):
    """kill -9 leaves the heartbeat "running" with the killed pid; once the kernel gives that pid to another process
    (any process: here this one), status said RUNNING with exit 0 for as long as the heartbeat was young, and a user
    waited on a run nobody trains. The run's lock died with its writer: an unheld lock is a dead run."""
    import shutil
    import socket

    from sinkflow.cli import main

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    (run / "status.json").write_text(json.dumps({"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                                                 "phase": "velocity", "step": 3, "total": 6, "state": "running"}))
    st = read_status(run)
    assert (st["state"], st["pid_alive"]) == ("dead", False)
    assert main(["status", str(run)]) == 1
    assert f"DEAD (pid {os.getpid()} is another process now; resume with" in capsys.readouterr().out
    with run_lock(run):  # the pid's process holds the lock: the run is alive
        assert (read_status(run)["state"], read_status(run)["pid_alive"]) == ("running", True)
    # a copy (cp -r) of a live run: its heartbeat names the folder its pid writes, which is not this one
    beat = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**beat, "dir": str(tiny_run.resolve())}))
    assert main(["status", str(run)]) == 1
    assert f"DEAD (pid {os.getpid()} trains {tiny_run.resolve()}, the run this folder was copied from; resume with" \
        in capsys.readouterr().out
    # ... made on another machine (a notebook's output downloaded mid-training): its pid cannot be seen from here, and
    # status said RUNNING for 5 minutes, then STALE ("hung"); nothing here trains the copy
    (run / "status.json").write_text(json.dumps({**beat, "host": "kaggle-node", "pid": 4242, "dir": "/kaggle/runs/r"}))
    assert main(["status", str(run)]) == 1
    assert "DEAD (pid 4242 on kaggle-node trained /kaggle/runs/r there, the run this folder was copied from (whether " \
        "it still does, this machine cannot see); nothing trains this copy; resume with" in capsys.readouterr().out
    with run_lock(run):  # a process here has just begun training the copy (its heartbeat not yet rewritten)
        assert read_status(run)["state"] == "running"
    # a run on a shared filesystem seen from another node (the same folder): its heartbeat is trusted as before
    (run / "status.json").write_text(json.dumps({**beat, "host": "node-1", "pid": 4242, "dir": str(run.resolve())}))
    assert read_status(run)["state"] == "running"


def test_status_finished(tiny_run, runs_dir):
    shutil.copytree(tiny_run, runs_dir / "done")  # a finished `train moons TINY_2D --no-report`
    out = cli("status", str(runs_dir / "done"), "--json", cwd=runs_dir.parent)
    st = json.loads(out.stdout)
    assert out.returncode == 0 and st["state"] == "finished"
    assert [name for name, *_ in st["checkpoints"]["velocity"]] == ["final.pt", "step_00000003.pt", "step_00000006.pt"]
    assert st["disk"]["total"] >= st["disk"]["checkpoints"] > 0
    # it reads the folder without torch (a login node, a busy box: 0.4 s, not 4)
    code = "import sys\nfrom sinkflow.cli import main\nprint(main(['status', sys.argv[1]]), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, str(runs_dir / "done")], capture_output=True, text=True)
    assert out.stdout.split()[-2:] == ["0", "False"] and "FINISHED" in out.stdout, out.stdout + out.stderr
    # a finished run whose final checkpoint was cut short: FINISHED with exit 0, and `sample` refused it
    final = runs_dir / "done" / "checkpoints" / "velocity" / "final.pt"
    whole = final.read_bytes()
    final.write_bytes(whole[: len(whole) // 2])
    out = cli("status", str(runs_dir / "done"), cwd=runs_dir.parent)
    assert out.returncode == 1 and "INCOMPLETE (status.json says finished, but checkpoints/velocity/final.pt is " \
        "damaged (not a whole checkpoint): delete it, then `sinkflow train --resume" in out.stdout, out.stdout
    # ... or deleted: the same
    final.unlink()
    out = cli("status", str(runs_dir / "done"), cwd=runs_dir.parent)
    assert out.returncode == 1 and "INCOMPLETE (status.json says finished, but checkpoints/velocity/final.pt is " \
        "missing: `sinkflow train --resume" in out.stdout, out.stdout
    # a copy whose config.yaml was cut short: every command refuses the run, and status says why
    config = runs_dir / "done" / "config.yaml"
    config.write_text(config.read_text()[:300])
    out = cli("status", str(runs_dir / "done"), cwd=runs_dir.parent)
    assert out.returncode == 1 and "DAMAGED (config.yaml is cut short" in out.stdout, out.stdout


def test_status_not_a_run(tmp_path):
    out = cli("status", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "not a sinkflow run folder" in out.stderr


@pytest.mark.parametrize("damage", ["missing", "{oops", "null", "[]", '{"pid": "x", "time": 1}', '{"time": "x"}'])
def test_a_run_whose_status_json_is_lost_is_unknown_with_the_resume_command(tiny_run, tmp_path, capsys, damage):
    """A run halfway through whose status.json was deleted or damaged said NOT STARTED, with no resume command."""
    import shutil

    from sinkflow.cli import main

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    (run / "status.json").unlink() if damage == "missing" else (run / "status.json").write_text(damage)
    assert read_status(run)["state"] == "unknown"
    assert main(["status", str(run)]) == 1
    out = capsys.readouterr().out
    assert "UNKNOWN (status.json is missing or damaged" in out and f"sinkflow train --resume {run}" in out, out
    fresh = tmp_path / "fresh"  # a folder with only config.yaml: a run not started yet
    fresh.mkdir()
    shutil.copy(run / "config.yaml", fresh / "config.yaml")
    assert read_status(fresh)["state"] == "not started"


def test_status_says_evaluating_during_the_final_report_and_whether_it_was_written(tiny_run, tmp_path, capsys,
                                                                                   monkeypatch):
    """status said FINISHED (exit 0) while the final report still ran for minutes, and still FINISHED after that
    process was killed, with no word that samples.png and the scores were never written: a user shut the GPU
    machine down on it. Now EVALUATING while the report runs; once its process is gone without finishing it,
    FINISHED with the report named as not written."""
    import shutil

    from sinkflow.cli import main
    from sinkflow.cli.train import ReportStopped, report
    from sinkflow.eval import report as report_mod
    from sinkflow.runtime.lock import lock_run, unlock_run
    from sinkflow.runtime.run_folder import RunFolder

    run_dir = tmp_path / "r"
    shutil.copytree(tiny_run, run_dir)
    seen = []
    monkeypatch.setattr(report_mod, "final_report", lambda run: seen.append(read_status(run.dir)) or "scores")
    run = RunFolder.open(run_dir)
    lock_run(run_dir)  # as `sinkflow train` holds it while its report runs
    report(run)
    assert seen[0]["state"] == "evaluating" and seen[0]["phases_left"] == []
    assert "EVALUATING (training finished; pid" in format_status(seen[0])
    assert main(["status", str(run_dir)]) == 0
    st = read_status(run_dir)
    assert (st["state"], st.get("report")) == ("finished", None)
    run.logger.heartbeat(phase="report", state="evaluating")  # then killed (-9) during the report
    unlock_run(run_dir)
    json_path = run_dir / "status.json"
    json_path.write_text(json_path.read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999'))
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "FINISHED (the final report was not written: the process stopped during it; `sinkflow eval" in out, out

    def stopped(run):
        raise ReportStopped
    monkeypatch.setattr(report_mod, "final_report", stopped)  # a SIGTERM during the report
    with pytest.raises(SystemExit):
        report(run)
    run.logger.close()
    assert (read_status(run_dir)["state"], read_status(run_dir)["report"]) == ("finished", "not written")


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(runs_dir, monkeypatch):
    """The loss turns NaN at step 5: the run stops naming phase and step; step 4's checkpoint is untouched."""
    from sinkflow import config, methods
    from sinkflow.errors import SinkflowError
    from sinkflow.methods import flow_matching
    from sinkflow.engine.experiment import run_phases
    from sinkflow.runtime.run_folder import RunFolder

    calls = {"n": 0}
    real_loss = flow_matching.velocity_loss

    def poisoned(model, batch):
        calls["n"] += 1
        loss = real_loss(model, batch)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(flow_matching, "velocity_loss", poisoned)
    cfg = config.resolve("moons", ["train.velocity.ckpt_every=2", "train.velocity.log_every=1", "checkpoint.keep=5"],
                         {"method": "fm", "train_iters": 10, "batch_size": 32, "device": "cpu", "name": "nan"})
    run = RunFolder.create(cfg)
    source, target = methods.distributions(cfg)
    phases = methods.get("fm").phases(cfg, source, target)
    ck = run.checkpoints("velocity")
    before = {}

    original_save = ck.__class__.save

    def spy(self, state, step):  # remember what the checkpoint held when written
        path = original_save(self, state, step)
        before[step] = {k: v.clone() for k, v in state["model"].items()}
        return path

    monkeypatch.setattr(ck.__class__, "save", spy)
    with pytest.raises(SinkflowError) as err:
        run_phases(run, phases)
    assert "phase 'velocity' at step 5" in str(err.value) and "last good checkpoint" in str(err.value)
    files = snapshot(ck.folder)
    assert sorted(files) == ["step_00000002.pt", "step_00000004.pt"]  # no final.pt, nothing after the NaN
    state = ck.latest()
    assert state["step"] == 4
    for k, v in state["model"].items():
        assert torch.equal(v, before[4][k]) and torch.isfinite(v).all(), k
    assert snapshot(ck.folder) == files



def test_a_run_that_stopped_on_an_error_is_failed_with_the_error_not_dead(tmp_path):
    """FM at lr 50 stops on a diverging loss; status said DEAD with only a resume hint (which fails the same way):
    it says FAILED, where, and the error with its fix, and exits 1."""
    r = cli("train", "moons", "--method", "fm", "--lr", "50", "--train-iters", "300", "--batch-size", "32",
            "train.velocity.log_every=1", "--device", "cpu", "--name", "div", "--no-report", cwd=tmp_path)
    error = next(x for x in r.stderr.splitlines() if x.startswith("sinkflow: error: "))[len("sinkflow: error: "):]
    assert r.returncode == 2 and "velocity" in error and "lower train.velocity.lr" in error, r.stderr
    status = cli("status", str(tmp_path / "runs/div"), cwd=tmp_path)
    assert status.returncode == 1, status.stdout
    line = next(x for x in status.stdout.splitlines() if x.startswith("state"))
    assert line.startswith("state        FAILED (stopped at velocity step") and error in line, line
    # no checkpoint was written before it: the line said "the checkpoints before it are intact"
    assert "the phase had no checkpoint yet: it starts again" in line, line
    assert "DEAD" not in status.stdout


def test_a_keyboard_interrupt_raised_in_the_loop_is_stopped_not_dead(runs_dir):
    """A notebook's KeyboardInterrupt raised inside the loop (a callback's, a SIGALRM handler's; Jupyter's button
    sends SIGINT, which stops at a step with a checkpoint) left the heartbeat "running" with the kernel's live pid:
    status said DEAD, "pid ... is another process now". It says STOPPED at once, and where to resume from."""
    from sinkflow import config
    from sinkflow.engine.experiment import train_run
    from sinkflow.runtime.callbacks import Callback

    class Stop(Callback):
        def on_train_batch_end(self, trainer, batch, outputs):
            if trainer.step == 3:
                raise KeyboardInterrupt

    cfg = config.resolve("moons", ["experiment.method=otcfm", "experiment.name=kbi", "experiment.device=cpu"],
                         {"train_iters": 6})
    with pytest.raises(KeyboardInterrupt):
        train_run(cfg, callbacks=[Stop()])
    text = format_status(read_status(runs_dir / "kbi"))
    line = next(x for x in text.splitlines() if x.startswith("state"))
    assert line.startswith("state        STOPPED (at once by a KeyboardInterrupt in velocity: the work since its "
                           "last checkpoint is lost; resume from that checkpoint with `sinkflow train --resume"), text


def test_a_non_finite_step_fails_at_its_own_step(tmp_path):
    """The non-finite flag is read at log steps: status said "stopped at velocity step 10: ... at step 2"."""
    r = cli("train", *TINY_2D, "--lr", "1e4", "--train-iters", "300", "train.velocity.log_every=10", "--name", "nf",
            "--no-report", cwd=tmp_path)
    error = next(x for x in r.stderr.splitlines() if x.startswith("sinkflow: error: "))
    step = int(error.split(" at step ")[1].split(";")[0])
    assert r.returncode == 2 and "non-finite" in error and step % 10, error  # found at a later log step
    line = next(x for x in cli("status", "runs/nf", cwd=tmp_path).stdout.splitlines() if x.startswith("state"))
    assert line.startswith(f"state        FAILED (stopped at velocity step {step}: non-finite"), line

def test_console_log_lines_go_above_an_open_progress_bar(monkeypatch):
    """Where the CLI logs to the console, records go through tqdm (above the bar, not into its line); where a
    host captures records itself (this test runner), its handlers are left alone."""
    import logging
    import sys

    from sinkflow.cli import bars_above_logs

    before = list(logging.root.handlers)
    with bars_above_logs():
        assert logging.root.handlers == before  # pytest's capture: nothing added
    console = logging.StreamHandler(sys.stderr)
    monkeypatch.setattr(logging.root, "handlers", [*before, console])
    with bars_above_logs():
        names = [type(h).__name__ for h in logging.root.handlers]
        assert console not in logging.root.handlers and "_TqdmLoggingHandler" in names
    assert console in logging.root.handlers


def test_status_lists_the_phases_still_to_come_with_their_time_at_this_rate(tmp_path):
    """An NSGF++ run in its velocity phase (pool done): nsf (the same UNet, trained the same way) gets a time at the
    velocity phase's rate, the time predictor (another network) only its steps; a finished phase is not listed."""
    import socket

    import yaml

    from sinkflow import config
    from sinkflow.tools.status import format_status

    cfg = config.resolve("mnist", ["experiment.method=nsgfpp", "train.velocity.iters=1000",
                                   "train.nsf.iters=3000", "train.time.iters=500"])
    run = tmp_path / "run"
    (run / "checkpoints" / "pool").mkdir(parents=True)
    (run / "checkpoints" / "pool" / "final.pt").write_bytes(b"x")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "status.json").write_text(json.dumps({"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                                                 "phase": "velocity", "step": 400, "total": 1000, "rate": 150.0,
                                                 "eta_s": 4.0, "state": "running"}))
    st = read_status(run)
    assert st["phases_left"] == [{"phase": "nsf", "steps": 3000, "eta_s": 20.0}, {"phase": "time", "steps": 500}]
    assert "then         nsf 3,000 steps (~20s at velocity's rate), time 500 steps" in format_status(st)
    # a smaller nsf network is another network: its steps only, no time at the velocity phase's rate
    cfg["model"]["nsf"]["channels"] = 16
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert read_status(run)["phases_left"][0] == {"phase": "nsf", "steps": 3000}
    # before the pool is built, every phase is still to come
    (run / "checkpoints" / "pool" / "final.pt").unlink()
    (run / "status.json").write_text(json.dumps({"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                                                 "phase": "pool", "step": 3, "total": 10, "state": "running"}))
    assert [p["phase"] for p in read_status(run)["phases_left"]] == ["velocity", "nsf", "time"]


def test_status_shows_each_metrics_newest_value_of_a_phase(tmp_path):
    """A finished flow's last record is its drift report: status printed "fallen_back 0, ..." and never the loss
    (bits/dim); an eval's test bits/dim was hidden by the sample scores recorded after it."""
    from sinkflow.tools.status import format_status

    rows = [{"phase": "flow", "step": 39, "loss": 2.61, "lr": 1e-3}, {"phase": "flow", "step": 40, "loss": 2.6},
            {"phase": "flow", "step": 40, "fallen_back": 0, "final": True},
            {"phase": "eval", "step": 40, "test_bpd": 2.55}, {"phase": "eval", "step": 40, "w2": 3.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from sinkflow import config

    (tmp_path / "config.yaml").write_text(config.dump(config.resolve("flow-digits", [])))
    text = format_status(read_status(tmp_path))
    assert "flow step 40: loss 2.6, lr 0.001, fallen_back 0, final True" in text, text
    assert "eval step 40: test_bpd 2.55, w2 3.2" in text, text


def test_status_labels_an_evaluations_scores_with_its_own_settings(tmp_path):
    """Each key's newest value: a validation evaluation's `split: val` (or its `sample.*`) stayed in the view after
    a plain test evaluation replaced its scores, labelling test scores as validation ones."""
    from sinkflow import config

    rows = [{"phase": "eval", "step": 0, "fd_cnn_6": 40.0, "n": 8, "seeds": 1, "split": "val",
             "sample": {"t_shift": -0.1}},
            {"phase": "eval", "step": 0, "fd_cnn_6": 35.0, "n": 8, "seeds": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(config.dump(config.resolve("digits", [])))
    shown = read_status(tmp_path)["latest_metrics"]["eval"]
    assert shown["fd_cnn_6"] == 35.0 and "split" not in shown and "sample" not in shown
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
    shown = read_status(tmp_path)["latest_metrics"]["eval"]
    assert shown["fd_cnn_6"] == 40.0 and shown["split"] == "val" and shown["sample"] == {"t_shift": -0.1}


def test_counts_are_logged_as_counts(tmp_path):
    """Every number went through float(): an eval record's n and seeds read 64.0 and 3.0."""
    import numpy as np

    from sinkflow.runtime.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path)
    logger.log("eval", 0, {"n": 64, "seeds": np.int64(3), "w2": np.float32(1.5), "final": True, "note": "x"})
    logger.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (record["n"], record["seeds"], record["w2"], record["final"], record["note"]) == (64, 3, 1.5, True, "x")
    assert type(record["n"]) is int and type(record["seeds"]) is int


@pytest.mark.parametrize("value", ["-5", "0", "nan"])
def test_stale_after_must_be_a_positive_number_of_seconds(tmp_path, value):
    out = cli("status", str(tmp_path), "--stale-after", value, cwd=tmp_path)
    assert out.returncode == 2 and "--stale-after" in out.stderr and "must be a positive number" in out.stderr, out.stderr


def test_resume_commands_are_quoted_for_the_shell(tmp_path):
    """`--name "x z"`: the resume printed was `sinkflow train --resume runs/x z`, two arguments to a shell."""
    from sinkflow.runtime.lock import finish_fix
    from sinkflow.runtime.relaunch import resume_command

    assert resume_command(tmp_path / "x z") == f"sinkflow train --resume '{tmp_path / 'x z'}'"
    assert resume_command(tmp_path / "plain") == f"sinkflow train --resume {tmp_path / 'plain'}"
    assert finish_fix(tmp_path / "x z").endswith(f"`sinkflow train --resume '{tmp_path / 'x z'}'`")


@pytest.mark.parametrize("mode", ["1", "bar"])
def test_progress_in_a_log_file_is_whole_lines(tmp_path, mode):
    """A tqdm bar written to a file (nohup, SLURM, Kaggle's saved run) is one line of \\r redraws that `tail -f` and
    line-based log viewers show nothing of until the phase ends. Where stderr is not a terminal, progress is a plain
    line every SINKFLOW_PROGRESS_EVERY seconds (0 here: every unit) and one at the end of each phase; `bar` forces
    the bar."""
    env = {**os.environ, "SINKFLOW_PROGRESS": mode, "SINKFLOW_PROGRESS_EVERY": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "sinkflow", "train", *TINY_2D, "--name", "p", "--no-report"],
                         cwd=tmp_path, capture_output=True, env=env, timeout=300)  # bytes: a \r stays a \r
    err = out.stderr.decode()
    assert out.returncode == 0, err[-3000:]
    if mode == "bar":
        assert "\r" in err and "velocity: 100%" in err
        return
    assert "\r" not in err, err[-2000:]
    pool = [line for line in err.splitlines() if line.startswith("pool: ") and " batches (" in line]
    steps = [line for line in err.splitlines() if line.startswith("velocity: ") and " steps (" in line]
    assert pool[-1].startswith("pool: 2/2 batches (100.0%)"), err
    assert [s.split()[1] for s in steps] == [f"{i}/6" for i in range(1, 7)], steps
    assert "steps/s" in steps[-1] and "ETA 00:00" in steps[-1] and ", loss " in steps[-1], steps[-1]


@pytest.mark.parametrize("mode", ["lines", "bar", "0"])
def test_a_tools_loop_says_its_progress_as_a_phase_does(tmp_path, capsys, monkeypatch, mode):
    """`sinkflow sample --out folder/` (and tune) drew tqdm's bar whatever the console: in a log file one line of
    carriage-return redraws until the loop ended. ``progress`` follows SINKFLOW_PROGRESS as a phase's bar does: whole
    lines with counts, rate and ETA in a log file, the bar in place, nothing at 0; the items pass through unchanged."""
    import torch

    from sinkflow.eval.images import save_image_folder

    monkeypatch.setenv("SINKFLOW_PROGRESS", mode)
    monkeypatch.setenv("SINKFLOW_PROGRESS_EVERY", "0")
    folder = save_image_folder(torch.zeros(1000, 1, 2, 2), tmp_path / "png")
    err = capsys.readouterr().err
    assert len(list(folder.iterdir())) == 1000
    if mode == "0":
        assert err == "", err
        return
    if mode == "bar":
        assert "\r" in err and "1000/1000" in err, err[-500:]
        return
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 1000, err[-500:]
    assert lines[0].startswith("png: 1/1,000 images (0.1%), ") and "images/s" in lines[0], lines[0]
    assert lines[-1].startswith("png: 1,000/1,000 images (100.0%), ") and "ETA 00:00" in lines[-1], lines[-1]


def test_status_counts_what_the_bar_counts_and_a_resume_stands_at_its_step(tiny_run, runs_dir, monkeypatch):
    """The pool's heartbeat counted chunks as "step 4/12" with no rate or ETA, while its bar counted 32/96 batches;
    a resumed phase said "step 0" (DEAD at step 0 after a kill then) until its first log step."""
    import shutil

    from sinkflow.runtime.callbacks import Callback

    monkeypatch.chdir(runs_dir.parent)
    run = runs_dir / "done"
    shutil.copytree(tiny_run, run)  # a finished `train moons TINY_2D --no-report`
    beat = {"time": time.time(), "pid": os.getpid(), "phase": "pool", "step": 4, "total": 12, "state": "running",
            "done": 32, "of": 96, "unit": "batches", "rate": 16.0, "eta_s": 4.0}
    (run / "status.json").write_text(json.dumps(beat))
    with run_lock(run):  # the heartbeat's process (this one) trains the run
        shown = format_status(read_status(run))
    assert "pool  batches 32/96 (33.3%)  16.00 batches/s  ETA" in shown, shown

    class SeeHeartbeat(Callback):
        def on_phase_start(self, trainer):
            seen.append(json.loads((trainer.run.dir / "status.json").read_text()))

    seen = []
    resumed = runs_dir / "resumed"
    shutil.copytree(run, resumed)
    (resumed / "checkpoints" / "velocity" / "final.pt").unlink()
    (resumed / "checkpoints" / "velocity" / "step_00000006.pt").unlink()
    from sinkflow.engine.experiment import train_run

    train_run(resume=resumed, callbacks=[SeeHeartbeat()])
    assert (seen[0]["phase"], seen[0]["step"], seen[0]["total"], seen[0]["state"]) == ("velocity", 3, 6, "running")


def test_status_json_is_strict_json(tiny_run, runs_dir):
    """A skipped fp16 step logs grad_norm Infinity: `status --json` printed it as `Infinity`, which is not JSON (a
    strict parser, JavaScript's, refused the whole status). Non-finite values are null there."""
    run = runs_dir / "inf"
    shutil.copytree(tiny_run, run)  # a finished `train moons TINY_2D --no-report`
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "phase": "velocity", "step": 7, "loss": 0.5,
                            "grad_norm": float("inf"), "lr": float("nan")}) + "\n")
    out = cli("status", str(run), "--json", cwd=runs_dir.parent).stdout

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    st = json.loads(out, parse_constant=refuse)
    assert st["latest_metrics"]["velocity"]["grad_norm"] is None and st["latest_metrics"]["velocity"]["loss"] == 0.5


def test_a_pool_killed_mid_build_is_counted_in_batches_not_chunks_at_a_batch_rate(tiny_run, tmp_path):
    """kill -9 during the pool's build: its last heartbeat (batches 50/60 at 5.84 batches/s while it ran) was shown as
    "pool  step 5/6 (83.3%)  5.84 steps/s" once the run was DEAD or STALE: the chunk count beside the batch rate,
    labelled steps. Every state counts the pool in the batches its heartbeat recorded, the rate in batches/s."""
    import shutil
    import socket

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    beat = {"pid": 2 ** 22 + 1, "host": socket.gethostname(), "phase": "pool", "step": 5, "total": 6,
            "state": "running", "done": 50, "of": 60, "unit": "batches", "rate": 5.84, "eta_s": 1.7}
    for age, state in ((1.0, "dead"), (10_000.0, "dead")):
        (run / "status.json").write_text(json.dumps({**beat, "time": time.time() - age}))
        st = read_status(run)
        assert st["state"] == state
        shown = format_status(st)
        assert "pool  batches 50/60 (83.3%)  5.84 batches/s" in shown, shown
        assert "steps/s" not in shown.split("phase        ")[1].splitlines()[0], shown
    (run / "status.json").write_text(json.dumps({**beat, "host": "elsewhere", "time": time.time() - 10_000}))
    st = read_status(run)  # another host's heartbeat, long silent
    assert st["state"] == "stale"
    assert "pool  batches 50/60 (83.3%)  5.84 batches/s" in format_status(st), format_status(st)


def test_a_killed_phase_says_the_step_its_resume_goes_on_from_beside_the_heartbeats(tiny_run, tmp_path):
    """kill -9 at velocity step 5 of a run checkpointed at step 3: status said DEAD and "velocity  step 5/6", the
    last heartbeat's step, while the resume went on from step 3 (a phase killed before its first checkpoint: from
    step 0). The line names the newest checkpoint's step, and the heartbeat's as its own; --json has both."""
    import shutil
    import socket

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    for name in ("final.pt", "step_00000006.pt"):
        (run / "checkpoints" / "velocity" / name).unlink()
    beat = {"pid": 2 ** 22 + 1, "host": socket.gethostname(), "phase": "velocity", "step": 5, "total": 6,
            "state": "running", "time": time.time()}
    (run / "status.json").write_text(json.dumps(beat))
    st = read_status(run)
    assert st["state"] == "dead" and st["resumes_from"] == {"phase": "velocity", "step": 3, "heartbeat_step": 5}
    line = next(x for x in format_status(st).splitlines() if x.startswith("state"))
    assert line.endswith(f"{run}`, which goes on from velocity step 3, its newest checkpoint; step 5 below is "
                         "the last heartbeat's)"), line
    (run / "checkpoints" / "velocity" / "step_00000003.pt").unlink()
    line = next(x for x in format_status(read_status(run)).splitlines() if x.startswith("state"))
    assert line.endswith(", which trains velocity from step 0 (it had no step checkpoint yet))"), line
    (run / "status.json").write_text(json.dumps({**beat, "phase": "pool", "done": 1, "of": 2, "unit": "batches"}))
    assert read_status(run)["resumes_from"] is None  # the pool's heartbeat counts its recorded batches: kept


def test_a_run_restored_where_another_machines_session_left_it_is_stale_with_the_resume_command(tiny_run, tmp_path):
    """A Kaggle session killed at its limit mid-phase, its run copied back to the same path in the next session
    (audit YY): the heartbeat is the old container's, for this very folder, hours old. Status said STALE ("hung, or
    one step ... takes longer") with no resume command; it now gives the command for a run nothing trains any more.
    A heartbeat of this host (its pid alive, silent) is hung: no resume is suggested beside a live process."""
    import shutil
    import socket

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    beat = {"pid": 77, "host": "kaggle-0a1b2c", "dir": str(run.resolve()), "phase": "velocity", "step": 3,
            "total": 6, "state": "running", "world": 1, "no_report": True, "time_limit": None,
            "time": time.time() - 3 * 3600}
    (run / "status.json").write_text(json.dumps(beat))
    st = read_status(run)
    line = next(x for x in format_status(st).splitlines() if x.startswith("state"))
    assert st["state"] == "stale" and "a session that ended on kaggle-0a1b2c" in line, line
    assert f"resume with `sinkflow train --resume {run} --no-report`" in line, line
    (run / "status.json").write_text(json.dumps({**beat, "host": socket.gethostname(), "pid": os.getpid()}))
    from sinkflow.runtime.lock import run_lock

    with run_lock(run):  # this process holds the run, silent for 3 hours: hung
        line = next(x for x in format_status(read_status(run)).splitlines() if x.startswith("state"))
    assert line.startswith("state        STALE") and "resume" not in line, line
    # a heartbeat without a host (written before hosts were) is this host's, as read_status takes it: its live pid
    # is hung there, and the line suggested a resume beside it
    (run / "status.json").write_text(json.dumps({k: v for k, v in beat.items() if k != "host"} | {"pid": os.getpid()}))
    with run_lock(run):
        line = next(x for x in format_status(read_status(run)).splitlines() if x.startswith("state"))
    assert line.startswith("state        STALE") and "resume" not in line, line


def test_a_pool_build_that_failed_keeps_its_finished_chunks_and_says_so(tiny_run, tmp_path):
    """A torchrun pool build whose rank 1 was killed -9 after 8 of 75 chunks (audit YY): status said FAILED "... the
    phase had no checkpoint yet: it starts again", but the pool keeps its chunks in pool/progress.json, not in a step
    checkpoint, and the resume went on from chunk 8. It names the chunks kept; a pool with none still starts again."""
    import shutil
    import socket

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    shutil.rmtree(run / "checkpoints")
    beat = {"pid": 2 ** 22 + 1, "host": socket.gethostname(), "phase": "pool", "step": 8, "total": 75,
            "state": "failed", "done": 32, "of": 300, "error": "another process of this torchrun job stopped",
            "time": time.time()}
    (run / "status.json").write_text(json.dumps(beat))
    (run / "pool").mkdir(exist_ok=True)
    (run / "pool" / "progress.json").write_text(json.dumps({"chunks": list(range(8))}))
    line = next(x for x in format_status(read_status(run)).splitlines() if x.startswith("state"))
    assert "the pool's 8 finished chunk(s) are kept (pool/progress.json)" in line and "starts again" not in line, line
    (run / "pool" / "progress.json").unlink()
    line = next(x for x in format_status(read_status(run)).splitlines() if x.startswith("state"))
    assert "the phase had no checkpoint yet: it starts again" in line, line


@pytest.mark.parametrize("edit, needle", [("lr: fast", "config key 'train.velocity.lr' expects float"),
                                          ("lrr: 0.5", "has unknown key 'train.velocity.lrr'")])
def test_a_hand_edit_every_command_refuses_is_not_finished(tiny_run, tmp_path, capsys, edit, needle):
    """A finished run whose config.yaml was edited by hand into one that --resume, sample and eval refuse (a bad
    value, an unknown key) said FINISHED with exit status 0, so `sinkflow status RUN && sinkflow eval RUN` failed
    on the second; only a copy cut short was seen. It is DAMAGED, with the refusal's own line (problem and fix)."""
    import re
    import shutil

    from sinkflow.cli import main

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    assert read_status(run)["state"] == "finished"
    path = run / "config.yaml"
    path.write_text(re.sub(r"(\n  velocity:\n(?:    .*\n)*?)    lr: [^\n]+\n", rf"\1    {edit}\n", path.read_text(),
                           count=1))
    assert edit in path.read_text()
    capsys.readouterr()
    assert main(["status", str(run)]) == 1
    out = capsys.readouterr().out
    assert "state        DAMAGED (--resume, sample and eval refuse the run's config.yaml: " in out, out
    assert needle in out and "edit that file" in out, out
    assert main(["eval", str(run)]) == 2 and needle in capsys.readouterr().err  # what status now foretells


def test_a_torchrun_job_killed_as_a_phase_starts_or_failed_resumes_as_launched(runs_dir, monkeypatch):
    """Only a stop's heartbeat held the launch: a 3-process torchrun job killed while a phase set up (rank 0 computing
    NSGF++'s states past torchrun's 30 s grace; the heartbeat said "starting"), or failed on a lost rank, was told by
    status to resume with a plain `sinkflow train --resume` (one process, no time limit). Every heartbeat holds it now
    (the processes are simulated: the run trains alone)."""
    from types import SimpleNamespace

    from sinkflow import config
    from sinkflow.engine import experiment
    from sinkflow.engine.experiment import train_run
    from sinkflow.runtime.callbacks import Callback
    from sinkflow.runtime.relaunch import read_heartbeat, resume_for

    three = SimpleNamespace(rank=0, world=3, is_main=True, enabled=False)  # the launch's numbers, no collective
    monkeypatch.setattr(experiment, "dist", SimpleNamespace(**{**vars(experiment.dist), "current": lambda: three,
                                                                "per_node": lambda: 3}))
    starting = {}

    class Lost(Callback):
        def on_setup(self, trainer):
            starting.update(read_heartbeat(trainer.run.dir))

        def on_train_batch_end(self, trainer, batch, outputs):
            if trainer.step == 2:
                monkeypatch.setenv("WORLD_SIZE", "3")  # the job's: gloo's text is a lost peer's only under torchrun
                raise RuntimeError("[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:29500")

    cfg = config.resolve("moons", ["experiment.method=fm", "experiment.name=lost", "experiment.device=cpu"],
                         {"train_iters": 6})
    with pytest.raises(RuntimeError):
        train_run(cfg, callbacks=[Lost()], time_limit=3600)
    run = runs_dir / "lost"
    launched = f"torchrun --nproc_per_node 3 -m sinkflow train --resume {run} --no-report --time-limit 1h"
    assert starting["state"] == "starting" and resume_for(run, starting) == launched, starting
    line = next(x for x in format_status(read_status(run)).splitlines() if x.startswith("state"))
    assert line.startswith("state        FAILED") and f"then `{launched}` continues" in line, line
    # the lost peer in the CLI's words, not gloo's raw text (status said "...pair.cc:561] Connection closed by peer")
    assert "another process of this torchrun job stopped or stopped answering (its own output says why)" in line
    assert "Connection closed" not in line, line
    phase = next(x for x in format_status(read_status(run)).splitlines() if x.startswith("phase"))
    assert phase.split() == ["phase", "velocity", "step", "2/6", "(33.3%)"], phase  # was "step 2": no total


def test_a_phase_longer_than_its_log_every_still_beats_between_log_steps(runs_dir, monkeypatch):
    """With log_every longer than the phase, only the phase's start wrote a heartbeat: status said STALE ("hung, or
    log_every is very long") 300 s into a phase that was training. A heartbeat now comes every
    ``HEARTBEAT_EVERY_S`` of steps (0 here: every step), with the host's step and rate and no loss (no device read)."""
    from sinkflow import config
    from sinkflow.engine import trainer as trainer_mod
    from sinkflow.engine.experiment import train_run
    from sinkflow.runtime.callbacks import Callback

    monkeypatch.setattr(trainer_mod, "HEARTBEAT_EVERY_S", 0.0)

    class SeeHeartbeat(Callback):
        def on_train_batch_start(self, trainer, batch):
            seen.append(json.loads((trainer.run.dir / "status.json").read_text()))

    seen = []
    cfg = config.resolve("moons", ["train.velocity.log_every=100", "experiment.name=quiet"],
                         {"method": "fm", "train_iters": 5, "batch_size": 8, "device": "cpu"})
    train_run(cfg, callbacks=[SeeHeartbeat()])
    assert [b["step"] for b in seen] == [0, 1, 2, 3, 4], seen
    assert all(b["state"] == "running" and b["total"] == 5 and "loss" not in b for b in seen), seen
    assert all(b["rate"] > 0 and b["eta_s"] >= 0 for b in seen[1:]), seen


def test_an_early_phases_did_not_learn_is_shown_after_a_long_later_phase(tmp_path):
    """status read the last 64 KiB of metrics.jsonl: in a long run the velocity phase's "did not learn" record (and
    its last metrics) fell out of it behind the nsf phase's records, and status said nothing of it."""
    from sinkflow import config

    rows = [{"phase": "velocity", "step": 100, "loss": 1.0},
            {"phase": "velocity", "step": 100, "probe_loss_start": 2.0, "probe_loss_end": 1.99, "learned": False}]
    rows += [{"phase": "nsf", "step": step, "loss": 0.5, "lr": 1e-3, "grad_norm": 1.25, "steps_per_s": 170.0}
             for step in range(1, 2001)]  # about 170 KB
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(config.dump(config.resolve("mnist", [])))
    text = format_status(read_status(tmp_path))
    assert "learning     velocity: the loss did not fall (2 on a fixed batch" in text, text
    assert "metrics      velocity step 100: loss 1" in text, text


def test_a_run_a_callback_stopped_says_so_in_the_line_and_the_json(runs_dir):
    """A callback's trainer.request_stop() stops as a SIGTERM does, with its own code: the status line says "by
    trainer.request_stop()", and `status --json`, which gave only the heartbeat's code (10, which reads as SIGUSR1),
    says it in words too (audit OO's open item)."""
    from sinkflow import config
    from sinkflow.engine.experiment import train_run
    from sinkflow.runtime.callbacks import Callback
    from sinkflow.runtime.signals import Interrupted

    class Stop(Callback):
        def on_train_batch_end(self, trainer, batch, outputs):
            if trainer.step == 3:
                trainer.request_stop()

    cfg = config.resolve("moons", ["experiment.method=otcfm", "experiment.name=asked", "experiment.device=cpu"],
                         {"train_iters": 6})
    with pytest.raises(Interrupted):
        train_run(cfg, callbacks=[Stop()])
    st = read_status(runs_dir / "asked")
    assert st["state"] == "stopped" and st["stopped"] == "by trainer.request_stop()"
    line = next(x for x in format_status(st).splitlines() if x.startswith("state"))
    assert line.startswith("state        STOPPED (by trainer.request_stop() at velocity step 3"), line


def test_a_kaggle_notebooks_saved_version_says_its_progress_in_lines(monkeypatch):
    """Inside a Jupyter kernel with ipywidgets the bar is a widget; a Kaggle notebook's saved version ("Save & Run
    All", KAGGLE_KERNEL_RUN_TYPE=Batch) runs the same kernel with no page to draw it, and its log (the streams alone)
    showed no progress at all. It gets the log file's lines; the notebook being edited keeps its widget."""
    from tqdm import autonotebook

    from sinkflow.runtime.callbacks import progress_mode

    monkeypatch.delenv("SINKFLOW_PROGRESS", raising=False)
    monkeypatch.setattr(autonotebook, "tqdm", type("NotebookBar", (), {}))  # what a kernel's autonotebook holds
    assert progress_mode() == "bar"
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert progress_mode() == "bar"
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    assert progress_mode() == "lines"
    monkeypatch.setenv("SINKFLOW_PROGRESS", "bar")  # asked for: as asked
    assert progress_mode() == "bar"
