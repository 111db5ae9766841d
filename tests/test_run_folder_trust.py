"""Trust the run folder, round 2 (issue 27, docs/reliability.md): checkpoint contents are validated before a
resume changes anything, resume overrides are applied for real or refused, divergence that stays finite
stops, count arguments are checked in one place, a CUDA OOM is one line, eval works on a folder it cannot
write, and the messages name the right thing."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import TINY_2D, bytes_snapshot, error_line, read_only, run_main
from sinkflow.cli import main


def one_line(rc, err, *needles):
    return error_line(rc, err, *needles, alone=True)


@pytest.fixture
def base_run(tiny_run):
    return tiny_run


@pytest.fixture
def run(base_run, tmp_path, monkeypatch):
    """A private copy of the finished tiny moons run (pool; velocity steps 3 and 6 and final)."""
    monkeypatch.chdir(tmp_path)
    dst = tmp_path / "runs" / "r"
    shutil.copytree(base_run, dst)
    return dst


def edit(path: Path, change) -> None:
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


# ---- 1. checkpoint contents, validated before anything in the run folder changes ----------------------------

def _set(*keys, value):
    def change(state):
        d = state
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value(d[keys[-1]]) if callable(value) else value
    return change


def _drop(key):
    return lambda state: state.pop(key)


STEP_DAMAGE = {
    "weight is a list": (_set("model", "net.0.weight", value=lambda t: t.tolist()), "model.net.0.weight"),
    "weight is a string": (_set("model", "net.0.bias", value="oops"), "model.net.0.bias"),
    "int64 weight": (_set("model", "net.2.weight", value=lambda t: t.long()), "int64"),
    "bool weight": (_set("model", "net.2.bias", value=lambda t: t > 0), "bool"),
    "model missing": (_drop("model"), "'model'"),
    "wrong-shape Adam moment": (_set("optimizer", "state", 0, "exp_avg", value=torch.zeros(3, 3)), "exp_avg"),
    "Adam amsgrad flag": (_set("optimizer", "param_groups", 0, "amsgrad", value=True), "amsgrad"),
    "generator of another size": (_set("generator", value=torch.zeros(16, dtype=torch.uint8)), "generator"),
    "generator as floats": (_set("generator", value=lambda t: t.float()), "generator"),
    "numpy RNG key": (_set("rng", "numpy", "key", value=torch.zeros(5, dtype=torch.int64)), "rng.numpy"),
    "python RNG state": (_set("rng", "python", "state", value=[1, 2, 3]), "rng.python"),
    "scheduler step": (_set("scheduler", "_step_count", value="x"), "scheduler._step_count"),
    "NaN weight": (_set("model", "net.6.bias", value=torch.tensor([float("nan"), 0.0])), "NaN"),
}


@pytest.mark.parametrize("damage", list(STEP_DAMAGE))
def test_bad_step_checkpoint_is_refused_before_the_folder_changes(run, capsys, damage):
    change, needle = STEP_DAMAGE[damage]
    ck = run / "checkpoints" / "velocity"
    (ck / "final.pt").unlink()
    edit(ck / "step_00000006.pt", change)
    before = bytes_snapshot(run)  # status.json and .lock included: main rewrote both before failing
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "step_00000006.pt", needle)
    assert bytes_snapshot(run) == before


FINAL_DAMAGE = {k: STEP_DAMAGE[k] for k in ("weight is a list", "weight is a string", "int64 weight", "bool weight",
                                            "model missing", "NaN weight")}


@pytest.mark.parametrize("command", ["sample", "eval"])
@pytest.mark.parametrize("damage", list(FINAL_DAMAGE))
def test_bad_final_is_refused_by_sample_and_eval(run, capsys, tmp_path, command, damage):
    change, needle = FINAL_DAMAGE[damage]
    edit(run / "checkpoints/velocity/final.pt", change)
    before = bytes_snapshot(run)
    argv = (["sample", str(run), "--n", "4", "--out", str(tmp_path / "s.npy")] if command == "sample"
            else ["eval", str(run), "--seeds", "1"])
    one_line(*run_main(capsys, *argv), "final.pt", needle)
    assert bytes_snapshot(run) == before
    assert not (tmp_path / "s.npy").exists()


def test_a_final_of_another_float_width_is_not_called_damaged(run, capsys, tmp_path):
    """Weights saved under a notebook's torch.set_default_dtype(torch.float64) are sound: the refusal advised deleting
    final.pt ("sinkflow only resumes checkpoints it wrote"), which lost the trained model. It names the widths."""
    edit(run / "checkpoints/velocity/final.pt", lambda state: state.update(
        model={k: v.double() for k, v in state["model"].items()}))
    line = one_line(*run_main(capsys, "sample", str(run), "--n", "4", "--out", str(tmp_path / "s.npy")),
                    "final.pt holds float64 weights", "where the model built here holds float32",
                    "torch.set_default_dtype(torch.float64)", "the checkpoint is intact")
    assert "delete" not in line


def test_resume_of_a_finished_run_checks_its_final(run, capsys):
    edit(run / "checkpoints/velocity/final.pt", _set("model", "net.0.weight", value=torch.zeros(256, 5)))
    before = bytes_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "final.pt", "shape (256, 5)")
    assert bytes_snapshot(run) == before


# ---- 2. resume overrides: applied for real (and recorded) or refused -----------------------------------------

def test_resume_lr_is_applied_to_the_optimizer_and_recorded(run, capsys):
    ck = run / "checkpoints" / "velocity"
    (ck / "final.pt").unlink()
    (ck / "step_00000006.pt").unlink()  # resume from step 3
    rc, err = run_main(capsys, "train", "--resume", str(run), "--lr", "0.01", "--no-report")
    assert rc == 0, err
    final = torch.load(ck / "final.pt", weights_only=True)
    assert final["scheduler"]["base_lrs"] == [0.01]
    assert final["optimizer"]["param_groups"][0]["initial_lr"] == 0.01
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in logged if r["phase"] == "velocity" and r["step"] == 4][-1]  # cosine over 6 steps, from 0.01
    assert after["lr"] == pytest.approx(0.01 * 0.5 * (1 + __import__("math").cos(__import__("math").pi * 4 / 6)))
    changes = json.loads((run / "meta.json").read_text())["changes"]
    assert {(c["key"], c["from"], c["to"], c["phase"], c["step"]) for c in changes} == {
        ("train.velocity.lr", 0.001, 0.01, "velocity", 3)}


def test_training_key_of_a_finished_phase_is_refused(run, capsys):
    before = bytes_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "train.velocity.lr=0.5", "--no-report"),
             "train.velocity.lr=0.5", "finished", "no effect")
    assert bytes_snapshot(run) == before


def test_a_preset_beside_resume_must_be_the_runs(run, capsys):
    before = bytes_snapshot(run)
    one_line(*run_main(capsys, "train", "checkerboard", "--resume", str(run), "--no-report"),
             "checkerboard", "preset 'moons'")
    assert bytes_snapshot(run) == before
    rc, err = run_main(capsys, "train", "moons", "--resume", str(run), "--no-report")  # the run's own: fine
    assert rc == 0, err


def test_new_run_over_a_folder_without_config_is_refused_untouched(run, capsys):
    (run / "config.yaml").unlink()
    before = bytes_snapshot(run)
    one_line(*run_main(capsys, "train", "moons", *TINY_2D, "--name", "r", "--no-report"), "no config.yaml")
    assert bytes_snapshot(run) == before  # meta.json and .lock too


# ---- 3. divergence that stays finite -------------------------------------------------------------------------

def test_pool_that_leaves_the_data_stops_naming_pool_eta(runs_dir, capsys):
    line = one_line(*run_main(capsys, "train", "moons", *TINY_2D, "pool.eta=100", "--name", "d", "--no-report"),
                    "diverged", "pool.eta")
    assert "Inf" not in line
    assert not (runs_dir / "d" / "checkpoints" / "pool" / "final.pt").exists()
    assert json.loads((runs_dir / "d" / "pool" / "progress.json").read_text()
                      if (runs_dir / "d" / "pool" / "progress.json").exists() else '{"chunks": []}')["chunks"] == []


def test_pool_whose_last_step_alone_leaves_the_data_stops(runs_dir, capsys):
    """The divergence check looks at the flow's end point x_T too, which the pool does not store: with one Sinkhorn
    step of eta 100 every stored state is a source sample, the end point is ~130 radii out, and the check that
    looked at the stored states alone built the pool in silence (velocity loss 1.2e4; audit RR)."""
    line = one_line(*run_main(capsys, "train", "moons", *TINY_2D, "pool.steps=1", "pool.eta=100",
                              "pool.landing=sinkhorn", "--name", "d", "--no-report"),
                    "diverged", "after step 1 of 1 (its end point x_T)", "pool.eta")
    assert "Inf" not in line
    assert not (runs_dir / "d" / "checkpoints" / "pool" / "final.pt").exists()
    progress = runs_dir / "d" / "pool" / "progress.json"
    assert not progress.exists() or json.loads(progress.read_text())["chunks"] == []


def test_finite_loss_blow_up_stops_naming_the_lr(runs_dir, capsys):
    """FM on moons at lr 1: the loss reaches ~1e12 and falls back to ~1e6; main trained on and exited 0."""
    line = one_line(*run_main(capsys, "train", "moons", "experiment.method=fm", "--lr", "1", "--train-iters", "30",
                              "train.velocity.log_every=5", "train.velocity.ckpt_every=2",
                              "train.velocity.schedule=constant", "--device", "cpu", "--name", "l", "--no-report"),
                    "diverged", "train.velocity.lr", "step 5")
    assert "up to step 4 are kept" in line
    assert not (runs_dir / "l" / "checkpoints" / "velocity" / "final.pt").exists()
    # the loss the line names is the run's record of step 5 (it was not written: metrics.jsonl held no record at all)
    records = [json.loads(r) for r in (runs_dir / "l" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5] and f"loss {records[0]['loss']:.3g} " in line
    assert records[0]["loss"] > 1e9 and "update_ratio" in records[0]  # the whole record, the dashboard's too


def test_a_divergence_on_a_full_disk_still_says_it_diverged(runs_dir, capsys, monkeypatch):
    """The stop records the blow-up's metrics before it raises: on a full disk that record's OSError replaced the
    divergence line ("No space left on device"), whose fix is the learning rate, not the disk."""
    from sinkflow.runtime.metrics import MetricsLogger

    real = MetricsLogger.log

    def full_disk_for_the_blow_up(self, phase, step, values):
        if values.get("loss", 0) > 1e6:
            raise OSError(28, "No space left on device")
        return real(self, phase, step, values)

    monkeypatch.setattr(MetricsLogger, "log", full_disk_for_the_blow_up)
    one_line(*run_main(capsys, "train", "moons", "experiment.method=fm", "--lr", "1", "--train-iters", "30",
                       "train.velocity.log_every=5", "train.velocity.ckpt_every=2", "train.velocity.schedule=constant",
                       "--device", "cpu", "--name", "l", "--no-report"), "diverged", "train.velocity.lr", "step 5")


def test_divergence_guard_leaves_a_sound_run_bit_equal(runs_dir, base_run):
    """The guard's probe batch uses its own generator and restores the global RNG: the tiny run's weights
    equal the ones the fixture trained (same config), so resume stays bit-for-bit."""
    assert main(["train", "moons", *TINY_2D, "--name", "again", "--no-report"]) == 0
    a = torch.load(runs_dir / "again/checkpoints/velocity/final.pt", weights_only=True)["model"]
    b = torch.load(base_run / "checkpoints/velocity/final.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- 4. count arguments: one place, one line -----------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["sample", "RUN", "--steps", "0", "--out", "s.npy"], "--steps 0"),
    (["sample", "RUN", "--steps", "-1", "--out", "s.npy"], "--steps -1"),
    (["sample", "RUN", "--n", "99999999999999", "--out", "s.npy"], "available"),
    (["sample", "RUN", "--n", "abc", "--out", "s.npy"], "invalid int value"),
    (["eval", "RUN", "--seeds", "-2"], "--seeds -2"),
    (["eval", "RUN", "--seeds", "0"], "--seeds 0"),
    (["eval", "RUN", "--n", "0"], "--n 0"),
    (["eval", "RUN", "--n", "1000000"], "exact-W2 cost matrix"),
    (["doctor", "RUN", "--steps", "0"], "--steps 0"),
    (["lr-find", "RUN", "--steps", "-3"], "--steps -3"),
])
def test_count_arguments_are_checked_in_one_place(run, capsys, argv, needle):
    argv = [str(run) if a == "RUN" else a for a in argv]
    before = bytes_snapshot(run)
    one_line(*run_main(capsys, *argv), needle)
    assert bytes_snapshot(run) == before
    assert not Path("s.npy").exists()


# ---- 5. CUDA out of memory at run time ------------------------------------------------------------------------

def test_out_of_memory_in_training_is_one_line_and_keeps_the_checkpoint(runs_dir, capsys, monkeypatch):
    from sinkflow.methods.nsgf import PoolVelocityStep

    calls = []
    real = PoolVelocityStep.loss

    def loss(self, model, batch):
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, model, batch)

    monkeypatch.setattr(PoolVelocityStep, "loss", loss)
    line = one_line(*run_main(capsys, "train", "moons", *TINY_2D, "--name", "o", "--no-report"),
                    "CUDA out of memory in velocity at step 5", "the planner estimates", "step_00000003.pt",
                    "train.velocity.accum", "preflight moons", "--resume")
    assert "Tried to allocate" not in line
    ck = runs_dir / "o" / "checkpoints" / "velocity"
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000003.pt"]
    monkeypatch.setattr(PoolVelocityStep, "loss", real)
    rc, err = run_main(capsys, "train", "--resume", str(runs_dir / "o"), "--no-report")  # the fix: resume
    assert rc == 0, err


def test_out_of_memory_while_sampling_names_the_sampling_batch(run, capsys, monkeypatch, tmp_path):
    from sinkflow.methods.nsgf import NSGF

    def sample(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(NSGF, "sample", sample)
    before = bytes_snapshot(run)
    one_line(*run_main(capsys, "sample", str(run), "--n", "8", "--out", str(tmp_path / "s.npy")),
             "CUDA out of memory in sample", "sample.batch_size")
    assert bytes_snapshot(run) == before


# ---- 6. eval on a run folder it cannot write -----------------------------------------------------------------

def _unwritable_by_a_folder(run):
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()  # any user (root included) fails to open it for appending
    return lambda: None


def _unwritable_by_permissions(run):
    undo = read_only(run, recursive=True)  # chmod, or for root the immutable attribute
    if undo is None:
        pytest.skip("no way to make a folder read-only for root here (chattr +i refused)")
    return undo


@pytest.mark.parametrize("make_unwritable", [_unwritable_by_a_folder, _unwritable_by_permissions])
def test_eval_on_an_unwritable_run_prints_scores_and_says_so(run, capfd, make_unwritable):
    undo = make_unwritable(run)
    try:
        capfd.readouterr()
        rc = main(["eval", str(run), "--seeds", "1"])
        out, err = capfd.readouterr()  # file descriptors: a TensorBoard writer thread's output would show here
    finally:
        undo()
    assert rc == 0, err
    assert "W2 on moons" in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "could not record the scores" in lines[0], err
    assert "copy its folder somewhere you can write and evaluate the copy" in lines[0], lines  # not runs_dir
    assert "Traceback" not in err and "Exception" not in err


def test_eval_on_a_read_only_mount_says_so(run, capfd, monkeypatch):
    """A run on a read-only mount (a Kaggle input) was said to be EACCES, "point experiment.runs_dir at a folder you
    own", a fix an existing run's evaluation cannot take: it is EROFS, and the copy is the way to keep the scores."""
    import os
    from collections import namedtuple

    monkeypatch.setattr(os, "access", lambda path, mode, **kw: mode != os.W_OK)
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: namedtuple("vfs", "f_flag")(statvfs(path).f_flag | os.ST_RDONLY))
    capfd.readouterr()
    assert main(["eval", str(run), "--seeds", "1"]) == 0
    err = capfd.readouterr().err
    assert "(EROFS Read-only file system); the scores above are complete" in err, err


# ---- 7. messages ----------------------------------------------------------------------------------------------

class SystemCall:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_os_system_payload_is_called_refused_not_corrupt(tmp_path):
    from sinkflow.errors import SinkflowError
    from sinkflow.runtime.checkpoint import load

    torch.save({"format": 2, "x": SystemCall()}, tmp_path / "p.pt")
    with pytest.raises(SinkflowError, match="refused .loading it could run code") as e:
        load(tmp_path / "p.pt")
    assert "corrupt" not in str(e.value)


@pytest.mark.parametrize("override,hint", [("nsgf.blurr=0.5", "sinkhorn.blur"), ("nsgf.eta=1", "pool.eta"),
                                           ("pool.blur=1", "sinkhorn.blur"), ("pool.etaa=1", "pool.eta"),
                                           ("train.velocity.itres=3", "train.velocity.iters"),
                                           ("model.flow.hidden=3", "model.flow.hidden_channels"),  # was `kind`
                                           ("model.flow.depth=3", "model.flow.depth_per_level")])
def test_key_hints_prefer_the_section_and_moved_keys(override, hint):
    from sinkflow import config
    from sinkflow.errors import SinkflowError

    with pytest.raises(SinkflowError, match=f"did you mean '{hint}'"):
        config.resolve("flow-digits" if override.startswith("model.flow") else "moons", [override])


def test_folder_named_npy_is_not_a_file(runs_dir, tmp_path, capsys):
    (tmp_path / "x.npy").mkdir()
    one_line(*run_main(capsys, "train", "moons", f"data.target={tmp_path / 'x.npy'}"), "is a folder, not a file")
    assert not runs_dir.exists()


def test_free_space_message_has_readable_units(tmp_path, monkeypatch):
    from collections import namedtuple

    from sinkflow import config
    from sinkflow.errors import SinkflowError
    from sinkflow.methods import pool

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10_000, 9_000, 1_000))
    cfg = config.resolve("moons", ["pool.batches=2", "pool.steps=4", "pool.batch_size=32"])["pool"]
    with pytest.raises(SinkflowError) as e:
        pool.check_free_disk(cfg, (2,), tmp_path / "pool")
    msg = str(e.value)
    assert f"needs {pool.pool_bytes(cfg, (2,)) / 1024:.1f} KiB of disk but the disk has only 1000 B" in msg, msg
    assert "0.0 GiB" not in msg


def test_free_disk_counts_the_blocks_a_resumed_pool_already_holds(tmp_path, monkeypatch):
    """A half-built pool's arrays reserve all their blocks at creation: on resume they are the pool's own, so a disk
    with less free space than the whole pool (but enough with them) goes on; without them it is refused."""
    from collections import namedtuple

    from sinkflow import config
    from sinkflow.data import atomic_write
    from sinkflow.errors import SinkflowError
    from sinkflow.methods import pool

    cfg = config.resolve("moons", ["pool.batches=4", "pool.steps=4", "pool.batch_size=256"])["pool"]
    need = pool.pool_bytes(cfg, (2,))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * need, 9 * need, need // 4))
    folder = tmp_path / "pool"
    with pytest.raises(SinkflowError, match="of disk but the disk has only"):
        pool.check_free_disk(cfg, (2,), folder)
    assert not folder.exists()  # checking creates nothing
    folder.mkdir()
    x = folder / "x.npy"
    np.lib.format.open_memmap(x, mode="w+", dtype=np.float32, shape=(need // 4,)).flush()  # most of the pool
    atomic_write.reserve_disk(x)
    if x.stat().st_blocks * 512 < need * 3 // 4:
        pytest.skip("this file system does not preallocate: nothing is held")
    pool.check_free_disk(cfg, (2,), folder)


def test_the_free_disk_must_hold_the_checkpoints_too(tiny_run, runs_dir, monkeypatch, capsys):
    """A new run is refused before its folder exists when the disk has room for its pool but not its checkpoints,
    and a run with no pool (FM) is checked at all: the disk plan was the pool alone, 1.5 % of a finished moons run's
    6.7 MB (checkpoints 6.5 MB), 0.2 % of an mnist-shaped NSGF++ run's 126 MB, nothing of cifar10 FM's 1.7 GB
    (du, 2026-11-30), so a full disk stopped the run at its first checkpoint, ckpt_every steps in. The plan is an
    upper bound of what the checkpoints hold (keep step files and final.pt each phase)."""
    from collections import namedtuple

    from sinkflow import config
    from sinkflow.methods import pool
    from sinkflow.methods.base import checkpoint_bytes
    from sinkflow.runtime.run_folder import read_config

    held = sum(f.stat().st_size for f in (tiny_run / "checkpoints").rglob("*.pt") if f.parent.name != "pool")
    assert held <= checkpoint_bytes(read_config(tiny_run), (2,)) <= 1.5 * held
    usage = namedtuple("usage", "total used free")
    for method in ("nsgf", "fm"):
        argv = ["moons", "--method", method, "--train-iters", "6", "train.velocity.ckpt_every=3"]
        cfg = config.resolve("moons", [f"experiment.method={method}", "train.velocity.iters=6",
                                       "train.velocity.ckpt_every=3"])
        free = (pool.pool_bytes(cfg["pool"], (2,)) if method == "nsgf" else 0) + checkpoint_bytes(cfg, (2,)) // 2
        monkeypatch.setattr(shutil, "disk_usage", lambda p, free=free: usage(2**40, 2**40 - free, free))
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the run needs" in err and "of disk but the disk has only" in err, err
        assert " checkpoints " in err and "checkpoint.keep" in err and ("pool " in err) == (method == "nsgf"), err
        assert not runs_dir.exists()


def test_memory_plan_and_phases_do_not_depend_on_the_free_disk(tmp_path, monkeypatch):
    """The memory plan of a preset whose pool is larger than this disk's free space (cifar10: 18 GiB; CI had 16 GiB
    free) is the same on every machine, and creates no folder: the free disk is checked when a run starts."""
    from collections import namedtuple

    from sinkflow import config
    from sinkflow.errors import SinkflowError
    from sinkflow.methods import pool
    from sinkflow.tools import memory_plan

    monkeypatch.chdir(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**30, 2**30 - 2**20, 2**20))
    cfg = config.resolve("cifar10", [])
    assert [m.phase for m in memory_plan.estimate(cfg)][-1] == "sample+eval"
    assert list(tmp_path.iterdir()) == []
    from sinkflow import methods

    methods.of(cfg).check(cfg, (3, 32, 32))  # the config is fine; this machine is not
    with pytest.raises(SinkflowError, match="of disk but the disk has only 1.0 MiB"):
        methods.of(cfg).check_machine(cfg, (3, 32, 32))
    assert list(tmp_path.iterdir()) == []


def test_pool_disk_budget_is_a_config_check(tmp_path):
    from sinkflow import config
    from sinkflow.errors import SinkflowError
    from sinkflow.methods import pool

    cfg = config.resolve("cifar10", ["pool.disk_gb=1"])["pool"]
    with pytest.raises(SinkflowError, match=r"needs 18\.\d GiB of disk but pool.disk_gb=1(\.0)?; use fewer "
                                            r"pool.batches, or a larger pool.disk_gb"):
        pool.check_pool_fits(cfg, (3, 32, 32))


def test_human_bytes():
    from sinkflow.errors import human_bytes

    assert [human_bytes(b) for b in (0, 1000, 4352, 3 * 2**20, 40 * 2**30, 2.5 * 2**50)] == [
        "0 B", "1000 B", "4.2 KiB", "3.0 MiB", "40.0 GiB", "2.5 PiB"]


# ---- the pool's own files: a half-built pool is checked against the config, and a full disk is an error ------

def _unbuilt(run: Path, keep=("x",)) -> None:
    """The state of a build killed while it created its arrays: no checkpoint, no progress, only ``keep``."""
    shutil.rmtree(run / "checkpoints")
    for path in (run / "pool").iterdir():
        if path.stem not in keep:
            path.unlink()


def _pool_arrays(run: Path) -> dict:
    import numpy as np

    return {k: np.load(run / "pool" / f"{k}.npy") for k in ("x", "v", "t")}


def test_a_pool_killed_while_creating_its_arrays_resumes(run, base_run, capsys):
    """A SIGKILL between x.npy and v.npy left a run no resume could finish ("pool file v.npy is missing or
    damaged", forever): the arrays were created only when x.npy was missing. No chunk was built: they are made anew."""
    import numpy as np

    _unbuilt(run)
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc == 0, err
    for key, a in _pool_arrays(base_run).items():
        np.testing.assert_array_equal(_pool_arrays(run)[key], a)


@pytest.mark.parametrize("edit_line, new_line, key", [("  chunk: 1", "  chunk: 2", "pool.chunk"),
                                                      ("  batches: 2", "  batches: 4", "pool.batches"),
                                                      ("  seed: 0", "  seed: 1", "experiment.seed")])
def test_a_half_built_pool_refuses_a_hand_edited_config(run, capsys, edit_line, new_line, key):
    """config.yaml edited by hand got past the resume's override check: pool.chunk 1 -> 2 left finished chunks
    as zeros and exit 0, pool.batches a broadcast traceback after the work, the seed a pool of two seeds. The
    keys a pool was built with are in progress.json and compared before the folder changes."""
    shutil.rmtree(run / "checkpoints")
    progress = run / "pool" / "progress.json"
    progress.write_text(json.dumps({**json.loads(progress.read_text()), "chunks": [0]}))
    config = run / "config.yaml"
    text = config.read_text()
    assert edit_line + "\n" in text
    config.write_text(text.replace(edit_line + "\n", new_line + "\n"))
    before = bytes_snapshot(run)
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    one_line(rc, err, f"was built with {key}=", f"but the run's config.yaml has {key}=", "back to", "to finish this pool")
    assert bytes_snapshot(run) == before


def test_a_checkpoint_of_other_frozen_values_names_config_yaml_too(run, capsys):
    """A hand-edited frozen key was blamed on the checkpoint alone ("it belongs to another run; remove it"), and
    following that advice gave a run whose arrays and config disagreed."""
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("  seed: 0\n", "  seed: 1\n"))
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    one_line(rc, err, "was written with experiment.seed=0 but the run's config.yaml has experiment.seed=1",
             "if config.yaml was edited, set experiment.seed back to 0 in it")


def test_a_lost_pool_array_is_rebuilt_and_the_trained_checkpoints_kept(run, base_run, capsys):
    """The fix for a missing pool file said to delete checkpoints/ too: the trained phases with it. Deleting the
    pool and its final.pt is enough: the same seed rebuilds the same pool, and the phase resumes on it bit for bit."""
    import numpy as np

    (run / "checkpoints" / "velocity" / "final.pt").unlink()  # velocity resumes from step 6
    (run / "pool" / "v.npy").unlink()
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    line = one_line(rc, err, "v.npy is missing or damaged", "the later phases' checkpoints are kept")
    assert str(run / "checkpoints") + " " not in line and str(run / "checkpoints") + ";" not in line
    shutil.rmtree(run / "pool")
    shutil.rmtree(run / "checkpoints" / "pool")
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc == 0, err
    for key, a in _pool_arrays(base_run).items():
        np.testing.assert_array_equal(_pool_arrays(run)[key], a)
    ours = torch.load(run / "checkpoints/velocity/final.pt", weights_only=True)["model"]
    theirs = torch.load(base_run / "checkpoints/velocity/final.pt", weights_only=True)["model"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_disk_too_full_for_the_pool_is_one_line_not_a_bus_error(run, capsys, monkeypatch):
    """The arrays were created sparse and filled through memory maps: a disk that filled during the build was a
    SIGBUS (exit 135, no message). Their blocks are reserved when they are created; ENOSPC then is the usual line."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    _unbuilt(run, keep=())
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc != 0 and "No space left on device" in err and "free disk space" in err and "Traceback" not in err, err
    assert not [p.name for p in (run / "pool").iterdir() if p.name.startswith(".")]  # no temp file left


def test_the_exact_w2_memory_plan_bounds_what_pot_takes(tiny_run, monkeypatch):
    """`eval --n N` on points is refused when the exact W2 cannot fit: its plan was the float64 cost matrix alone
    (8 N^2 bytes) while POT's emd2 rises the peak RSS 41 N^2 (n = 1,000-6,000: 39 MiB to 1.4 GiB, 2026-11-30), so an
    n the check let through could need 5x the memory it found. Measured in a fresh process, then the check itself."""
    import subprocess
    import sys

    from sinkflow.data import memory
    from sinkflow.errors import SinkflowError
    from sinkflow.runtime.run_folder import read_config

    n = 1500
    # VmHWM, this process's own peak: getrusage's ru_maxrss in a child starts at the forking pytest's RSS
    peak = "int(next(x for x in open('/proc/self/status') if x.startswith('VmHWM')).split()[1]) * 1024"
    code = ("import numpy as np\nfrom sinkflow.ot.metrics import w2\nr = np.random.default_rng(0)\n"
            f"w2(r.random((10, 2)), r.random((10, 2)))\nbefore = {peak}\n"
            f"w2(r.random(({n}, 2)), r.random(({n}, 2)))\nprint({peak} - before)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rise = int(done.stdout.split()[-1])
    assert 20 * n * n < rise <= memory.EXACT_W2_PAIR_BYTES * n * n, rise / n**2
    cfg = read_config(tiny_run)
    monkeypatch.setattr(memory, "available_memory", lambda: 30 * 6000**2)  # the old plan's 8 n^2 fitted it
    with pytest.raises(SinkflowError, match="exact-W2"):
        memory.check_sample_memory(6000, cfg, exact_w2=True)


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_a_png_grid_is_counted_before_sampling(shape, monkeypatch):
    """The memory check before `sample --out grid.png` counted the samples but not the grid save_grid builds after
    them (upscaled, 3 channels, float32, then uint8): about 13 GB for 100,000 digits, met once every sample was
    drawn (audit GG). ``grid_bytes`` covers what torchvision's grid holds; the check names the grid and the way out."""
    from torchvision.utils import make_grid

    from sinkflow import config
    from sinkflow.data import memory
    from sinkflow.errors import SinkflowError
    from sinkflow.eval.images import _upscale, grid_bytes

    x = torch.rand(10, *shape) * 2 - 1
    up = _upscale(x)
    grid = make_grid(up, nrow=4, padding=2)  # save_grid's nrow for 10: ceil(sqrt(10))
    assert up.numel() * 4 + grid.numel() * 12 <= grid_bytes(10, shape) <= 1.5 * (up.numel() * 4 + grid.numel() * 12)
    cfg = config.resolve("digits")
    need = 4 * 1000 * 64 * 4
    monkeypatch.setattr(memory, "available_memory", lambda: 2 * need)
    memory.check_sample_memory(1000, cfg)  # the samples alone fit
    with pytest.raises(SinkflowError, match=r"for its samples and their PNG grid .*; use a smaller --n, or --out "
                                            r"DIR/ \(one PNG per image\) or a \.npy file"):
        memory.check_sample_memory(1000, cfg, grid_bytes=grid_bytes(1000, (1, 8, 8)))


def test_grid_bytes_covers_what_saving_a_grid_takes():
    """grid_bytes counted the float32 grid and its uint8 copy (5 bytes an element), but save_image also makes a
    float32 copy of the grid (grid.mul(255)) and PIL copies the uint8 one: saving 20,000 digits peaked at 2.0 GB
    where 1.26 GB was counted, so the check before sampling passed a grid the machine could not hold. Measured here
    as the peak resident memory a process adds while it saves 3,000 28x28 digits."""
    import subprocess
    import sys

    from sinkflow.eval.images import grid_bytes

    script = (
        "import resource, torch\n"
        "from sinkflow.eval.images import save_grid\n"
        "import sys\n"
        "save_grid(torch.zeros(4, 1, 28, 28), sys.argv[1])\n"  # imports and PIL's first call before the baseline
        "x = torch.rand(3000, 1, 28, 28) * 2 - 1\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "save_grid(x, sys.argv[1])\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", script, f"{tmp}/g.png"], capture_output=True, text=True,
                             check=True, timeout=120)
    rise = int(out.stdout.split()[-1])
    assert rise <= grid_bytes(3000, (1, 28, 28)), (rise, grid_bytes(3000, (1, 28, 28)))


def test_sampling_keeps_one_host_array_not_every_chunk(tiny_run, monkeypatch):
    """`check_sample_memory` plans 16 bytes a sample value (the samples, their source, working copies); sampling in
    chunks of `sample.batch_size` kept every chunk apart for one torch.cat, and the network activations freed between
    them stayed in the heap: 1M moons samples at 2 steps rose the peak RSS by 465-875 MB against the 32 MB planned
    (3 of 4 fresh processes; 30 MB in the fourth), 11 MB filling one array (2026-11-30). Deterministic here: when a
    chunk is sampled, at most the one before it is still alive (old: all of them)."""
    import weakref

    from sinkflow import methods
    from sinkflow.eval.points import sample_chunks
    from sinkflow.runtime.run_folder import RunFolder

    run = RunFolder.open(tiny_run).variant(sample={"batch_size": 8})
    method, alive, outs = methods.of(run.cfg), [], []
    plain = method.sample

    def sample(*args, **kwargs):
        alive.append(sum(o() is not None for o in outs))
        x, info = plain(*args, **kwargs)
        outs.append(weakref.ref(x))
        return x, info

    monkeypatch.setattr(type(method), "sample", staticmethod(sample))
    x, _ = sample_chunks(run, torch.randn(80, 2), 2)
    assert x.shape == (80, 2) and len(alive) == 10 and max(alive) <= 1, alive


def test_sample_on_a_run_still_training_says_to_wait_not_to_resume(run, capsys, tmp_path):
    """`sample` / `eval` on a run another process was training said "finish it with `sinkflow train --resume`",
    which the run's lock then refused. A held lock now says the run is still training, with the holder's pid."""
    import socket
    import subprocess
    import sys

    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    rc, err = run_main(capsys, "sample", str(run), "--n", "8", "--out", str(tmp_path / "s.npy"))
    one_line(rc, err, "phase 'velocity'", "has not finished",  # as launched: the run was trained with --no-report
             f"finish it with `sinkflow train --resume {run} --no-report`")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from sinkflow.runtime.lock import lock_run; "
                               "lock_run(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(run)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for argv in (["sample", str(run), "--n", "8", "--out", str(tmp_path / "s.npy")], ["eval", str(run)]):
            rc, err = run_main(capsys, *argv)
            one_line(rc, err, "has not finished",
                     f"it is still training (pid {holder.pid} on {socket.gethostname()}): wait for it to finish")
    finally:
        holder.kill()
        holder.wait()


def test_a_finished_pool_with_arrays_of_another_shape_is_refused_before_the_folder_changes(run, capsys):
    """A finished pool's arrays were checked to load, not to fit the run: another run's pool copied in trained the
    next phase on it (or failed inside it)."""
    import numpy as np

    x = np.load(run / "pool" / "x.npy")
    np.save(run / "pool" / "x.npy", np.concatenate([x, x]))
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    before = bytes_snapshot(run)
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    one_line(rc, err, "x.npy holds float32", f"but this run's pool needs float32 {x.shape}", "the later phases'")
    assert bytes_snapshot(run) == before


def test_a_file_size_limit_while_creating_the_pool_names_the_file(run, capsys, monkeypatch):
    """numpy's open_memmap raises an OSError without a file name: the line said "EFBIG File too large" and no path."""
    import errno

    import numpy as np

    def too_large(*a, **k):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(np.lib.format, "open_memmap", too_large)
    _unbuilt(run, keep=())
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc != 0 and "File too large" in err and str(run / "pool" / "x.npy") in err and "Traceback" not in err, err


def test_a_resume_is_not_refused_for_the_disk_its_own_pool_holds(tiny_run, tmp_path, monkeypatch, capsys):
    """A resume ran the new-run free-disk check against experiment.runs_dir, where the run's own pool arrays count as
    used: a run whose pool filled most of the disk could never be resumed. The pool checks its free disk when it
    opens (counting its arrays); a finished pool needs none."""
    from collections import namedtuple

    from sinkflow.methods import pool

    run = tmp_path / "runs" / "base"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    monkeypatch.chdir(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**20, 2**20 - 16, 16))  # 16 bytes left
    assert main(["train", "--resume", str(run), "--no-report"]) == 0, capsys.readouterr().err
    assert (run / "checkpoints" / "velocity" / "final.pt").is_file()


def test_the_disk_plan_of_nsgfpp_counts_the_nsgf_states_it_keeps(tmp_path, monkeypatch):
    """With nsgf.nsf_source=velocity NSGF++ keeps RUN/nsf_states.npy (201 MB on CIFAR-10 at the default 16,384
    states), which the disk plan left out: a disk with room for the pool and checkpoints alone stopped the run when
    the straight-flow phase opened, after the pool and the velocity network. The plan's bytes are the file's."""
    from collections import namedtuple

    import numpy as np

    from sinkflow import config, methods
    from sinkflow.errors import SinkflowError
    from sinkflow.methods import nsgfpp, pool
    from sinkflow.methods.base import checkpoint_bytes

    shape, usage = (3, 32, 32), namedtuple("usage", "total used free")
    cfg = config.resolve("cifar10", ["experiment.method=nsgfpp", "nsgf.nsf_source=velocity", "nsgf.nsf_t_min=0",
                                     f"experiment.runs_dir={tmp_path}"])
    states = nsgfpp.states_bytes(cfg, shape)
    np.save(tmp_path / "s.npy", np.zeros((cfg["nsgf"]["nsf_states"], *shape), np.float32), allow_pickle=False)
    assert states == (tmp_path / "s.npy").stat().st_size
    free = pool.pool_bytes(cfg["pool"], shape) + checkpoint_bytes(cfg, shape) + states // 2
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**40, 2**40 - free, free))
    with pytest.raises(SinkflowError, match="the NSGF states 192.0 MiB"):
        methods.of(cfg).check_machine(cfg, shape)
    noise = {**cfg, "nsgf": {**cfg["nsgf"], "nsf_source": "noise"}}
    methods.of(noise).check_machine(noise, shape)  # from noise: no states file, and the same disk holds the run
