"""The run folder can be trusted (issue 9, docs/reliability.md): safe checkpoint loading, no poisoned
"last good" checkpoint, resume refuses what does not belong to the run, final.pt is checked, one writer
per run folder, bad input leaves the folder untouched, no tracebacks, housekeeping."""

import errno
import json
import os
import re
import resource
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

from helpers import TINY_2D, cli, nan_gradient_phase, read_only, run_main, snapshot, train_in
from helpers import error_line as one_line
import sinkflow
from sinkflow import config as config_mod
from sinkflow.cli import main
from sinkflow.errors import SinkflowError
from sinkflow.runtime.run_folder import RunFolder


def full_snapshot(run):
    """snapshot() plus the heartbeat's bytes: a failed resume must not reset status.json either."""
    return snapshot(run), (run / "status.json").read_bytes(), (run / "config.yaml").read_bytes()


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    return train_in(tmp_path_factory.mktemp("safety"), ["moons", *TINY_2D, "--name", "base", "--no-report"],
                    ["moons", *TINY_2D, "--seed", "1", "--name", "other", "--no-report"])


@pytest.fixture
def run(base_run, tmp_path, monkeypatch):
    """A private copy of the finished tiny moons run (pool + velocity, steps 3 and 6, final)."""
    monkeypatch.chdir(tmp_path)
    dst = tmp_path / "runs" / "r"
    shutil.copytree(base_run / "base", dst)
    return dst


# ---- 1. loading a checkpoint never runs code ----------------------------------------------------------

class CreatesFile:
    """Unpickling this calls open(path, "w"): the file appears if the loader runs code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def poison(path, marker):
    torch.save({"format": 2, "step": 6, "final": True, "model": CreatesFile(marker)}, path)


@pytest.mark.parametrize("command", ["sample", "eval", "resume-final", "resume-step", "doctor", "lr-find"])
def test_checkpoint_that_would_run_code_is_refused_by_every_command(run, tmp_path, capsys, command):
    marker = tmp_path / "created-by-unpickling"
    ck = run / "checkpoints" / "velocity"
    for p in ck.glob("*.pt"):
        poison(p, marker)
    if command == "resume-step":
        (ck / "final.pt").unlink()
    argv = {"sample": ["sample", str(run), "--n", "4", "--out", str(tmp_path / "s.npy")],
            "eval": ["eval", str(run)],
            "resume-final": ["train", "--resume", str(run), "--no-report"],
            "resume-step": ["train", "--resume", str(run), "--no-report"],
            "doctor": ["doctor", str(run), "--steps", "2"],
            "lr-find": ["lr-find", str(run), "--steps", "3", "--out", str(tmp_path / "lr.png")]}[command]
    one_line(*run_main(capsys, *argv), "refused", "could run code")
    assert not marker.exists()


def test_plain_pickle_is_refused_and_checkpoints_load_weights_only(tmp_path):
    import pickle

    from sinkflow.runtime.checkpoint import load

    marker = tmp_path / "m"
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"format": 1, "x": CreatesFile(marker)}))
    with pytest.raises(SinkflowError, match="refused|corrupt"):
        load(tmp_path / "legacy.pt")
    assert not marker.exists()


def test_a_variant_samples_otherwise_and_leaves_the_run_as_it_was(tiny_run):
    """RunFolder.variant (how sinkflow tune scores many samplers): the view samples with its own sample.* values and
    shares the networks already loaded; the run's config, its networks and config.yaml stay as they were."""
    from sinkflow.eval.points import generate

    on_disk = (tiny_run / "config.yaml").read_bytes()
    run = RunFolder.open(tiny_run)
    cfg = config_mod.dump(run.cfg)
    net = run.model("velocity")
    view = run.variant(sample={"time_warp": 0.5}, eval={"n": 7})
    assert (view.cfg["sample"]["time_warp"], view.cfg["eval"]["n"]) == (0.5, 7)
    assert config_mod.dump(run.cfg) == cfg and view.model("velocity") is net
    warped, plain = generate(view, 16, 3, seed=0)[0], generate(run, 16, 3, seed=0)[0]
    assert not torch.equal(warped, plain)
    assert torch.equal(generate(run.variant(sample={"time_warp": 0.5}), 16, 3, seed=0)[0], warped)
    zero = torch.nn.Identity()
    swapped = run.variant(models={"velocity": zero})
    assert swapped.model("velocity") is zero and run.model("velocity") is net
    assert (tiny_run / "config.yaml").read_bytes() == on_disk


def test_sinkflow_checkpoints_load_with_weights_only(base_run):
    for p in (base_run / "base" / "checkpoints").rglob("*.pt"):
        obj = torch.load(p, weights_only=True)  # RNG states and metadata are plain data too
        assert obj["identity"]["phase"] == p.parent.name and isinstance(obj["step"], int)


# ---- 2. the last good checkpoint is good -------------------------------------------------------------

@pytest.mark.parametrize("bad_step,kept", [(6, "step_00000004.pt (step 4) is kept"), (1, "no checkpoint")])
def test_non_finite_gradient_is_never_applied_nor_checkpointed(runs_dir, bad_step, kept):
    from sinkflow import config
    from sinkflow.runtime.checkpoint import load
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.engine.trainer import Trainer

    cfg = config.resolve("moons", ["experiment.method=fm", "train.velocity.iters=8", "train.velocity.ckpt_every=2",
                                   "train.velocity.log_every=1", "experiment.device=cpu", "experiment.name=nan"])
    run = RunFolder.create(cfg)
    with pytest.raises(SinkflowError) as e:
        Trainer(run, nan_gradient_phase(cfg, bad_step)).fit()
    msg = str(e.value)
    assert "non-finite gradient norm" in msg and f"step {bad_step}" in msg and kept in msg, msg
    ck = run.dir / "checkpoints" / "velocity"
    assert not (ck / "final.pt").exists()
    for p in ck.glob("*.pt"):
        assert all(torch.isfinite(t).all() for t in load(p)["model"].values()), p
    assert sorted(p.name for p in ck.glob("step_*.pt")) == (["step_00000002.pt", "step_00000004.pt"][: (bad_step - 1) // 2]
                                                      if bad_step > 2 else [])
    run.logger.close()


def test_a_non_finite_checkpoint_is_never_written(tmp_path):
    from sinkflow.runtime.checkpoint import PhaseCheckpoints

    ck = PhaseCheckpoints(tmp_path / "p")
    ck.save({"model": {"w": torch.ones(3)}}, 1)
    with pytest.raises(SinkflowError, match="model.w holds NaN or Inf"):
        ck.save({"model": {"w": torch.tensor([1.0, float("nan")])}}, 2)
    with pytest.raises(SinkflowError, match="NaN or Inf"):
        ck.save_final({"ema": {"w": torch.tensor([float("inf")])}})
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["step_00000001.pt"]


# ---- 3. resume refuses what does not belong to the run -----------------------------------------------

@pytest.mark.parametrize("override,key", [(["pool.eta=0.05"], "pool.eta"), (["pool.eta_growth=4.0"], "pool.eta_growth"),
                                          (["sinkhorn.blur=0.3"], "sinkhorn.blur"), (["--seed", "3"], "experiment.seed"),
                                          (["pool.batch_size=16"], "pool.batch_size"),
                                          (["data.target=scurve"], "data.target"),
                                          (["pool.schedule=constant"], "pool.schedule"),
                                          (["nsgf.time=flow"], "nsgf.time"),
                                          (["model.velocity.depth=2"], "model.velocity.depth")])
def test_resume_refuses_a_key_that_shaped_an_artifact(run, capsys, override, key):
    before = full_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), *override, "--no-report"), "cannot resume", key)
    assert full_snapshot(run) == before



@pytest.mark.parametrize("override", [["--name", "other"], ["experiment.runs_dir=/tmp/elsewhere"]])
def test_a_resume_neither_renames_nor_moves_its_folder(run, capsys, override):
    """`--resume RUN --name other` was applied and recorded (config.yaml: name other) while the run stayed in RUN."""
    before = full_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), *override, "--no-report"), "does not rename or move",
             "cp -r")
    assert full_snapshot(run) == before


def test_a_shorthand_on_a_resume_reaches_the_phases_still_to_train(runs_dir, capsys):
    """`--resume RUN --train-iters 9` on NSGF++ stopped in its nsf phase was refused ("train.velocity.iters: phase
    'velocity' has finished ... drop that override"), an override the user never wrote: the shorthand now sets the
    unfinished phases' keys and leaves the finished one's as trained; a named override of it is still refused."""
    tiny = [a for a in TINY_2D if not a.startswith("eval.steps")]
    assert main(["train", "moons", *tiny, "--method", "nsgfpp", "--name", "pp", "--no-report"]) == 0
    run = runs_dir / "pp"
    # a data key names the first artifact it shaped, the pool ('nsf' sorted first: "it shaped the 'nsf' checkpoints")
    one_line(*run_main(capsys, "train", "--resume", str(run), "data.target=scurve", "--no-report"),
             "cannot resume", "data.target", "it shaped the finished pool")
    for phase in ("nsf", "time"):
        shutil.rmtree(run / "checkpoints" / phase)  # stopped before its nsf phase began
    one_line(*run_main(capsys, "train", "--resume", str(run), "train.velocity.iters=9", "--no-report"),
             "train.velocity.iters", "has finished")
    before = config_mod.flatten(RunFolder.open(run).cfg)
    rc, err = run_main(capsys, "train", "--resume", str(run), "--train-iters", "9", "--no-report")
    assert rc == 0, err
    after = config_mod.flatten(RunFolder.open(run).cfg)
    assert (after["train.velocity.iters"], after["train.nsf.iters"], after["train.time.iters"]) == (6, 9, 9)
    assert torch.load(run / "checkpoints/nsf/final.pt", weights_only=True)["step"] == 9
    changes = __import__("json").loads((run / "meta.json").read_text())["changes"]
    assert sorted(c["key"] for c in changes) == ["train.nsf.iters", "train.time.iters"]
    # config.yaml changed only what meta.json records: not the keys of phases NSGF++ has not (train.flow.iters)
    assert sorted(k for k in after if after[k] != before[k]) == ["train.nsf.iters", "train.time.iters"]


def test_a_shorthand_on_a_finished_run_changes_nothing(run, capsys):
    """`--resume FINISHED --train-iters 40` rewrote in config.yaml the iters of phases the method has not
    (nsf, time, flow for NSGF), with no record in meta.json."""
    before = (run / "config.yaml").read_text()
    rc, err = run_main(capsys, "train", "--resume", str(run), "--train-iters", "40", "--no-report")
    assert rc == 0, err
    assert (run / "config.yaml").read_text() == before
    assert "changes" not in __import__("json").loads((run / "meta.json").read_text())

@pytest.mark.parametrize("damage", ['{"chunks": [0', "null", "[]", '{"chunks": ["x"]}'])
def test_a_damaged_pool_progress_is_one_line(run, capsys, damage):
    """A half-built pool's progress.json cut short was one line; one that reads as JSON but is no record (`null`, a
    list, chunks of text) was a traceback ("'NoneType' object has no attribute 'get'"). Both are the same line, the
    folder untouched, and its fix (delete it) rebuilds the pool."""
    shutil.rmtree(run / "checkpoints")  # the pool files and progress.json are there, no final.pt yet
    (run / "pool" / "progress.json").write_text(damage)
    before = full_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "progress.json is damaged",
             "delete it to rebuild the pool")
    assert full_snapshot(run) == before
    (run / "pool" / "progress.json").unlink()
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc == 0, err


def test_half_built_pool_freezes_its_keys_and_chunking(run, capsys):
    shutil.rmtree(run / "checkpoints")  # the pool files and progress.json are there, no final.pt yet
    before = snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "pool.eta=0.05", "--no-report"), "pool.eta", "half-built")
    one_line(*run_main(capsys, "train", "--resume", str(run), "pool.chunk=2", "--no-report"), "pool.chunk")
    assert snapshot(run) == before
    rc, err = run_main(capsys, "train", "--resume", str(run), "pool.in_flight=1", "--no-report")  # runtime only
    assert rc == 0, err


def test_resume_accepts_runtime_and_training_keys_and_writes_them(run, capsys):
    (run / "checkpoints" / "velocity" / "final.pt").unlink()  # velocity resumes from step 6: its lr can change
    rc, err = run_main(capsys, "train", "--resume", str(run), "pool.storage=disk", "train.velocity.lr=0.002",
                       "--no-report")
    assert rc == 0, err
    assert "lr: 0.002" in (run / "config.yaml").read_text()


def test_a_damaged_meta_json_is_kept_aside_not_written_over(run, capsys, caplog):
    """A resume's changes were written over a meta.json cut short: the seed, versions and command line it still held
    were lost without a word."""
    meta = run / "meta.json"
    cut = meta.read_bytes()[: meta.stat().st_size // 2]
    meta.write_bytes(cut)
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    with caplog.at_level("WARNING", logger="sinkflow"):
        rc, err = run_main(capsys, "train", "--resume", str(run), "train.velocity.lr=0.002", "--no-report")
    assert rc == 0, err
    assert (run / "meta.damaged.json").read_bytes() == cut and "kept as meta.damaged.json" in caplog.text
    changes = json.loads(meta.read_text())["changes"]
    assert [(c["key"], c["to"]) for c in changes] == [("train.velocity.lr", 0.002)]


@pytest.mark.parametrize("out", ["pool/x.npy", "checkpoints/velocity/x.png", "tb/", "nsf_states.npy", "samples.npy"])
def test_sample_never_writes_over_the_runs_own_files(run, capsys, out):
    """`sample --out RUN/pool/x.npy` replaced the pool: status said FINISHED, and the resume after it failed on an
    array of another shape; `--out RUN/nsf_states.npy` so replaced NSGF++'s straight-flow states (a resumed phase,
    lr-find and doctor read them again). Beside the run's state (RUN/samples.npy) it writes as asked."""
    from sinkflow.methods.nsgfpp import STATES_FILE
    from sinkflow.runtime.run_folder import RUN_STATE

    assert STATES_FILE in RUN_STATE
    before = full_snapshot(run)
    argv = ["sample", str(run), "--n", "4", "--steps", "2", "--out", str(run / out)]
    if out == "samples.npy":
        assert run_main(capsys, *argv)[0] == 0 and (run / out).is_file()
        return
    one_line(*run_main(capsys, *argv), "is in the run's own", "which samples would replace")
    assert full_snapshot(run) == before


def test_eval_refuses_sample_steps_it_would_record_but_not_use(run, capsys):
    """`eval RUN sample.steps=2` scored at eval.steps and recorded {"sample": {"steps": 2}} with the scores."""
    before = full_snapshot(run)
    one_line(*run_main(capsys, "eval", str(run), "--seeds", "1", "--n", "8", "sample.steps=2"),
             "scores at the run's eval.steps, so 'sample.steps=2' would not be used", "'eval.steps=[2, 10]'")
    assert full_snapshot(run) == before


def test_eval_refuses_sample_qmc_it_would_record_but_not_use(run, capsys):
    """`eval RUN sample.qmc=true` drew as eval.protocol says, scored the same numbers, and recorded them as
    {"sample": {"qmc": true}}."""
    before = full_snapshot(run)
    one_line(*run_main(capsys, "eval", str(run), "--seeds", "1", "--n", "8", "sample.qmc=true"),
             "draws its source as the run's eval.protocol says, so 'sample.qmc=true' would not be used",
             "eval.protocol=iid")
    assert full_snapshot(run) == before


def test_sample_out_under_a_file_or_a_folder_for_points_names_the_real_problem(run, tmp_path, capsys):
    """`--out s.png/x.npy` said "EEXIST File exists (s.png)"; `--out existing_dir` on a 2D run spoke of images
    mixing with the folder's files (a new folder name got "this run draws points")."""
    (tmp_path / "s.png").write_bytes(b"x")
    one_line(*run_main(capsys, "sample", str(run), "--out", str(tmp_path / "s.png" / "x.npy")),
             "s.png is a file, not a folder")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "a.txt").write_text("a")
    one_line(*run_main(capsys, "sample", str(run), "--out", str(tmp_path / "used")), "but this run draws points")


@pytest.mark.parametrize("name", ["s.npy", "s.png"])
def test_sample_out_naming_a_folder_as_a_file_is_refused_before_sampling(run, tmp_path, capsys, monkeypatch, name):
    """`--out s.npy` naming an existing folder drew every sample, then stopped on "EISDIR Is a directory
    (.s.npy.tmp-...)", a temporary file the user never named."""
    from sinkflow.eval import points

    (tmp_path / name).mkdir()
    monkeypatch.setattr(points, "sample_chunks", lambda *a, **k: pytest.fail("sampled before the refusal"))
    one_line(*run_main(capsys, "sample", str(run), "--out", str(tmp_path / name)),
             f"{name} is a folder, not a {name[1:]} file", f"--out {tmp_path / name / ('samples' + name[1:])}")
    assert not any((tmp_path / name).iterdir())


def test_checkpoint_from_another_run_is_refused(run, base_run, capsys, tmp_path):
    ck = run / "checkpoints" / "velocity"
    (ck / "final.pt").unlink()
    shutil.copy(base_run / "other/checkpoints/velocity/step_00000006.pt", ck / "step_00000006.pt")
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "step_00000006.pt", "experiment.seed")
    shutil.copy(base_run / "other/checkpoints/velocity/final.pt", ck / "final.pt")
    one_line(*run_main(capsys, "sample", str(run), "--n", "4", "--out", str(tmp_path / "s.npy")),
             "final.pt", "experiment.seed")


def test_checkpoint_whose_step_is_not_its_name_is_refused(run, capsys):
    ck = run / "checkpoints" / "velocity"
    (ck / "final.pt").unlink()
    (ck / "step_00000006.pt").rename(ck / "step_00000009.pt")
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "holds step 6", "step_00000009.pt")


def test_checkpoint_of_another_phase_is_refused(run, capsys, tmp_path):
    shutil.copy(run / "checkpoints/pool/final.pt", run / "checkpoints/velocity/final.pt")
    one_line(*run_main(capsys, "eval", str(run)), "is phase 'pool', not 'velocity'")


# ---- 4. final.pt is checked, not trusted -------------------------------------------------------------

def test_truncated_final_is_reported_not_skipped_as_done(run, capsys):
    final = run / "checkpoints" / "velocity" / "final.pt"
    final.write_bytes(final.read_bytes()[:1000])
    before = full_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "final.pt", "corrupt or truncated",
             "delete it")
    assert full_snapshot(run) == before
    final.unlink()  # the fix the message gives: the phase resumes from its last step checkpoint
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc == 0, err
    assert torch.load(final, weights_only=True)["step"] == 6


def test_a_checkpoint_overwritten_with_random_bytes_is_damaged_not_a_refusal_to_run_code(run, capsys):
    """Random bytes over a checkpoint (a disk fault) read as pickle opcodes ("Unsupported operand 95"): the refusal
    said "loading it could run code ... start a new run", where deleting it resumes from the step before."""
    ck = run / "checkpoints" / "velocity"
    (ck / "final.pt").unlink()
    step = ck / "step_00000006.pt"
    step.write_bytes(np.random.default_rng(0).integers(0, 256, step.stat().st_size, dtype=np.uint8).tobytes())
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "step_00000006.pt is corrupt or "
             "truncated", "delete it to resume from the previous checkpoint (step_00000003.pt)")


def test_truncated_pool_final_is_reported(run, capsys):
    final = run / "checkpoints" / "pool" / "final.pt"
    final.write_bytes(final.read_bytes()[:100])
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "pool/final.pt", "corrupt or truncated")


@pytest.mark.parametrize("command", ["resume", "sample", "eval", "config-file"])
def test_a_config_cut_short_is_refused_not_read_with_defaults(run, tmp_path, capsys, command):
    """A copy of config.yaml cut at a line boundary is still valid YAML; read, its lost keys (the sampler's here)
    would take the schema's defaults in silence. Its missing end line refuses it, and nothing is written."""
    path = run / "config.yaml"
    lines = path.read_text().splitlines(keepends=True)
    assert lines[0].startswith("# sinkflow run config") and lines[-1] == "...\n"
    path.write_text("".join(lines[:len(lines) // 2]))
    before = full_snapshot(run)
    argv = {"resume": ["train", "--resume", str(run), "--no-report"],
            "sample": ["sample", str(run), "--n", "4", "--out", str(tmp_path / "s.npy")],
            "eval": ["eval", str(run)],
            "config-file": ["train", str(path), "--name", "again", "--no-report"]}[command]
    one_line(*run_main(capsys, *argv), "config.yaml is cut short", "copy the run folder again")
    assert full_snapshot(run) == before and not (tmp_path / "s.npy").exists()


@pytest.mark.parametrize("damage, needles", [
    ("yaml", ("config.yaml is not valid YAML (line", "fix it there by hand")),
    ("bytes", ("config.yaml is not valid YAML (neither UTF-8 nor UTF-16 text)", "fix it there by hand")),
    ("value", ("config.yaml, line ", ": config key 'train.velocity.lr'", "edit that file (")),
    ("deleted", ("has lost its config.yaml", "meta.json's argv is the command that made it"))])
def test_a_damaged_config_names_a_fix_that_works(run, capsys, damage, needles):
    """Their fixes sent users the wrong way: "restore it from the run's first lines of output" (they hold no config),
    `--resume RUN train.velocity.lr=0.001` (the file is read before any override), "not a sinkflow run folder" for a
    folder with its checkpoints and meta.json."""
    path = run / "config.yaml"
    text = path.read_text()
    if damage == "yaml":
        lines = text.splitlines(keepends=True)
        path.write_text("".join(lines[:2]) + "  bad: [unclosed\n" + "".join(lines[2:]))
    elif damage == "bytes":  # a disk fault, or a file saved in another encoding: was a UnicodeDecodeError traceback
        path.write_bytes(text.encode()[:40] + b"\xff\xfe" + text.encode()[40:])
    elif damage == "value":
        path.write_text(text.replace("lr: 0.001", "lr: -1", 1) if "lr: 0.001" in text else
                        re.sub(r"(\n    lr: )[^\n]+", r"\1-1", text, count=1))
    else:
        path.unlink()
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), *needles)


def test_a_config_without_the_marks_is_read_as_it_is(run, tmp_path, capsys):
    """A run made before config.yaml was marked (or a file rewritten by hand without the marks) reads as before."""
    path = run / "config.yaml"
    path.write_text(path.read_text().split("\n", 1)[1].removesuffix("...\n"))
    for argv in (["sample", str(run), "--n", "4", "--out", str(tmp_path / "s.npy")], ["eval", str(run)]):
        rc, err = run_main(capsys, *argv)
        assert rc == 0, err


# ---- 5. one writer per run folder --------------------------------------------------------------------

def test_second_writer_is_refused_and_a_dead_holder_does_not_block(tmp_path):
    from sinkflow.runtime.lock import lock_run, unlock_run

    env = {**os.environ, "SINKFLOW_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    args = ["moons", *TINY_2D, "--train-iters", "1000000", "train.velocity.ckpt_every=50", "--no-report"]
    proc = subprocess.Popen([sys.executable, "-m", "sinkflow", "train", *args, "--name", "w"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "runs" / "w"
    try:
        end = time.time() + 120
        while time.time() < end and not list((run / "checkpoints" / "velocity").glob("step_*.pt")):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        before = (run / "config.yaml").read_bytes()
        second = cli("train", "--resume", str(run), "train.velocity.lr=0.5", "--no-report", cwd=tmp_path)
        one_line(second.returncode, second.stderr, "in use", f"pid {proc.pid}")
        assert (run / "config.yaml").read_bytes() == before
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock_run(run)  # the kernel dropped the dead holder's lock: nothing stale to clean up
    unlock_run(run)


def test_a_deleted_lock_file_is_taken_again_or_the_second_writer_stops_the_first(tmp_path):
    """Deleting RUN/.lock while a run held it let a second `train --resume` in: both wrote every checkpoint and
    metrics line of the same steps. Before each checkpoint the holder checks its lock file: it takes the lock again
    when nobody else has, and stops in one line when another process has."""
    from sinkflow.errors import SinkflowError
    from sinkflow.runtime.checkpoint import PhaseCheckpoints
    from sinkflow.runtime.lock import LOCK_NAME, lock_run, unlock_run

    run = tmp_path / "r"
    ckpts = PhaseCheckpoints(run / "checkpoints" / "velocity")
    (run / "checkpoints").mkdir(parents=True)
    lock_run(run)
    try:
        (run / LOCK_NAME).unlink()
        ckpts.save({"model": {}}, 1)  # nobody else: the lock is taken again, on a new file
        assert (run / LOCK_NAME).read_text().strip() == f"{os.getpid()}@{socket.gethostname()}"
        other = subprocess.run([sys.executable, "-c", "import sys; from sinkflow.runtime.lock import lock_run; "
                                "lock_run(sys.argv[1])", str(run)], capture_output=True, text=True)
        assert other.returncode != 0 and "in use by another sinkflow process" in other.stderr
        (run / LOCK_NAME).unlink()
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from sinkflow.runtime.lock import lock_run; "
                                   "lock_run(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(run)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            here = socket.gethostname()
            with pytest.raises(SinkflowError, match=f"in use by another sinkflow process \\(pid {holder.pid} on "
                                                    f"{re.escape(here)}\\).*stop it \\(kill {holder.pid}\\)"):
                ckpts.save({"model": {}}, 2)
            assert not (run / "checkpoints" / "velocity" / "step_00000002.pt").exists()
            # held from another node of a shared disk: a `kill` here would hit another process
            (run / LOCK_NAME).write_text(f"{holder.pid}@node7\n")
            with pytest.raises(SinkflowError, match=f"\\(pid {holder.pid} on node7\\).*stop it on node7 \\(kill "
                                                    f"{holder.pid} there\\)"):
                lock_run(run / ".." / run.name)
        finally:
            holder.kill()
            holder.wait()
    finally:
        unlock_run(run)


# ---- 6. bad input leaves the run folder untouched ----------------------------------------------------

def test_bad_device_on_a_new_run_creates_no_folder(runs_dir, capsys):
    one_line(*run_main(capsys, "train", "moons", *TINY_2D, "--device", "cuda:7", "--name", "dev"), "cuda:7")
    assert not (runs_dir / "dev").exists()
    one_line(*run_main(capsys, "train", "moons", *TINY_2D, "--device", "tpu", "--name", "dev"), "tpu")
    assert not (runs_dir / "dev").exists()


def test_bad_device_on_resume_is_not_written(run, capsys):
    before = full_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "--device", "cuda:7", "--no-report"), "cuda:7")
    assert full_snapshot(run) == before
    rc, err = run_main(capsys, "sample", str(run), "--n", "4", "--out", "s.npy")  # every later command still works
    assert rc == 0, err


def test_failed_resume_keeps_status_and_config(run, capsys):
    ck = run / "checkpoints" / "velocity"
    (ck / "final.pt").unlink()
    step = ck / "step_00000006.pt"
    step.write_bytes(step.read_bytes()[:200])
    before = full_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "train.velocity.lr=0.5", "--no-report"),
             "corrupt or truncated")
    assert full_snapshot(run) == before



def refusing_writes(folder, monkeypatch):
    """``folder`` refuses new files (``helpers.read_only``); where no real way exists here, its file creation fails
    as it would (EACCES)."""
    undo = read_only(folder)
    if undo is not None:
        return undo
    import tempfile

    real = tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and os.path.samefile(dir, folder):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    return lambda: None


def test_a_resume_into_a_read_only_checkpoints_folder_stops_before_any_step(run, capsys, monkeypatch):
    """The phase's checkpoints folder takes no new file: the resume is one line naming it before the phase trains
    (it failed at the first checkpoint, after the steps it was to keep, with the advice to use another folder)."""
    (run / "checkpoints/velocity/final.pt").unlink()
    folder = run / "checkpoints" / "velocity"
    before = full_snapshot(run)
    undo = refusing_writes(folder, monkeypatch)
    try:
        line = one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), str(folder), "writable")
    finally:
        undo()
    assert "nothing in the run was changed" in line
    assert full_snapshot(run) == before
    monkeypatch.undo()
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")  # writable again: it finishes
    assert rc == 0, err
    assert (folder / "final.pt").is_file()


def test_resume_refuses_a_point_file_whose_points_changed(tmp_path, monkeypatch, capsys):
    """A run on the user's points.csv records a hash of its points; a resume after the file was rewritten with other
    points is one line before anything is written (the finished phases trained on the old ones), one with the same
    values in another layout resumes, and a new run on the new points is what the fix says."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(64, 2))
    np.savetxt("pts.csv", pts, delimiter=",", header="x,y", comments="")
    assert main(["train", "moons", *TINY_2D, "data.target=pts.csv", "--name", "p", "--no-report"]) == 0
    run = tmp_path / "runs" / "p"
    split = __import__("json").loads((run / "data_split.json").read_text())
    assert split["points"] == str(tmp_path / "pts.csv") and split["rows"] == 64 and len(split["points_sha256"]) == 64
    (run / "checkpoints" / "velocity" / "final.pt").unlink()  # velocity resumes from its last step checkpoint
    np.savetxt("pts.csv", pts + 0.5, delimiter=",")
    before = full_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "--no-report"), "cannot resume", "pts.csv",
             "points_sha256", "data changed")
    assert full_snapshot(run) == before
    np.savetxt("pts.csv", pts, delimiter=",", fmt="%.17g")  # the same values, no header, another format
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc == 0, err


def test_a_damaged_data_record_is_refused_not_written_over(tmp_path, monkeypatch, capsys):
    """A data_split.json cut short (a disk fault, an interrupted copy) was read as no record: a resume on rewritten
    points went on without a word and wrote the new points' hash over it. It is one line naming the file, before
    anything is written, for a resume and for eval; deleting it (the fix, when the data is the run's) resumes."""
    monkeypatch.chdir(tmp_path)
    np.save("pts.npy", np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32))
    assert main(["train", "moons", *TINY_2D, "data.target=pts.npy", "--name", "p", "--no-report"]) == 0
    run = tmp_path / "runs" / "p"
    record = run / "data_split.json"
    record.write_text(record.read_text()[:40])
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    np.save("pts.npy", np.random.default_rng(1).normal(size=(64, 2)).astype(np.float32))
    before = full_snapshot(run)
    for argv in (["train", "--resume", str(run), "--no-report"], ["eval", str(run), "--n", "8", "--seeds", "1"]):
        one_line(*run_main(capsys, *argv), "data_split.json is damaged", "restore it")
        assert full_snapshot(run) == before
    record.unlink()
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc == 0 and record.is_file(), err


def test_a_run_whose_point_file_moved_names_its_new_place_once(tmp_path, monkeypatch, capsys):
    """A project folder renamed, a run copied to another machine: the run's config.yaml names its point file by the
    old absolute path, and the only way back was a link at that path (`train --resume data.target=NEW` was refused
    as a frozen key, and the checkpoints' identities named the old path). A resume names the new place: the points
    are checked against RUN/data_split.json's hash, config.yaml and meta.json record the move, eval and sample read
    it there, an unfinished phase continues from its checkpoint; another file with other points is refused."""
    import json
    import shutil

    monkeypatch.chdir(tmp_path)
    np.save("pts.npy", np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32))
    assert main(["train", "moons", *TINY_2D, "data.target=pts.npy", "--name", "p", "--no-report"]) == 0
    run = tmp_path / "runs" / "p"
    shutil.copytree(run, tmp_path / "runs" / "q")
    (tmp_path / "moved").mkdir()
    shutil.move("pts.npy", "moved/pts.npy")
    line = one_line(*run_main(capsys, "eval", str(run)), f"point file {tmp_path / 'pts.npy'} does not exist")
    assert "`sinkflow train --resume RUN data.target=NEW_PATH --no-report`" in line, line

    np.save("other.npy", np.load("moved/pts.npy") + 1)  # not the run's points: refused, nothing written
    before = full_snapshot(run)
    line = one_line(*run_main(capsys, "train", "--resume", str(run), "data.target=other.npy", "--no-report"),
                    "cannot resume", "data changed", "points_sha256")
    assert f"{tmp_path / 'other.npy'}, not the data recorded for {tmp_path / 'pts.npy'}" in line, line
    assert full_snapshot(run) == before

    rc, err = run_main(capsys, "train", "--resume", str(run), "data.target=moved/pts.npy", "--no-report")
    assert rc == 0, err
    new = str(tmp_path / "moved" / "pts.npy")
    assert RunFolder.open(run).cfg["data"]["target"] == new
    assert json.loads((run / "data_split.json").read_text())["points"] == new
    moves = [(c["key"], c["from"], c["to"]) for c in json.loads((run / "meta.json").read_text())["changes"]]
    assert moves == [("data.target", str(tmp_path / "pts.npy"), new)]
    rc, err = run_main(capsys, "eval", str(run), "--n", "16", "--seeds", "1")
    assert rc == 0, err
    assert main(["sample", str(run), "--n", "4", "--out", "s.npy"]) == 0 and np.load("s.npy").shape == (4, 2)

    # an unfinished phase: its step checkpoints were written with the old path and still load
    other = tmp_path / "runs" / "q"
    (other / "checkpoints" / "velocity" / "final.pt").unlink()
    rc, err = run_main(capsys, "train", "--resume", str(other), "data.target=moved/pts.npy", "--no-report")
    assert rc == 0, err
    assert (other / "checkpoints" / "velocity" / "final.pt").is_file()
    # a change of which data (a file for a built-in distribution's run) is still refused as before
    shutil.rmtree(tmp_path / "runs" / "m", ignore_errors=True)
    assert main(["train", "moons", *TINY_2D, "--name", "m", "--no-report"]) == 0
    one_line(*run_main(capsys, "train", "--resume", str(tmp_path / "runs" / "m"), f"data.target={new}",
                       "--no-report"), "cannot resume", "data.target")


@pytest.mark.parametrize("method", ["nsgf", "otcfm"])
def test_a_point_file_run_copied_without_its_file_samples_the_same(tmp_path, monkeypatch, capsys, method):
    """A 2D run trained on a GPU box, sampled on a laptop it was copied to without its point file: sampling draws
    from the source alone, so the shape RUN/data_split.json records serves (3-D points here); the samples are bit
    for bit the ones drawn with the file, a scatter shows them alone. eval still needs the points; a run whose
    missing file is its source, or whose record predates the shape, names the file as before."""
    import sinkflow

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    np.save("pts.npy", rng.normal(size=(64, 3)).astype(np.float32) * [1, 3, 0.5])
    np.save("src.npy", rng.normal(size=(64, 3)).astype(np.float32))
    tiny = TINY_2D if method == "nsgf" else [a for a in TINY_2D if not a.startswith("pool.")]
    for name, extra in (("p", []), ("s", ["data.source=src.npy"])):
        assert main(["train", "moons", *tiny, "data.target=pts.npy", *extra, "--method", method,
                     "--name", name, "--no-report"]) == 0
    run = tmp_path / "runs" / "p"
    assert json.loads((run / "data_split.json").read_text())["shape"] == [3]
    assert main(["sample", str(run), "--n", "8", "--seed", "3", "--out", "here.npy"]) == 0
    os.rename("pts.npy", "elsewhere.npy")
    assert main(["sample", str(run), "--n", "8", "--seed", "3", "--out", "away.npy"]) == 0
    assert np.array_equal(np.load("away.npy"), np.load("here.npy"))
    assert torch.equal(sinkflow.open_run(run).sample(8, seed=3), torch.from_numpy(np.load("here.npy")))
    assert main(["sample", str(run), "--n", "64", "--out", "away.png"]) == 0 and Path("away.png").stat().st_size
    capsys.readouterr()
    missing = f"point file {tmp_path / 'pts.npy'} does not exist"
    one_line(*run_main(capsys, "eval", str(run)), missing)
    os.rename("src.npy", "src-elsewhere.npy")  # the source's points are what sampling draws: still needed
    one_line(*run_main(capsys, "sample", str(tmp_path / "runs" / "s"), "--n", "4", "--out", "s.npy"),
             f"point file {tmp_path / 'src.npy'} does not exist")
    split = json.loads((run / "data_split.json").read_text())
    (run / "data_split.json").write_text(json.dumps({k: v for k, v in split.items() if k != "shape"}))
    one_line(*run_main(capsys, "sample", str(run), "--n", "4", "--out", "old.npy"), missing)
    assert not Path("s.npy").exists() and not Path("old.npy").exists()


def trained_on_point_files(tmp_path, monkeypatch) -> Path:
    """RUN of a tiny moons run trained in ``tmp_path`` (the working folder) from src.npy to tgt.npy, two (64, 2) files
    there."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    np.save("src.npy", rng.normal(size=(64, 2)).astype(np.float32))
    np.save("tgt.npy", rng.normal(size=(64, 2)).astype(np.float32) + 3)
    assert main(["train", "moons", *TINY_2D, "data.source=src.npy", "data.target=tgt.npy", "--name", "p",
                 "--no-report"]) == 0
    return tmp_path / "runs" / "p"


def test_sampling_a_run_whose_source_file_changed_is_refused(tmp_path, monkeypatch, capsys):
    """`sinkflow sample RUN` (and Run.sample) of a run trained from data.source=src.npy pushed the file's points
    through the flow as they are now: rewritten, the samples were of other data without a word, where eval and a resume
    refused (found changing a source file after training, audit WW). A changed target alone is not read by sampling."""
    run = trained_on_point_files(tmp_path, monkeypatch)
    np.save("tgt.npy", np.load("tgt.npy") + 1)
    assert main(["sample", str(run), "--n", "4", "--steps", "2", "--out", "a.npy"]) == 0
    np.save("src.npy", np.load("src.npy") + 1)
    before = full_snapshot(run)
    line = one_line(*run_main(capsys, "sample", str(run), "--n", "4", "--steps", "2", "--out", "b.npy"),
                    "cannot sample", "data changed")
    assert f"{tmp_path / 'src.npy'}: source.points_sha256 differ" in line and "restore the source points" in line
    with pytest.raises(SinkflowError, match="cannot sample"):
        sinkflow.open_run(run).sample(4, steps=2)
    assert not Path("b.npy").exists() and full_snapshot(run) == before
    sinkflow.open_run(run).model("velocity")  # the network alone reads no points


def test_a_changed_source_file_is_named_not_the_target(tmp_path, monkeypatch, capsys):
    """With both source and target point files, a changed source was reported as the target file."""
    run = trained_on_point_files(tmp_path, monkeypatch)
    np.save("src.npy", np.load("src.npy") + 1)
    line = one_line(*run_main(capsys, "eval", str(run)), "cannot evaluate", "data changed")
    assert f"{tmp_path / 'src.npy'}: source.points_sha256 differ" in line, line


@pytest.mark.parametrize("argv", [["doctor", "RUN", "train.velocity.lr=0.5"], ["lr-find", "RUN", "--lr", "0.5"],
                                  ["lr-find", "RUN", "--train-iters", "9"]])
def test_a_tool_on_a_run_folder_refuses_overrides_it_would_drop(run, capsys, argv):
    """doctor and lr-find on a run folder read its own config.yaml: a key or shorthand beside it was ignored in
    silence (the user believed it was checked with it). Refused in one line, nothing written. (``--device`` is
    where the call runs: taken, ``test_doctor_and_lr_find_of_a_cuda_run_run_on_a_cpu_with_device_cpu``.)"""
    before = full_snapshot(run)
    argv = [str(run) if a == "RUN" else a for a in argv]
    line = one_line(*run_main(capsys, *argv), "runs on the run's own config.yaml", "would be ignored")
    assert argv[2] in line
    assert full_snapshot(run) == before


def test_doctor_and_lr_find_of_a_cuda_run_run_on_a_cpu_with_device_cpu(run, capsys, tmp_path):
    """A run trained with `--device cuda` holds it in config.yaml; on a laptop `doctor RUN` and `lr-find RUN` said
    "experiment.device=cuda but CUDA is not available here; use --device cpu or auto", and then refused `--device
    cpu` ("runs on the run's own config.yaml; --device would be ignored"): no way but editing config.yaml. They take
    it now, as sample / eval / tune do: for this call, the run folder unchanged."""
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(re.sub(r"(?m)^(  device: ).*$", r"\1cuda", config))
    before = full_snapshot(run)
    one_line(*run_main(capsys, "lr-find", str(run), "--steps", "5"), "CUDA is not available here", "--device cpu")
    assert main(["lr-find", str(run), "--steps", "8", "--device", "cpu", "--out", str(tmp_path / "lr.png")]) == 0
    assert (tmp_path / "lr.png").is_file()
    code = main(["doctor", str(run), "--steps", "3", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code in (0, 1) and "params in optimizer" in out, out  # 3 steps cannot overfit: a finding, not an error
    assert full_snapshot(run) == before


@pytest.mark.parametrize("override, needles", [
    ("sample.temperature=0.5", ["sample.temperature", "not read by method nsgf", "--method flow"]),  # a flow's key
    ("sample.steps=many", ["sample.steps", "expects int"]),
])
def test_sample_refuses_an_override_the_run_would_not_read_or_cannot_take(run, capsys, tmp_path, override, needles):
    """`sinkflow sample RUN sample.temperature=0.5` on an NSGF run was accepted and ignored (a flow's key), and a
    badly typed value reached the sampler; both are one line, as `sinkflow train` gives them."""
    one_line(*run_main(capsys, "sample", str(run), "--n", "4", override, "--out", str(tmp_path / "s.npy")), *needles)
    assert not (tmp_path / "s.npy").exists()


def test_a_resume_whose_finished_pool_lost_a_file_is_refused_untouched(run, capsys):
    """A deleted pool array was found only after run.start(): status.json reset to 'starting', a change logged in
    meta.json that never took effect. The finished pool's arrays are now checked with the other artifacts."""
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    (run / "pool" / "x.npy").unlink()
    before = full_snapshot(run), (run / "meta.json").read_bytes()
    one_line(*run_main(capsys, "train", "--resume", str(run), "--train-iters", "9", "--no-report"),
             "pool file", "x.npy", "missing or damaged")
    assert (full_snapshot(run), (run / "meta.json").read_bytes()) == before


def test_a_pool_that_cannot_fit_leaves_no_run_folder(runs_dir, capsys):
    """NSGF on 2D refused a pool larger than pool.ram_gb only once the run folder existed (an orphan folder
    whose name a retry could not reuse); NSGF++ already refused it first. Now both do."""
    one_line(*run_main(capsys, "train", "moons", *TINY_2D, "pool.ram_gb=0.000001", "--name", "r"), "pool.ram_gb")
    assert not (runs_dir / "r").exists()


def test_a_resume_with_iters_below_the_phases_step_is_refused(run, capsys):
    """velocity stopped at step 6; `--train-iters 4` ended the phase at once with final.pt at step 6 while
    config.yaml said 4 (and 6 itself finishes it as it stands): refused, the folder untouched."""
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    before = full_snapshot(run)
    one_line(*run_main(capsys, "train", "--resume", str(run), "--train-iters", "4", "--no-report"),
             "train.velocity.iters=4", "already at step 6", "iters=6 or more")
    assert full_snapshot(run) == before

# ---- 7. no tracebacks --------------------------------------------------------------------------------

def test_empty_point_file(runs_dir, tmp_path, capsys):
    np.save(tmp_path / "empty.npy", np.zeros((0, 2), np.float32))
    one_line(*run_main(capsys, "train", "moons", f"data.target={tmp_path / 'empty.npy'}"), "0 rows")
    assert not runs_dir.exists()


@pytest.mark.parametrize("how", ["file-in-path", "read-only"])
def test_unwritable_data_root(runs_dir, tmp_path, capsys, how):
    undo = None
    if how == "read-only":
        root = tmp_path / "ro"
        root.mkdir()
        undo = read_only(root)
        if undo is None:
            pytest.skip("no way to make a folder read-only for root here (chattr +i refused)")
    else:
        (tmp_path / "afile").write_text("x")
        root = tmp_path / "afile" / "data"
    try:
        one_line(*run_main(capsys, "train", "digits", f"data.root={root}", "--train-iters", "2"), "data.root")
    finally:
        if undo is not None:
            undo()
    assert not runs_dir.exists()


def test_full_disk_during_a_checkpoint(tmp_path):
    """Files may not grow past 300 kB (EFBIG, like a full disk): the first velocity checkpoint fails."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    env = {**os.environ, "SINKFLOW_PROGRESS": "0", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-m", "sinkflow", "train", "moons", *TINY_2D, "--name", "f", "--no-report"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, preexec_fn=limit, timeout=300)
    line = one_line(r.returncode, r.stderr, "EFBIG", "step_00000003.pt", "intact")  # errno, file, fix
    run = tmp_path / "runs" / "f"
    assert torch.load(run / "checkpoints/pool/final.pt", weights_only=True)["step"] == 2  # the earlier one
    assert not [p for p in run.rglob("*") if ".tmp" in p.name], line
    resumed = cli("train", "--resume", str(run), "--no-report", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr


@pytest.mark.parametrize("name", ["s.npy", "s.png"])
def test_samples_a_full_disk_refuses_keep_the_file_that_was_there(tiny_run, tmp_path, name):
    """`sample --out s.npy` over the samples of an earlier call, on a disk that fills (here: files may not grow past
    40 kB, EFBIG): np.save had cut the old file to the bytes that fit ("80000 requested and 66528 written", no file
    named), so neither the old samples nor the new remained. Every --out file is written atomically."""
    out = tmp_path / name
    assert cli("sample", str(tiny_run), "--n", "8", "--steps", "2", "--out", str(out), cwd=tmp_path).returncode == 0
    before = out.read_bytes()

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    env = {**os.environ, "SINKFLOW_PROGRESS": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-m", "sinkflow", "sample", str(tiny_run), "--n", "20000", "--steps", "2",
                        "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, env=env, preexec_fn=limit,
                       timeout=300)
    one_line(r.returncode, r.stderr, "EFBIG", f"({out})")
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [name]


def test_a_small_file_a_full_disk_refuses_is_named(tiny_run, tmp_path):
    """A resume on a disk already full: its first write, the 200-byte status.json, failed at the flush and again,
    unnamed, when the file was closed, so the line read "ENOSPC No space left on device" naming no file. Here files
    may not grow past 100 bytes (EFBIG, like a full disk): the line names status.json, and no temp file is left."""
    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints/velocity/final.pt").unlink()

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))

    env = {**os.environ, "SINKFLOW_PROGRESS": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-m", "sinkflow", "train", "--resume", str(run), "--no-report"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, preexec_fn=limit, timeout=300)
    one_line(r.returncode, r.stderr, "EFBIG", f"({run / 'status.json'})", "intact")
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]
    assert torch.load(run / "checkpoints/velocity/step_00000006.pt", weights_only=True)["step"] == 6


def test_a_full_disk_under_the_metrics_or_tensorboard_is_named_without_a_traceback(tmp_path, monkeypatch, capfd):
    """Files may not grow (ulimit -f 8, a full disk): TensorBoard's writer thread printed its traceback ("Exception in
    thread Thread-1") and the run then stopped on "EFBIG File too large" naming no file; a metrics.jsonl that cannot
    grow named none either. Each error now names what it was writing, and the thread prints nothing."""
    from tensorboard.summary.writer import record_writer

    from sinkflow.runtime.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path)
    logger.log("velocity", 1, {"loss": 1.0})

    def full(self, data):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    with pytest.raises(OSError) as e:
        for step in range(2, 2000):  # the thread's failure surfaces at a later scalar
            logger.log("velocity", step, {"loss": 1.0})
            time.sleep(0.01)
    assert (e.value.errno, e.value.filename) == (errno.EFBIG, str(tmp_path / "tb" / "velocity"))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    logger._tbs.clear()  # its writer is dead; the metrics file next
    logger._jsonl = open("/dev/full", "a", buffering=1)  # every write: ENOSPC
    with pytest.raises(OSError) as e:
        logger.log("velocity", 3000, {"loss": 1.0})
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "metrics.jsonl"))


@pytest.mark.parametrize("key", ["train.velocity.ckpt_every=0", "train.velocity.log_every=0"])
def test_zero_intervals_are_refused_before_work(runs_dir, capsys, key):
    one_line(*run_main(capsys, "train", "moons", *TINY_2D, key, "--name", "z"), key.split("=")[0], ">= 1")
    assert not runs_dir.exists()


def test_cli_turns_any_os_error_into_one_line(monkeypatch, capsys):
    def boom(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoints/velocity/step_00000010.pt")

    monkeypatch.setattr("sinkflow.cli.status.run", boom)
    one_line(*run_main(capsys, "status", "whatever"), "ENOSPC", "No space left on device", "step_00000010.pt",
             "free disk space")

    def tensorboard(args):  # its writer names its event file in bytes: the line read (b'/runs/x/tb/...')
        raise OSError(errno.EROFS, "Read-only file system", b"/runs/x/tb/velocity/events.out.tfevents.1")

    monkeypatch.setattr("sinkflow.cli.status.run", tensorboard)
    one_line(*run_main(capsys, "status", "whatever"), "EROFS", "(/runs/x/tb/velocity/events.out.tfevents.1)")
    # a write under `sample --out` names that flag (it named experiment.runs_dir / data.root, which it never wrote)
    for failed in ("/ro/s.npy", "/ro/.s.npy.tmp123", "/ro"):
        def read_only(args, failed=failed):
            raise OSError(errno.EROFS, "Read-only file system", failed)

        monkeypatch.setattr("sinkflow.cli.sample.run", read_only)
        one_line(*run_main(capsys, "sample", "RUN", "--out", "/ro/s.npy"), "EROFS", f"({failed})",
                 "--out /ro/s.npy cannot be written there")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_disk_under_a_run_names_the_runs_own_resume(code, monkeypatch, capsys):
    """A torchrun job whose disk filled at a checkpoint (found on a 12 MB tmpfs filled mid-run, audit YY): the line's
    fix said `sinkflow train --resume RUN`, a one-process resume without the job's --no-report and --time-limit (a
    global batch halved and the next session's limit lost), while `sinkflow status` named the run's own command."""
    from sinkflow.cli import main

    def full(*args, **kwargs):
        kwargs["on_open"](type("Run", (), {"dir": "runs/x"})())  # the run folder is open when the disk fills
        raise OSError(code, os.strerror(code), "runs/x/checkpoints/velocity/step_00000150.pt")

    monkeypatch.setattr("sinkflow.engine.experiment.train_run", full)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for argv, run in ((["moons", "--no-report", "--time-limit", "8h30m"], "runs/x"),
                      (["--resume", "runs/y", "--time-limit", "90m"], "runs/x")):
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and errno.errorcode[code] in err[0] and "step_00000150.pt" in err[0], err
        flags = " --no-report --time-limit 8h30m" if "--no-report" in argv else " --time-limit 1h30m"
        assert f"`torchrun --nproc_per_node 2 -m sinkflow train --resume {run}{flags}` continues" in err[0], err
        assert "--resume RUN" not in err[0], err



def test_a_reader_that_closes_the_pipe_is_not_a_disk_error(tmp_path):
    """`sinkflow config moons --all | head -1`: the reader stops early; no 'EPIPE ... free space' line, and the exit
    status is a SIGPIPE stop's (141), as for any Unix tool, not the error status 2."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sinkflow", "config", "moons", "--all"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write (as `head` after its lines): EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE, err
    assert "error" not in err and "Traceback" not in err, err

# ---- 8. housekeeping and messages --------------------------------------------------------------------

def test_orphaned_temp_files_are_removed_on_resume(run, capsys):
    """Every temp name a killed write leaves, of this version (``.NAME.tmp-PID-RANDOM``: two writers of one file
    with the same pid, containers on two nodes, truncated each other's memmap) and of older ones."""
    from sinkflow.data.atomic_write import atomic_path

    with atomic_path(run / "x.bin") as a, atomic_path(run / "x.bin") as b:  # one process, one file: two temp names
        assert a != b and a.name.startswith(f".x.bin.tmp-{os.getpid()}-")
        a.write_bytes(b"1")
        b.write_bytes(b"2")
    orphans = [run / "checkpoints/velocity/.step_00000009.pt.tmp-999999", run / ".status.json.tmp-999999",
               run / "pool" / ".x.npy.tmp", run / "pool" / ".v.npy.tmp-999999-0a1b2c3d"]
    for p in orphans:
        p.write_bytes(b"half a checkpoint")
    rc, err = run_main(capsys, "train", "--resume", str(run), "--no-report")
    assert rc == 0, err
    assert not any(p.exists() for p in orphans)


def _gone_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_what_a_killed_write_or_tool_left_outside_a_run_folder_goes_at_the_next_one(tmp_path, monkeypatch):
    """`sample --out s.npy` killed with -9 left `.s.npy.tmp-PID-RANDOM` beside the samples, and preflight, doctor,
    lr-find or bench killed so left /tmp/sinkflow-KIND-* (3.4 MB for moons): nothing removed them. The next write of
    the same file, and the next tool's scratch folder, remove those of a process that is gone and that nobody
    touched for an hour; a live writer's, a fresh one and other names stay."""
    from sinkflow.data.atomic_write import atomic_write_text
    from sinkflow.processes import ORPHAN_AGE_S
    from sinkflow.runtime.scratch import scratch_dir

    gone, old = _gone_pid(), time.time() - ORPHAN_AGE_S - 60

    def made(path, age=old, folder=False):
        path.mkdir(exist_ok=True) if folder else path.write_bytes(b"half")
        os.utime(path, (age, age))
        return path

    out = tmp_path / "s.npy"
    stale = made(tmp_path / f".s.npy.tmp-{gone}-0a1b2c3d")
    kept = [made(tmp_path / f".s.npy.tmp-{os.getpid()}-0a1b2c3d"),  # a writer still running
            made(tmp_path / f".s.npy.tmp-{gone}-1a1b2c3d", age=time.time()),  # touched just now
            made(tmp_path / f".t.npy.tmp-{gone}-2a1b2c3d")]  # another file's (its own next write removes it)
    atomic_write_text(out, "new")
    assert out.read_text() == "new" and not stale.exists() and all(p.exists() for p in kept)

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    (tmp_path / f"sinkflow-preflight-{gone}-abc" / "runs").mkdir(parents=True)
    stale = made(tmp_path / f"sinkflow-preflight-{gone}-abc", folder=True)
    kept = [made(tmp_path / f"sinkflow-doctor-{os.getpid()}-abc", folder=True),
            made(tmp_path / f"sinkflow-bench-{gone}-abc", age=time.time(), folder=True),
            made(tmp_path / "sinkflow-preflight-abc", folder=True)]  # an older version's name: no pid to ask
    with scratch_dir("lrfind") as tmp:
        assert Path(tmp).name.startswith(f"sinkflow-lrfind-{os.getpid()}-")
        assert not stale.exists() and all(p.exists() for p in kept)


def test_text_file_named_npy(runs_dir, tmp_path, capsys):
    (tmp_path / "pts.npy").write_text("1.0,2.0\n3.0,4.0\n")
    line = one_line(*run_main(capsys, "train", "moons", f"data.target={tmp_path / 'pts.npy'}"), "not a .npy file")
    assert "pickle" not in line


@pytest.mark.parametrize("shape", [(300, 1), (300, 1, 4, 4)])
def test_point_files_of_one_coordinate_or_image_rows_report_sample_and_eval(runs_dir, tmp_path, capsys, shape,
                                                                             monkeypatch):
    """A point file's rows of any shape are points: W2 on them flattened, a histogram for one coordinate, the first
    two coordinates' plane otherwise. Both trained and then crashed in the report (an (N, 1) file in the scatter
    plot, an (N, 1, 4, 4) file in the image metrics, which need an image set's test split)."""
    from sinkflow.eval import points

    np.save(tmp_path / "p.npy", np.random.default_rng(0).normal(size=shape).astype(np.float32))
    calls, real = [], points.generate
    monkeypatch.setattr(points, "generate", lambda run, n, steps, seed, record=False, **kw:
                        calls.append((n, steps, record)) or real(run, n, steps, seed, record, **kw))
    rc, err = run_main(capsys, "train", "moons", *TINY_2D, "eval.steps=[2]", f"data.target={tmp_path / 'p.npy'}",
                       "--name", "p")
    assert rc == 0, err
    plotted = calls[-2:]  # the plots: 1024 x 100 steps, every path recorded, ran for many minutes on 3x32x32 rows
    n_eval = RunFolder.open(runs_dir / "p").cfg["eval"]["n"]  # steps None: the run's own sampler's (sample.steps)
    assert plotted == ([(1024, None, False), (256, None, True)] if len(shape) == 2 and shape[1] <= 2 else
                       [(min(1024, n_eval), None, False), (min(1024, n_eval, 256), None, True)]), plotted
    assert (runs_dir / "p" / "samples.png").stat().st_size > 0 and (runs_dir / "p" / "trajectories.png").exists()
    rc, err = run_main(capsys, "sample", str(runs_dir / "p"), "--n", "32", "--out", str(tmp_path / "s.png"))
    assert rc == 0 and (tmp_path / "s.png").exists(), err
    assert main(["eval", str(runs_dir / "p"), "--seeds", "1"]) == 0
    assert "W2 on normal -> " in capsys.readouterr().out


def test_points_far_larger_than_the_blur_are_warned_about_before_the_pool(runs_dir, tmp_path, caplog):
    """Points at a scale of 1e6 with the default blur 0.2 trained to garbage (W2 1.4e6) with only the max_iters
    warning's advice; the pool now says, before its first solve, that blur is a length in the data's units."""
    import logging

    pts = np.random.default_rng(0).normal(size=(300, 2)).astype(np.float32)
    np.save(tmp_path / "huge.npy", pts * 1e6)
    np.save(tmp_path / "unit.npy", pts)
    for name in ("huge", "unit"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sinkflow"):
            assert main(["train", "moons", *TINY_2D, f"data.target={tmp_path / name}.npy", "--name", name,
                         "--no-report"]) == 0
        warned = [r.getMessage() for r in caplog.records if "standardise the data" in r.getMessage()]
        assert len(warned) == (1 if name == "huge" else 0), warned
        assert all("x sinkhorn.blur=0.2: blur is a length in the data's units" in w for w in warned)


def test_nsgfpp_on_2d_is_evaluated_at_its_own_nsf_steps(runs_dir, capsys):
    """NSGF++'s 2D report and `sinkflow eval` ran eval.steps ([10, 100]) as its straight-flow steps, although
    eval.steps is not NSGF++'s key (setting it is refused) and sample.nsf_steps is: they now evaluate at
    sample.nsf_steps, as its image report does."""
    tiny = [a for a in TINY_2D if not a.startswith("eval.steps")]
    assert main(["train", "moons", *tiny, "--method", "nsgfpp", "sample.nsf_steps=3", "--name", "pp",
                 "--no-report"]) == 0
    capsys.readouterr()
    assert main(["eval", str(runs_dir / "pp"), "--seeds", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["3"], rows


def test_report_on_user_points_has_no_paper_number(runs_dir, tmp_path, capsys):
    np.save(tmp_path / "points.npy", np.random.default_rng(0).normal(size=(300, 2)).astype(np.float32))
    args = ["moons", *TINY_2D, "eval.steps=[10]", f"data.target={tmp_path / 'points.npy'}", "--name", "u"]
    assert main(["train", *args, "--no-report"]) == 0
    capsys.readouterr()
    assert main(["eval", str(runs_dir / "u"), "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "points.npy" in out and "0.077" not in out, out  # 0.077: the paper's NSGF W2 on moons at 10 steps
    # what the W2 compared, said as it is: no held-out rows, so not "stratified test points"
    assert "QMC source draws vs test points drawn from the file's training rows (data.test_rows=0)" in out, out


def test_eval_n_beyond_the_held_out_rows_names_the_flag(runs_dir, tmp_path, capsys):
    """`sinkflow eval RUN --n 100` on a point file holding out 40 rows said "set eval.n <= 40": the user set --n."""
    np.save(tmp_path / "points.npy", np.random.default_rng(0).normal(size=(300, 2)).astype(np.float32))
    tiny = [a for a in TINY_2D if not a.startswith("eval.n")]
    assert main(["train", "moons", *tiny, f"data.target={tmp_path / 'points.npy'}", "data.test_rows=40", "eval.n=40",
                 "--name", "h", "--no-report"]) == 0
    one_line(*run_main(capsys, "eval", str(runs_dir / "h"), "--n", "100", "--seeds", "1"), "--n 100",
             "data.test_rows=40", "use --n 40 or less")


@pytest.mark.parametrize("out", ["s.npy", "new/s.png", "pngs/"])
def test_sample_into_a_folder_that_takes_no_file_is_refused_before_sampling(run, tmp_path, capsys, monkeypatch, out):
    """An unwritable --out folder failed only once every sample was drawn, naming a temporary file ("ENOENT No such
    file or directory (/proc/.y.npy.tmp-...)"); the nearest existing folder is probed first."""
    from sinkflow.eval import points

    folder = tmp_path / "ro"
    folder.mkdir()
    undo = refusing_writes(folder, monkeypatch)
    monkeypatch.setattr(points, "sample_chunks", lambda *a, **k: pytest.fail("sampled before the refusal"))
    try:
        one_line(*run_main(capsys, "sample", str(run), "--out", str(folder / out)), f"cannot write into {folder}",
                 "name a path in a writable folder")
    finally:
        undo()
    assert not any(folder.iterdir())
