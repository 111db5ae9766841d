"""DDP on CPU (gloo, 2 processes via torchrun): same result as one process with the same global batch,
rank-0-only files, a global step count, a resume on another number of processes (2 -> 1, 1 -> 2: recorded in
meta.json) and an agreed stop by SIGTERM to one rank."""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import cli

COMMON = ["moons", "pool.batches=4", "pool.steps=4", "pool.batch_size=32", "pool.chunk=1", "pool.in_flight=1",
          "--train-iters", "6", "train.velocity.ckpt_every=3", "train.velocity.log_every=2", "--device", "cpu",
          "--no-report", "train.velocity.schedule=constant"]  # the lr-scaling rule, not the decay, is under test


def _every_rank_exited(stderr: str, code: str) -> bool:
    """torchrun's report of a stopped 2-process job: both ranks exited with ``code`` (143 = 128+SIGTERM, 124 at a time
    limit), none killed or aborted. A torchrun whose SubprocessContext has no ``_capture_process_failures`` (torch 2.4
    to 2.8, checked in their wheels; 2.14 has it) records no exit of a rank it stopped itself once the first rank's
    exit was seen: a rank still exiting then is missing from its report (the first is listed, with
    "<NO_OTHER_FAILURES>")."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    codes = re.findall(r"exitcode\s+: (-?\d+) \(pid", stderr)
    return codes == [code, code] or codes == [code] and not hasattr(SubprocessContext, "_capture_process_failures")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*args, cwd, progress=False, entry=("-m", "sinkflow")) -> subprocess.Popen:
    """`torchrun --nproc_per_node 2 <entry> train ARGS`, started (``_finish`` waits for it)."""
    env = {**os.environ, "SINKFLOW_PROGRESS": "1" if progress else "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), *entry, "train", *args]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    """Wait for a launch; past ``timeout`` (a hang) torchrun and its workers (in sessions of their own) are killed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = _children(proc.pid)
        for pid in [proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _torchrun(*args, cwd, progress=False, entry=("-m", "sinkflow"), timeout=240):
    return _finish(_launch(*args, cwd=cwd, progress=progress, entry=entry), timeout)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers, under its agent)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _rank_pid(agent: int, rank: int) -> int:
    """The pid of torchrun's worker ``rank`` (the agent's child whose environment says RANK=rank)."""
    for pid in _children(agent):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no worker of rank {rank} under torchrun pid {agent}")


def _final(run_dir):
    return torch.load(run_dir / "checkpoints" / "velocity" / "final.pt", weights_only=True)


def test_ddp_matches_single_process_and_resumes_on_fewer(runs_dir):
    cwd = runs_dir.parent
    # 2 processes x 16 = global batch 32; lr 1e-3 scaled linearly by 2 == one process, batch 32, lr 2e-3
    ddp = _torchrun(*COMMON, "train.velocity.batch_size=16", "train.velocity.lr_scaling=linear", "--name", "ddp",
                    cwd=cwd, progress=True)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = cli("train", *COMMON, "train.velocity.batch_size=32", "train.velocity.lr=0.002", "--name", "single",
                 cwd=cwd)
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = _final(runs_dir / "ddp"), _final(runs_dir / "single")
    assert a["step"] == b["step"] == 6 and a["world_size"] == 2  # steps are optimizer steps, not x ranks
    assert a["optimizer"]["param_groups"][0]["lr"] == b["optimizer"]["param_groups"][0]["lr"] == 0.002
    for k in b["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5)
    for k in "xvt":  # the pool built in shards across ranks equals the one built alone
        np.testing.assert_array_equal(np.load(runs_dir / "ddp" / "pool" / f"{k}.npy"),
                                      np.load(runs_dir / "single" / "pool" / f"{k}.npy"))
    # only rank 0 writes: one log line per logged step, one progress message, the expected checkpoints
    lines = [json.loads(x) for x in (runs_dir / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("phase") == "velocity" and "loss" in r] == [2, 4, 6]
    assert ddp.stderr.count("run folder:") == 1
    # rank 0's progress bars count every rank's work: the pool's reached 4/4 (it stopped at 2/4, rank 0's half)
    pool_bar = re.findall(r"pool: (\d+)/(\d+) batches", ddp.stderr)  # a pipe: progress lines, not a bar
    assert pool_bar and pool_bar[-1] == ("4", "4"), ddp.stderr[-3000:]
    # the pool's solver line counts every rank's solves (it counted rank 0's half)

    solves = [re.findall(r"of ([\d,]+) Sinkhorn solves", out.stderr) for out in (ddp, single)]
    assert solves[0] == solves[1] == ["12"], solves  # 4 batches x 3 solving steps
    assert sorted(p.name for p in (runs_dir / "ddp" / "checkpoints" / "velocity").iterdir()) == \
        ["final.pt", "step_00000003.pt", "step_00000006.pt"]
    # preempted after step 3 on 2 processes, resumed on 1: lr follows the rule (linear: 2e-3 -> 1e-3)
    resumed = runs_dir / "resumed"
    shutil.copytree(runs_dir / "ddp", resumed)
    for name in ("final.pt", "step_00000006.pt"):
        (resumed / "checkpoints" / "velocity" / name).unlink()
    out = cli("train", "--resume", str(resumed), "--no-report", cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    c = _final(resumed)
    assert c["step"] == 6 and c["world_size"] == 1
    assert c["optimizer"]["param_groups"][0]["lr"] == 0.001
    logged = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in logged if r.get("phase") == "velocity" and "lr" in r][-2:] == [0.001, 0.001]
    # ... said in one line and recorded (meta.json kept "world_size": 2 and nothing else): world_size stays the
    # creation's, the change is in `changes` with the phase and step it took effect
    assert ("world_size 2 -> 1 from phase velocity step 3: train.velocity: global batch 32 -> 16, base lr 0.002 -> "
            "0.001 (lr_scaling linear)") in out.stderr, out.stderr[-3000:]
    meta = json.loads((resumed / "meta.json").read_text())
    assert meta["world_size"] == 2
    assert [(c["from"], c["to"], c["phase"], c["step"]) for c in meta["changes"] if c["key"] == "world_size"] == \
        [(2, 1, "velocity", 3)]

    # 1 -> 2 processes, stopped by a SIGTERM to rank 1 alone: both ranks stop at the same step and checkpoint, exit
    # 128+15 like one process (rank 1 aborted in gloo, "terminate called without an active exception", or was
    # killed by torchrun mid-exit), and the stop line is printed once (it was printed by every rank). No log or
    # checkpoint step comes: the ranks agree every few seconds of steps (torchrun SIGKILLs a worker 30 s after its
    # SIGTERM; a stop agreed only at log steps lost every step since the last checkpoint)
    grown = runs_dir / "grown"
    shutil.copytree(runs_dir / "single", grown)
    (grown / "checkpoints" / "velocity" / "final.pt").unlink()
    proc = _launch("--resume", str(grown), "--train-iters", "100000", "train.velocity.log_every=100000",
                   "train.velocity.ckpt_every=100000", "--no-report", cwd=cwd)
    try:
        for _ in range(1200):  # up to 120 s: the ranks start, load step 6 and train on
            time.sleep(0.1)
            status = json.loads((grown / "status.json").read_text()) if (grown / "status.json").is_file() else {}
            if status.get("phase") == "velocity" and status.get("state") == "running" or proc.poll() is not None:
                break
        time.sleep(3)
        if proc.poll() is None:  # else it failed on its own: its output is below
            signalled = time.monotonic()
            os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM)
    finally:
        stopped = _finish(proc, 120)
    assert time.monotonic() - signalled < 25, stopped.stderr[-3000:]  # within torchrun's 30 s grace
    assert stopped.stderr.count("stopped by signal 15 in phase 'velocity'") == 1, stopped.stderr[-3000:]
    assert f"resume with `torchrun --nproc_per_node 2 -m sinkflow train --resume {grown}" in stopped.stderr  # (it
    # named `sinkflow train --resume`: one process)
    assert "terminate called" not in stopped.stderr, stopped.stderr[-3000:]
    # torchrun reports any non-zero exit of its workers as a failure: every rank's is 128+15, none killed or aborted
    assert _every_rank_exited(stopped.stderr, "143"), stopped.stderr[-3000:]
    status = json.loads((grown / "status.json").read_text())
    assert status["state"] == "stopped" and status["signal"] == 15, status
    shown = cli("status", str(grown), cwd=cwd).stdout  # the console's command (status said a one-process resume)
    assert f"`torchrun --nproc_per_node 2 -m sinkflow train --resume {grown} --no-report`" in shown, shown
    assert (grown / "checkpoints" / "velocity" / f"step_{status['step']:08d}.pt").is_file()
    said = re.search(r"world_size 1 -> 2 from phase velocity step 6: train\.velocity: global batch 32 -> 64, base lr "
                     r"0\.002 -> 0\.002828 \(lr_scaling sqrt\)", stopped.stderr)
    assert said and stopped.stderr.count("world_size 1 -> 2") == 1, stopped.stderr[-3000:]
    changes = json.loads((grown / "meta.json").read_text())["changes"]
    assert [(c["from"], c["to"], c["step"]) for c in changes if c["key"] == "world_size"] == [(1, 2, 6)]

    # the time limit under torchrun: each rank's own clock, agreed as a signal is (the same step, one stop line, every
    # rank's exit status 124)
    limited = runs_dir / "limited"
    shutil.copytree(runs_dir / "single", limited)
    (limited / "checkpoints" / "velocity" / "final.pt").unlink()
    out = _torchrun("--resume", str(limited), "--train-iters", "100000", "--no-report", "--time-limit", "4s", cwd=cwd)
    assert out.stderr.count("stopped at the time limit in phase 'velocity'") == 1, out.stderr[-3000:]
    assert _every_rank_exited(out.stderr, "124"), out.stderr[-3000:]
    status = json.loads((limited / "status.json").read_text())
    assert status["state"] == "stopped" and status["signal"] == signal.SIGALRM and status["step"] > 6, status
    assert (limited / "checkpoints" / "velocity" / f"step_{status['step']:08d}.pt").is_file()

    # the run's lock held by another process: rank 0's one line, and rank 1 stops with it in silence (it waited in a
    # barrier until the store closed, and its gloo traceback buried the line; then it printed the line again)
    from sinkflow.runtime.lock import lock_run, unlock_run

    lock_run(resumed)
    try:
        held = _torchrun("--resume", str(resumed), "--no-report", cwd=cwd)
    finally:
        unlock_run(resumed)
    assert held.returncode != 0
    assert held.stderr.count("is in use by another sinkflow process") == 1, held.stderr[-3000:]  # rank 0's
    assert "rank 0 stopped" not in held.stderr and "Connection closed" not in held.stderr, held.stderr[-3000:]


def test_a_collective_failed_by_a_lost_rank_is_one_line_with_the_resume_command(monkeypatch, capsys):
    """When one worker of a torchrun job is killed, the survivors printed ~40 lines of gloo traceback ending in
    "Connection closed by peer"; they now print one line saying another process stopped, and how to resume."""
    from sinkflow.cli import main

    def lost(args):
        args.run_dir_used = "runs/x"
        raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                           "[127.0.0.1]:29500")

    monkeypatch.setattr("sinkflow.cli.status.run", lost)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["status", "runs/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another process of this torchrun job stopped" in err[0], err
    assert "resume with `torchrun --nproc_per_node 2 -m sinkflow train --resume runs/x`" in err[0], err  # as launched

    def frozen(args):  # a rank that stopped answering (SIGSTOP, a hung node): the backend's timeout, a plain error
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms "
                           "for recv operation to complete")

    monkeypatch.setattr("sinkflow.cli.status.run", frozen)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two nodes of one process each
    assert main(["status", "runs/y"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped or stopped answering" in err[0] and "Traceback" not in err[0], err
    assert "`torchrun --nnodes 2 --nproc_per_node 1 ... -m sinkflow train --resume RUN`" in err[0], err
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: not a lost peer, a bug with its traceback
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        main(["status", "runs/x"])


def test_a_second_signal_under_torchrun_is_one_line_from_rank_0(monkeypatch, capsys):
    """Two SIGTERMs to the torchrun agent mid-phase (audit YY): torchrun passes each to every worker, and each rank
    printed "stopped at once by a second signal ..." (two lines on 2 processes, 8 on 8). Rank 0 says it; every rank
    exits 128 + the signal, as one process does."""
    from sinkflow.cli import main
    from sinkflow.runtime.signals import StopNow

    def now(**kwargs):
        kwargs["on_open"](type("Run", (), {"dir": "runs/x"})())
        raise StopNow(signal.SIGTERM)

    monkeypatch.setattr("sinkflow.engine.experiment.train_run", now)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "--resume", "runs/x", "--no-report"]) == 128 + signal.SIGTERM
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == lines, err
        assert not lines or ("stopped at once by a second signal" in err[0] and "`torchrun --nproc_per_node 2 -m "
                             "sinkflow train --resume runs/x --no-report`" in err[0]), err


@pytest.mark.parametrize("command", ["eval", "sample", "lr-find", "tune", "doctor", "preflight", "bench"])
def test_a_one_process_command_under_torchrun_is_one_line_from_rank_0(command, monkeypatch, capsys):
    """`torchrun --nproc_per_node 2 -m sinkflow eval RUN`: both ranks scored the run and appended the same record to
    metrics.jsonl (lr-find: both wrote the plot). Refused before any work, said by rank 0 alone."""
    from sinkflow.cli import main

    argv = {"eval": ["eval", "runs/x"], "sample": ["sample", "runs/x", "--out", "s.npy"],
            "lr-find": ["lr-find", "moons"], "tune": ["tune", "runs/x"], "doctor": ["doctor", "moons"],
            "preflight": ["preflight", "moons"], "bench": ["bench", "moons"]}[command]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == lines and (not lines or f"`sinkflow {command}` runs as one process, but torchrun "
                                      "started 2; run it without torchrun" in err[0]), err


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_torchrun_rank_exits_without_the_interpreters_teardown(world, tmp_path):
    """Under torchrun a finished rank ends at once (``sinkflow.cli.entry``): DDP keeps its gloo process group alive
    past ``destroy_process_group`` and a rank tearing down beside its threads now and then aborted (SIGABRT, "terminate
    called without an active exception"), failing a finished job. The teardown is skipped (an atexit hook does not
    run), the status and the buffered output still come out; alone, the process exits as any Python program."""
    code = ("import atexit, sys\natexit.register(lambda: print('teardown ran'))\n"
            "sys.argv = ['sinkflow', *sys.argv[1:]]\nfrom sinkflow.cli import entry\nentry()\n")
    env = {**os.environ, "WORLD_SIZE": world}
    ok = subprocess.run([sys.executable, "-c", code, "presets"], capture_output=True, text=True, env=env, cwd=tmp_path)
    bad = subprocess.run([sys.executable, "-c", code, "status", str(tmp_path / "none")], capture_output=True, text=True,
                         env=env, cwd=tmp_path)
    assert ok.returncode == 0 and "mnist" in ok.stdout, ok.stderr  # stdout is a pipe: flushed before the exit
    assert bad.returncode == 2 and bad.stderr.startswith("sinkflow: error:"), bad.stderr
    assert ("teardown ran" in ok.stdout) == (world == "1")


def test_nsgf_states_under_ddp_are_rank_0s_and_a_single_processs(runs_dir):
    """nsgf.nsf_source=velocity on 2 processes: rank 0 computes the NSGF states once (every rank then reads that
    file), they equal a single process's with the same global batch and lr, and both later phases train from them."""
    cwd = runs_dir.parent
    args = ["moons", "--method", "nsgfpp", "pool.batches=2", "pool.steps=3", "pool.batch_size=32", "pool.chunk=1",
            "pool.in_flight=1", "--train-iters", "3", "--device", "cpu", "--no-report", "nsgf.nsf_source=velocity",
            "nsgf.nsf_states=40", *[f"train.{k}.lr_scaling=none" for k in ("velocity", "nsf", "time")]]
    ddp = _torchrun(*args, "--batch-size", "8", "--name", "ddp", cwd=cwd)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert ddp.stderr.count("40 NSGF states (3 velocity steps each)") == 1, ddp.stderr[-3000:]
    single = cli("train", *args, "--batch-size", "16", "--name", "single", cwd=cwd)
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = (np.load(runs_dir / name / "nsf_states.npy", allow_pickle=False) for name in ("ddp", "single"))
    assert a.shape == (40, 2)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for phase in ("nsf", "time"):
        assert torch.load(runs_dir / "ddp" / "checkpoints" / phase / "final.pt", weights_only=True)["step"] == 3


def test_a_normalizing_flow_under_ddp_matches_a_single_process(runs_dir):
    """`torchrun ... train flow-digits` failed on every rank at its first step: the loss asked the DDP wrapper for
    ``log_prob``, which only the flow has. The loss now goes through ``forward``, so DDP averages the gradients:
    2 ranks x 8 (constant-memory backprop, the custom autograd path) end where one process with batch 16 does."""
    cwd = runs_dir.parent
    args = ["flow-digits", "model.flow.hidden_channels=8", "model.flow.memory=invertible", "--train-iters", "3",
            "train.flow.lr_scaling=none", "--device", "cpu", "--no-report"]
    ddp = _torchrun(*args, "--batch-size", "8", "--name", "ddp", cwd=cwd)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = cli("train", *args, "--batch-size", "16", "--name", "single", cwd=cwd)
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = (torch.load(runs_dir / name / "checkpoints" / "flow" / "final.pt", weights_only=True) for name in
            ("ddp", "single"))
    assert a["step"] == b["step"] == 3 and a["world_size"] == 2
    for k in b["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5)


DROPOUT_MASKS = """import hashlib, os, sys
import torch
record = open(os.environ["MASKS"] + "." + os.environ["RANK"], "a")
forward = torch.nn.Dropout.forward
def recorded(self, x):
    out = forward(self, x)
    if self.training:  # which activations this rank's step zeroed
        record.write(hashlib.sha1(((out == 0) & (x != 0)).numpy().tobytes()).hexdigest() + "\\n")
        record.flush()
    return out
torch.nn.Dropout.forward = recorded
sys.argv = ["sinkflow", *sys.argv[1:]]
from sinkflow.cli import entry
entry()
"""


def test_dropout_under_ddp_draws_each_ranks_own_masks_and_resumes_them(runs_dir, tmp_path):
    """Every rank left the shared init with the same global RNG state, so with model.velocity.dropout > 0 each drew
    the same masks (its batch rows apart), and a resume gave every rank rank 0's restored state. Each rank's masks
    are its own now, and a run stopped at its time limit after step 1 and resumed draws at steps 2-4 the masks an
    unstopped run drew."""
    cwd = runs_dir.parent
    script = tmp_path / "masks.py"
    script.write_text(DROPOUT_MASKS)
    args = ["digits", "--method", "fm", "model.velocity.channels=8", "model.velocity.res_blocks=1",
            "model.velocity.dropout=0.5", "--batch-size", "4", "--device", "cpu", "--no-report",
            "train.velocity.schedule=constant", "train.velocity.warmup=0", "train.velocity.ema_warmup=false"]

    def masks(name, *more, rc=0):
        os.environ["MASKS"] = str(tmp_path / name)
        try:
            out = _torchrun(*more, cwd=cwd, entry=(str(script),))
        finally:
            del os.environ["MASKS"]
        assert out.returncode == rc, out.stderr[-3000:]
        return [(tmp_path / f"{name}.{rank}").read_text().split() for rank in (0, 1)]

    whole = masks("whole", *args, "--train-iters", "4", "--name", "whole")
    per_step = len(whole[0]) // 4
    assert per_step > 0 and len(whole[1]) == len(whole[0])
    assert not set(whole[0]) & set(whole[1])  # no mask of rank 0's is also rank 1's
    masks("stopped", *args, "--train-iters", "4", "--name", "stopped", "--time-limit", "0.000001", rc=1)
    resumed = masks("resumed", "--resume", str(runs_dir / "stopped"), "--no-report")
    assert len(resumed[0]) == 3 * per_step
    assert resumed[0] == whole[0][per_step:] and resumed[1] == whole[1][per_step:]


def test_a_non_finite_or_diverged_stop_under_ddp_is_one_line(runs_dir):
    """Both stops are agreed (the non-finite flag is OR-ed over ranks, the diverging loss is the mean over ranks), so
    every rank raised the same error and printed it: one line a rank, each with its own shard's loss for a
    non-finite step. Rank 0 prints it once, with the mean over ranks."""
    cwd = runs_dir.parent
    args = ["moons", "--method", "fm", "--train-iters", "300", "--batch-size", "16", "train.velocity.lr_scaling=none",
            "train.velocity.log_every=1", "--device", "cpu", "--no-report"]
    for lr, said in (("1e4", "non-finite"), ("50", "training diverged")):
        out = _torchrun(*args, "--lr", lr, "--name", f"lr{lr}", cwd=cwd)
        errors = [x for x in out.stderr.split("sinkflow: error: ")[1:]]
        assert len(errors) == 1 and errors[0].startswith(said), out.stderr[-3000:]


def test_a_refused_resume_preset_under_ddp_is_one_line(runs_dir):
    """Every rank refuses a resume as another preset alike: each printed the line (2 processes, 2 lines). Rank 0
    prints it once, and no folder is made."""
    cwd = runs_dir.parent
    made = cli("train", "moons", "--method", "fm", "--train-iters", "2", "--device", "cpu", "--no-report", "--name",
               "made", cwd=cwd)
    assert made.returncode == 0, made.stderr[-3000:]
    out = _torchrun("scurve", "--resume", str(runs_dir / "made"), cwd=cwd)
    errors = out.stderr.split("sinkflow: error: ")[1:]
    assert out.returncode != 0 and len(errors) == 1 and errors[0].startswith("cannot resume"), out.stderr[-3000:]
    assert [p.name for p in runs_dir.iterdir()] == ["made"], list(runs_dir.iterdir())


def test_a_captured_step_refused_under_ddp_is_one_line(runs_dir):
    """A ``graph: step`` that a CUDA graph cannot hold (a compile mode with graphs of its own) is refused alike on
    every rank as the phase sets up (the same config on each: check_same): rank 0 says it once. Since graph=step runs
    under torchrun this refusal is reached there, and each rank printed it (its one-line refusal under torchrun,
    before, was of graph=step itself)."""
    out = _torchrun("moons", "--method", "fm", "train.velocity.graph=step", "train.velocity.compile=true",
                    "train.velocity.compile_mode=reduce-overhead", "--train-iters", "2", "--device", "cpu",
                    "--no-report", cwd=runs_dir.parent)
    errors = out.stderr.split("sinkflow: error: ")[1:]
    assert out.returncode != 0 and len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith("train.velocity.graph=step captures the whole step; compile_mode=reduce-overhead")


def test_a_captured_step_under_ddp_trains_what_ddp_trains_and_resumes_bit_equal(runs_dir):
    """`graph: step` under torchrun (it was refused: DDP's all-reduce hooks cannot be captured): the step is the
    backward's graph, one all-reduce of the flat gradients, the update's graph (sinkflow.engine.grad_sync; on a CPU
    the same path runs uncaptured). 2 ranks, 2 micro-batches a step, EMA: the weights DDP's hooks train, bit for
    bit, and again after a stop at step 3 and a resume on 2 processes. An average that was a sum, a rank that kept
    its own gradients or its own initial weights would each end elsewhere."""
    cwd = runs_dir.parent
    args = ["moons", "--method", "otcfm", "--train-iters", "6", "train.velocity.batch_size=16",
            "train.velocity.accum=2", "train.velocity.ema=0.9", "train.velocity.ckpt_every=3", "--device", "cpu",
            "--no-report"]
    ddp = _torchrun(*args, "train.velocity.graph=none", "--name", "ddp", cwd=cwd)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    graphed = _torchrun(*args, "train.velocity.graph=step", "--name", "graphed", cwd=cwd)
    assert graphed.returncode == 0, graphed.stderr[-3000:]
    a, b = _final(runs_dir / "ddp"), _final(runs_dir / "graphed")
    assert a["step"] == b["step"] == 6 and b["world_size"] == 2
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])
    resumed = runs_dir / "resumed"
    shutil.copytree(runs_dir / "graphed", resumed)
    for name in ("final.pt", "step_00000006.pt"):
        (resumed / "checkpoints" / "velocity" / name).unlink()
    out = _torchrun("--resume", str(resumed), "--no-report", cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    c = _final(resumed)
    assert c["step"] == 6 and all(torch.equal(a["model"][k], c["model"][k]) for k in a["model"])


def test_the_learning_check_after_a_resume_on_fewer_processes_judges_the_same_batch(runs_dir):
    """The check compared rank 0's shard of the probe batch at the phase's start with rank 0's shard at its end; a
    resume on another number of processes changes the global batch and its shards, so the two were different
    batches: a frozen network (lr 1e-9) started on 2 processes and resumed on 1 read 6.73 then 5.47 and passed. The
    probe is the whole global batch of the start, its loss weighted over ranks: the frozen network is named."""
    cwd = runs_dir.parent
    args = ["moons", "--method", "fm", "--lr", "1e-9", "--train-iters", "100", "--batch-size", "8",
            "train.velocity.lr_scaling=none", "train.velocity.warmup=0", "--device", "cpu", "--no-report"]
    stopped = _torchrun(*args, "--name", "frozen", "--time-limit", "0.000001", cwd=cwd)
    assert "stopped at the time limit" in stopped.stderr, stopped.stderr[-3000:]
    out = cli("train", "--resume", str(runs_dir / "frozen"), "--no-report", cwd=cwd)  # the check is the phase end's
    said = re.search(r"velocity: the loss did not fall \(([\d.]+) on a fixed batch through the network it started "
                     r"from, ([\d.]+) through the one trained to step 100", out.stderr)
    assert out.returncode == 0 and said and said[1] == said[2], out.stderr[-3000:]


SIGTERM_IN_STATES = """
import os, signal, sys
from sinkflow.methods import nsgfpp
real = nsgfpp.nsgf_part
def first_chunk_then_sigterm(*args, **kwargs):  # rank 0 computes the states: a SIGTERM reaches it now
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
nsgfpp.nsgf_part = first_chunk_then_sigterm
sys.argv = ["sinkflow", *sys.argv[1:]]
from sinkflow.cli import entry
entry()
"""


def test_a_sigterm_while_rank_0_computes_the_states_stops_every_rank_in_one_line(runs_dir, tmp_path):
    """Rank 0 computed all the NSGF states before any rank looked at the stop (the others waiting in a broadcast):
    16,384 CIFAR states on a slow card can outlast torchrun's 30 s between SIGTERM and SIGKILL. Rank 0 stops between
    two chunks now, and every rank leaves together at the straight flow's step 0 with one stop line; no states file
    is kept."""
    cwd = runs_dir.parent
    script = tmp_path / "sigterm.py"
    script.write_text(SIGTERM_IN_STATES)
    args = ["moons", "--method", "nsgfpp", "pool.batches=2", "pool.steps=3", "pool.batch_size=32", "pool.chunk=1",
            "pool.in_flight=1", "--train-iters", "3", "--device", "cpu", "--no-report", "nsgf.nsf_source=velocity",
            "nsgf.nsf_states=40", "sample.batch_size=8", "--name", "sig"]
    out = _torchrun(*args, cwd=cwd, entry=(str(script),))
    lines = [x for x in out.stderr.splitlines() if x.startswith("sinkflow: ")]
    assert len(lines) == 1 and "stopped by signal 15 in phase 'nsf' at step 0" in lines[0], out.stderr[-3000:]
    # torchrun calls any non-zero exit a failure: both ranks left as one process stopped by SIGTERM does
    assert _every_rank_exited(out.stderr, "143"), out.stderr[-3000:]
    assert not (runs_dir / "sig" / "nsf_states.npy").exists()  # the resume computes them (test_nsf_source.py)


OOM_IN_STATES = """
import sys, torch
from sinkflow.methods import nsgfpp
def out_of_memory(*args, **kwargs):  # rank 0's first chunk of the states: the other ranks wait in on_main's broadcast
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
nsgfpp.nsgf_part = out_of_memory
sys.argv = ["sinkflow", *sys.argv[1:]]
from sinkflow.cli import entry
entry()
"""


def test_an_out_of_memory_error_while_rank_0_computes_the_states_is_one_line(runs_dir, tmp_path):
    """NSGF++'s states are rank 0's work alone (dist.on_main), which agreed an error or an OSError but not an
    out-of-memory one: rank 0 printed its OOM line and rank 1 the lost-peer line beside it. One line now, from rank
    0, whose resume command is the torchrun job's (it said a plain `sinkflow train --resume RUN`)."""
    cwd = runs_dir.parent
    script = tmp_path / "oom.py"
    script.write_text(OOM_IN_STATES)
    out = _torchrun("moons", "--method", "nsgfpp", "pool.batches=2", "pool.steps=3", "pool.batch_size=16",
                    "pool.chunk=1", "pool.in_flight=1", "--train-iters", "2", "--device", "cpu", "--no-report",
                    "nsgf.nsf_source=velocity", "nsgf.nsf_states=40", "sample.batch_size=8", "--name", "oom",
                    cwd=cwd, entry=(str(script),))
    lines = [x for x in out.stderr.splitlines() if x.startswith("sinkflow: ")]
    assert len(lines) == 1 and "out of memory in the NSGF states" in lines[0], out.stderr[-3000:]
    assert "lower sample.batch_size" in lines[0]
    assert "(`torchrun --nproc_per_node 2 -m sinkflow train --resume runs/oom --no-report`)" in lines[0], lines[0]


SIGTERM_IN_POOL = """
import os, signal, sys
from sinkflow.methods import pool
real = pool.PoolTask._simulate_group
def counted(self, group, *args, **kwargs):  # torchrun's SIGTERM reaches every worker during its first group
    with open(f"groups_rank{os.environ['RANK']}.txt", "a") as f:
        f.write(f"{group}\\n")
    if group == [self.chunk * int(os.environ["RANK"])]:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, group, *args, **kwargs)
pool.PoolTask._simulate_group = counted
sys.argv = ["sinkflow", *sys.argv[1:]]
from sinkflow.cli import entry
entry()
"""


def test_a_sigterm_during_a_pool_chunk_under_ddp_abandons_it_on_every_rank(runs_dir, tmp_path):
    """Under torchrun a pool chunk was finished, not abandoned, on a signal (each rank builds its own chunk, and an
    abandon needed a point every rank reaches alike): a 50-batch chunk on a slow card outlasts torchrun's 30 s
    grace. Each rank now stops before its next group and still joins the unit's gather: one stop line, nothing
    recorded, and the resume (here on one process) builds both chunks."""
    cwd = runs_dir.parent
    script = tmp_path / "sigterm_pool.py"
    script.write_text(SIGTERM_IN_POOL)
    pool_args = ["moons", "pool.batches=8", "pool.steps=3", "pool.batch_size=16", "pool.chunk=4", "pool.in_flight=1",
                 "--train-iters", "2", "--device", "cpu", "--no-report"]
    out = _torchrun(*pool_args, "--name", "cut", cwd=cwd, entry=(str(script),))
    lines = [x for x in out.stderr.splitlines() if x.startswith("sinkflow: ")]
    assert len(lines) == 1 and "stopped by signal 15 in phase 'pool' after 0/8 batches" in lines[0], \
        out.stderr[-3000:]
    assert _every_rank_exited(out.stderr, "143"), out.stderr[-3000:]
    assert [len((cwd / f"groups_rank{r}.txt").read_text().split("\n")) - 1 for r in (0, 1)] == [1, 1]  # of 4 each
    assert json.loads((runs_dir / "cut" / "pool" / "progress.json").read_text())["chunks"] == []
    assert cli("train", "--resume", "runs/cut", "--no-report", cwd=cwd).returncode == 0  # redone on one process
    assert json.loads((runs_dir / "cut" / "pool" / "progress.json").read_text())["chunks"] == [0, 1]


def test_a_pool_that_diverges_under_ddp_is_one_line(runs_dir):
    """The pool's divergence check was each rank's own: each diverging rank printed its line (and one that did not,
    the lost-peer line). The stop is agreed at the chunk's gather now: one line, from rank 0."""
    cwd = runs_dir.parent
    out = _torchrun("moons", "pool.eta=100", "pool.batches=4", "pool.steps=3", "pool.batch_size=16", "pool.chunk=1",
                    "pool.in_flight=1", "--train-iters", "2", "--device", "cpu", "--no-report", "--name", "div",
                    cwd=cwd)
    lines = [x for x in out.stderr.splitlines() if x.startswith("sinkflow: ")]
    assert len(lines) == 1 and "the pool's Sinkhorn flow diverged" in lines[0], out.stderr[-3000:]
    assert "pool.eta" in lines[0]


STOP_ALONE = """import os, sys
from sinkflow.engine import experiment
from sinkflow.runtime.callbacks import Callback

class StopAlone(Callback):  # an early stop on this rank's own numbers: rank 0 alone decides to stop
    def on_train_batch_end(self, trainer, batch, outputs):
        if os.environ["RANK"] == "0" and trainer.name == os.environ["STOP_PHASE"] and trainer.step == 2:
            trainer.stop()

real = experiment.train_run
experiment.train_run = lambda *a, **k: real(*a, **{**k, "callbacks": [*k.get("callbacks", ()), StopAlone()]})
sys.argv = ["sinkflow", *sys.argv[1:]]
from sinkflow.cli import entry
entry()
"""


@pytest.mark.parametrize("phase", ["pool", "velocity"])
def test_a_callbacks_stop_on_one_rank_ends_every_rank(phase, runs_dir, tmp_path, monkeypatch):
    """`trainer.stop()` from a callback on one rank only (an early stop on that rank's own shard's loss) ended that
    rank's phase alone: the other failed in the next collective ("another process of this torchrun job stopped ...
    resume with ..." beside the stop's own line). The ranks now agree on it as on a stop request, a few steps
    later, and end with the one line that the phase is not finished, writing no final.pt."""
    script = tmp_path / "stop_alone.py"
    script.write_text(STOP_ALONE)
    monkeypatch.setenv("STOP_PHASE", phase)
    out = _torchrun(*COMMON, "--train-iters", "40", "--name", "alone", cwd=runs_dir.parent, entry=(str(script),),
                    timeout=120)
    assert out.returncode != 0, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("sinkflow:")]
    assert len(lines) == 1 and f"ended phase '{phase}'" in lines[0] and "trainer.stop()" in lines[0], lines
    assert not (runs_dir / "alone" / "checkpoints" / phase / "final.pt").exists()


def test_the_ranks_agree_on_a_real_signal_before_the_time_limit_and_a_callbacks_stop():
    """The ranks' agreement takes the largest code: by bare numbers SIGINT (2) lost to a callback's request_stop (10)
    and to the time limit (14), so a Ctrl+C on one rank was told as another rank's request, with its exit status
    (audit OO). Ranked, a real signal wins, then the time limit, the request, a quiet stop()."""
    import signal as sig

    from sinkflow.runtime.dist import stop_code, stop_rank
    from sinkflow.runtime.signals import QUIET, REQUESTED, TIME_LIMIT

    order = [QUIET, REQUESTED, TIME_LIMIT, int(sig.SIGINT)]
    assert sorted(order, key=stop_rank) == order
    assert stop_code(max(map(stop_rank, [None, REQUESTED, int(sig.SIGINT), TIME_LIMIT]))) == sig.SIGINT
    assert stop_code(max(stop_rank(int(sig.SIGTERM)), stop_rank(int(sig.SIGINT)))) == sig.SIGTERM
    assert stop_code(stop_rank(None)) is None and all(stop_code(stop_rank(c)) == c for c in order)


def test_grad_sync_averages_in_place_by_dtype_and_gives_every_rank_rank_0s_buffers(monkeypatch):
    """What a captured step's all-reduce does, one rank seen with torch.distributed stood in for (the other rank
    holds gradients 3x this one's; rank 0's buffers are 7s): each gradient becomes the mean over the ranks, written
    into its own storage (the update's graph reads the addresses the backward's graph wrote), float64 beside
    float32 (one flat buffer per dtype), a parameter without a gradient left without one, and the buffers (a
    BatchNorm's statistics, its int64 count too) rank 0's, as DDP gives them before each forward."""
    from sinkflow.engine import grad_sync

    calls = []

    def all_reduce(flat):
        calls.append(("all_reduce", flat.dtype))
        flat.mul_(4)  # this rank's share g/2 plus the other rank's 3g/2

    def broadcast(flat, src):
        calls.append(("broadcast", flat.dtype))
        flat.fill_(7)

    monkeypatch.setattr(grad_sync.tdist, "get_world_size", lambda: 2)
    monkeypatch.setattr(grad_sync.tdist, "all_reduce", all_reduce)
    monkeypatch.setattr(grad_sync.tdist, "broadcast", broadcast)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 1).double())
    sync = grad_sync.GradSync(model)
    model[0].weight.grad = torch.ones(2, 3)
    model[2].weight.grad = torch.full((1, 2), 2.0, dtype=torch.float64)
    storage = model[0].weight.grad.data_ptr()
    sync()
    assert torch.equal(model[0].weight.grad, torch.full((2, 3), 2.0)) and model[0].weight.grad.data_ptr() == storage
    assert torch.equal(model[2].weight.grad, torch.full((1, 2), 4.0, dtype=torch.float64))
    assert model[0].bias.grad is None
    assert torch.equal(model[1].running_mean, torch.full((2,), 7.0)) and int(model[1].num_batches_tracked) == 7
    # first the count of each parameter's gradients over the ranks (once), then one average per dtype
    assert [c for c in calls if c[0] == "all_reduce"] == [("all_reduce", torch.float32)] * 2 + [("all_reduce",
                                                                                               torch.float64)]


def test_grad_sync_carries_each_ranks_loss_check_in_the_gradients_all_reduce(monkeypatch):
    """A captured step's skip decision needs every rank's loss check: it joins the float32 gradients' flat buffer (no
    collective of its own, none inside the update's graph), ``loss_bad`` > 0 after the average where any rank's loss
    was non-finite, 0 where none was. The stand-in all-reduce sums this rank's share with an equal one."""
    from sinkflow.engine import grad_sync

    sizes = []

    def all_reduce(flat):
        sizes.append((flat.dtype, flat.numel()))
        flat.mul_(2)

    monkeypatch.setattr(grad_sync.tdist, "get_world_size", lambda: 2)
    monkeypatch.setattr(grad_sync.tdist, "all_reduce", all_reduce)
    model = torch.nn.Linear(3, 2)
    sync = grad_sync.GradSync(model)
    for i, (loss, bad) in enumerate(((torch.tensor(float("nan")), True), (torch.tensor(0.5), False),
                                     (torch.tensor(-math.inf), True))):
        model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.ones(2)
        sizes.clear()
        sync(loss)
        counted = [(torch.float32, 2)] if i == 0 else []  # the first call counts each parameter's gradients
        assert sizes == counted + [(torch.float32, 6 + 2 + 1)] and bool(sync.loss_bad > 0) is bad
        assert torch.equal(model.weight.grad, torch.ones(2, 3))


def test_grad_sync_refuses_gradients_on_some_ranks_only_before_any_average(monkeypatch):
    """A parameter with a gradient on one rank and none on another makes the ranks' flat buffers differ in size: NCCL
    would wait for ever. The first call counts each parameter's gradients over the ranks (the stand-in all-reduce
    adds the other rank's count: it has every gradient) and raises one line naming the parameter, before any
    gradient is averaged; where the ranks agree, the count is taken once and the step goes on."""
    from sinkflow.engine import grad_sync
    from sinkflow.errors import SinkflowError

    reduced = []

    def all_reduce(flat):
        reduced.append(flat.numel())
        flat.add_(1) if flat.numel() == 2 else flat.mul_(2)

    monkeypatch.setattr(grad_sync.tdist, "get_world_size", lambda: 2)
    monkeypatch.setattr(grad_sync.tdist, "all_reduce", all_reduce)
    model = torch.nn.Linear(3, 2)
    sync = grad_sync.GradSync(model)
    model.weight.grad = torch.ones(2, 3)
    with pytest.raises(SinkflowError, match="parameter 'bias' got a gradient on some ranks only") as err:
        sync()
    assert err.value.every_rank and reduced == [2] and torch.equal(model.weight.grad, torch.ones(2, 3))
    model.bias.grad = torch.ones(2)
    reduced.clear()
    sync()
    sync()
    assert reduced == [2, 8, 8] and torch.equal(model.bias.grad, torch.ones(2))
