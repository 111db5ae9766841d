"""LR range test: lands in a known good range, survives NaN losses, restores model and optimizer bit for bit."""

import copy
import math
import re

import pytest
import torch
import torch.nn as nn

from sinkflow.tools.lr_find import lr_range_test, plot, write_lr


def problem(seed=0):
    torch.manual_seed(seed)
    w = torch.randn(8, 1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    gen = torch.Generator().manual_seed(seed)

    def batch_fn(i):
        x = torch.randn(64, 8, generator=gen)
        return x, x @ w

    def loss_fn(m, b):
        return (m(b[0]) - b[1]).pow(2).mean()

    return model, batch_fn, loss_fn


def final_loss(lr, steps=150):
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for i in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, batch_fn(i))
        loss.backward()
        opt.step()
    with torch.no_grad():
        return sum(float(loss_fn(model, batch_fn(1000 + i))) for i in range(5)) / 5


def test_suggestions_land_in_the_good_range():
    grid = [10 ** (e / 2) for e in range(-10, 1)]  # 1e-5 .. 1
    losses = {lr: final_loss(lr) for lr in grid}
    best = min(v for v in losses.values() if math.isfinite(v))
    good = [lr for lr, v in losses.items() if math.isfinite(v) and v <= 3 * best]
    lo, hi = min(good), max(good)
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    res = lr_range_test(model, opt, loss_fn, batch_fn, start_lr=1e-6, end_lr=10, steps=120)
    assert "diverged" in res.stop_reason
    s = res.suggestions
    assert s["conservative"] <= s["moderate"] <= s["aggressive"]
    for name in ("moderate", "aggressive"):
        assert lo / 1.5 <= s[name] <= hi * 1.5, (name, s, lo, hi, losses)
    assert lo / 10 <= s["conservative"] <= hi
    assert final_loss(s["moderate"]) <= 3 * best


def test_restores_model_and_optimizer_bit_identical():
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i in range(3):  # non-trivial optimizer state first
        opt.zero_grad()
        loss_fn(model, batch_fn(i)).backward()
        opt.step()
    w0, o0 = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    rng0 = torch.get_rng_state()
    lr_range_test(model, opt, loss_fn, batch_fn, steps=40)
    for k, v in model.state_dict().items():
        assert torch.equal(v, w0[k]), k
    o1 = opt.state_dict()
    assert o1["param_groups"] == o0["param_groups"]
    for pid, st in o0["state"].items():
        for k, v in st.items():
            assert torch.equal(o1["state"][pid][k], v), (pid, k)
    assert torch.equal(torch.get_rng_state(), rng0)


def test_survives_nan_losses():
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    calls = {"n": 0}

    def flaky(m, b):
        calls["n"] += 1
        loss = loss_fn(m, b)
        return loss * float("nan") if calls["n"] in (10, 30, 31) else loss

    w0 = copy.deepcopy(model.state_dict())
    res = lr_range_test(model, opt, flaky, batch_fn, start_lr=1e-6, end_lr=10, steps=120)
    assert sum(math.isnan(v) for v in res.losses) == 3
    assert res.suggestions, res.stop_reason
    assert all(torch.equal(v, w0[k]) for k, v in model.state_dict().items())
    # a loss that stays NaN ends the sweep instead of crashing
    res = lr_range_test(model, opt, lambda m, b: loss_fn(m, b) * float("nan"), batch_fn, steps=50)
    assert "non-finite" in res.stop_reason and res.suggestions == {}


def test_plot_and_write(tmp_path):
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    res = lr_range_test(model, opt, loss_fn, batch_fn, steps=60)
    png = plot(res, tmp_path / "lr.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    cfg = tmp_path / "cfg.yaml"
    write_lr(cfg, "train.velocity.lr", 3e-4)
    assert "0.0003" in cfg.read_text()
    from sinkflow import config

    # a new file from a sweep is the swept recipe with the rate: `train new.yaml` trained the schema's defaults
    # (preset "new", nsgf.time flow) with the rate measured on moons
    swept = config.resolve("moons", ["experiment.name=from-a-run"])
    write_lr(tmp_path / "new.yaml", "train.velocity.lr", 3e-4, "velocity", swept)
    got = config.resolve(str(tmp_path / "new.yaml"))
    want = config.resolve("moons", ["train.velocity.lr=0.0003"])
    assert got["train"]["velocity"]["lr"] == 3e-4 and got["experiment"]["name"] is None  # a folder of its own
    assert {k: v for k, v in config.flatten(got).items() if k != "experiment.preset"} == \
        {k: v for k, v in config.flatten(want).items() if k != "experiment.preset"}


def test_lr_find_cli_on_a_run_writes_the_config_of_an_unfinished_phase(tiny_run, runs_dir):
    import shutil

    from helpers import cli

    run = runs_dir / "r"
    shutil.copytree(tiny_run, run)  # a finished `train moons TINY_2D --no-report`
    (run / "checkpoints" / "velocity" / "final.pt").unlink()  # stopped after step 6: velocity has not finished
    out = cli("lr-find", str(run), "--steps", "40", "--end-lr", "1", "--out", "lr.png", "--write", str(run),
              cwd=runs_dir.parent)
    assert out.returncode == 0, out.stderr
    assert "moderate" in out.stdout and (runs_dir.parent / "lr.png").is_file()
    import yaml

    lr = yaml.safe_load((run / "config.yaml").read_text())["train"]["velocity"]["lr"]
    assert lr != 0.001 and f"train.velocity.lr={lr:.3g}" in out.stdout
    # recorded as a resume's change is: config.yaml says the new rate, meta.json from which step (steps 1-6 ran at
    # 0.001); it was written into config.yaml alone, as if the whole phase had used it
    import json

    changes = json.loads((run / "meta.json").read_text())["changes"]
    assert [(c["key"], c["from"], c["to"], c["phase"], c["step"]) for c in changes] == \
        [("train.velocity.lr", 0.001, lr, "velocity", 6)]


# ---- bad arguments and write targets: one line, before a pool is built or a step taken ---------------------

@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if lr-find gets as far as building a workspace, opening a run's phase or sweeping."""
    from sinkflow.tools import lr_find, phases

    def forbidden(*a, **k):
        raise AssertionError("lr-find started work before refusing its arguments")

    for mod, name in ((phases, "workspace"), (phases, "open_run_phase"), (lr_find, "phase_lr_find")):
        monkeypatch.setattr(mod, name, forbidden)


def refused(capsys, *argv) -> str:
    from sinkflow.cli import main

    rc = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("sinkflow: error: "), err
    return err[0]


@pytest.mark.parametrize("args,needles", [
    (["--start-lr", "1", "--end-lr", "1e-3"], ["--end-lr 0.001", "above --start-lr 1"]),
    (["--start-lr", "0"], ["--start-lr 0", "positive"]),
    (["--start-lr", "nan"], ["--start-lr nan"]),
    (["--end-lr", "inf"], ["--end-lr inf must be a finite learning rate"]),
    (["--steps", "1"], ["--steps 1", "--steps 2 or more"]),
    (["--diverge", "0.5"], ["--diverge 0.5", "above 1"]),
    (["--out", "lr.txt"], ["--out lr.txt", ".png"]),
    (["--out", "lr"], ["--out lr", ".png"]),
    (["--write", "nope"], ["--write nope", "run folder", ".yaml"]),
])
def test_bad_arguments_are_one_line_before_any_work(runs_dir, capsys, no_work, args, needles):
    runs_dir.mkdir()
    line = refused(capsys, "lr-find", "moons", "--device", "cpu", *args)
    for needle in needles:
        assert needle in line, line
    assert sorted(p.name for p in runs_dir.parent.iterdir()) == ["runs"]  # no plot, no stray `nope`, no run


def test_write_to_a_folder_that_is_not_a_run_is_refused(runs_dir, capsys, no_work):
    (runs_dir / "empty").mkdir(parents=True)
    line = refused(capsys, "lr-find", "moons", "--write", str(runs_dir / "empty"))
    assert "not a sinkflow run folder (no config.yaml)" in line
    assert list((runs_dir / "empty").iterdir()) == []


@pytest.mark.parametrize("target", ["RUN", "RUN/config.yaml"])
def test_write_to_a_finished_phase_is_refused_before_the_sweep(tiny_run, tmp_path, monkeypatch, capsys, no_work,
                                                                 target):
    """As `train --resume RUN train.velocity.lr=X` is refused once velocity has finished: the run trained with
    the rate config.yaml holds, so a new one would have no effect and make config.yaml lie."""
    import shutil

    from helpers import bytes_snapshot

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "base"
    shutil.copytree(tiny_run, run)
    before = bytes_snapshot(run)
    where = str(run) if target == "RUN" else str(run / "config.yaml")
    for source in (["moons", "--device", "cpu"], [str(run)]):  # a run folder runs on its own config: no --device
        line = refused(capsys, "lr-find", *source, "--write", where)
        assert "phase 'velocity' has finished (trained with train.velocity.lr=0.001)" in line, line
        assert "drop --write" in line
    assert bytes_snapshot(run) == before and not (tmp_path / "lr_find.png").exists()


def test_library_refuses_the_same_way(tiny_run, tmp_path):
    """The API keeps its own checks: write_lr refuses a finished phase and a non-run target, and
    lr_range_test a bad range, as SinkflowError (one line), not ValueError."""
    import shutil

    from sinkflow.errors import SinkflowError

    run = tmp_path / "base"
    shutil.copytree(tiny_run, run)
    with pytest.raises(SinkflowError, match="has finished"):
        write_lr(run, "train.velocity.lr", 3e-4)
    with pytest.raises(SinkflowError, match="neither a run folder"):
        write_lr(tmp_path / "nope", "train.velocity.lr", 3e-4)
    assert not (tmp_path / "nope").exists()
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    assert write_lr(run, "train.velocity.lr", 3e-4) == run / "config.yaml"
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for kw in ({"start_lr": 1.0, "end_lr": 1e-3}, {"start_lr": 0.0}, {"steps": 1}):
        with pytest.raises(SinkflowError, match="start_lr|end_lr|steps") as e:
            lr_range_test(model, opt, loss_fn, batch_fn, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(SinkflowError, match="does not end in an image format"):
        plot(lr_range_test(model, opt, loss_fn, batch_fn, steps=10), tmp_path / "lr.txt")


def test_bad_arguments_answer_before_torch_loads(tmp_path):
    """The range, the plot file and a non-run --write target are refused without importing torch (seconds
    on a busy box), as `sample` and `bench` refuse theirs."""
    import subprocess
    import sys

    calls = [["lr-find", "moons", "--steps", "1"], ["lr-find", "moons", "--start-lr", "1", "--end-lr", "1e-3"],
             ["lr-find", "moons", "--out", "lr.txt"], ["lr-find", "moons", "--write", "nope"]]
    code = ("import sys\nfrom sinkflow.cli import main\nfor argv in %r:\n    print(main(argv))\n"
            "print('torch' in sys.modules)\n" % calls)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.split() == ["2"] * len(calls) + ["False"], out.stdout + out.stderr
    assert list(tmp_path.iterdir()) == []


def test_write_to_a_run_another_process_trains_is_refused_before_the_sweep(tiny_run, tmp_path, monkeypatch, capsys,
                                                                           no_work):
    """The whole sweep ran, then `--write` met the training process's lock; the holder's line comes first now."""
    import shutil
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "live"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "velocity" / "final.pt").unlink()  # velocity still training
    # the holder writes its pid as sinkflow's lock_run does, over the copied run's .lock: truncated first (a shorter
    # pid written over a longer one left its tail: "796" over "79676" read back as 79676)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.write(fd, str(os.getpid()).encode()); "
        "print('held', flush=True); "
        "time.sleep(120)"), str(run / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = refused(capsys, "lr-find", "moons", "--device", "cpu", "--write", str(run))
        assert f"is in use by another sinkflow process (pid {holder.pid})" in line, line
    finally:
        holder.kill()
        holder.wait()


def test_write_to_a_commented_config_file_changes_only_the_rate(tmp_path, capsys, monkeypatch):
    """`sinkflow config moons > my.yaml` is commented; --write my.yaml rewrote it whole and dropped every comment.
    Now only the rate's characters change, and `sinkflow train my.yaml` reads the new rate."""
    from sinkflow import config
    from sinkflow.cli import main
    from sinkflow.tools.lr_find import write_lr

    monkeypatch.chdir(tmp_path)
    assert main(["config", "moons"]) == 0
    before = capsys.readouterr().out
    (tmp_path / "my.yaml").write_text(before)
    write_lr(tmp_path / "my.yaml", "train.velocity.lr", 0.0123)
    after = (tmp_path / "my.yaml").read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines()) and len(changed) == 1, changed
    assert "lr: 0.0123" in changed[0][1] and "# Adam learning rate" in changed[0][1]
    assert config.resolve("my.yaml")["train"]["velocity"]["lr"] == 0.0123


def test_write_to_a_file_or_run_of_another_batch_is_refused_before_the_sweep(tiny_run, tmp_path, monkeypatch, capsys,
                                                                              no_work):
    """`lr-find moons --write my.yaml` swept at moons' batch 256 and wrote the rate into a file that trains at 64:
    the best rate moves with the batch. Refused before any work, naming both batches and the sweep that fits;
    the file and the run stay as they were."""
    import shutil

    from sinkflow import config
    from sinkflow.cli import main

    from helpers import bytes_snapshot

    monkeypatch.chdir(tmp_path)
    assert main(["config", "moons", "train.velocity.batch_size=64"]) == 0
    (tmp_path / "my.yaml").write_text(capsys.readouterr().out)
    before = (tmp_path / "my.yaml").read_text()
    line = refused(capsys, "lr-find", "moons", "--device", "cpu", "--write", "my.yaml")
    assert "train.velocity.batch_size=256" in line and "has 64 (the best rate moves with the batch)" in line, line
    assert "sinkflow lr-find my.yaml --write my.yaml" in line, line
    assert (tmp_path / "my.yaml").read_text() == before and not (tmp_path / "lr_find.png").exists()

    run = tmp_path / "runs" / "live"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "velocity" / "final.pt").unlink()  # velocity still training: only the batch differs
    batch = config.get(config.resolve(str(run / "config.yaml")), "train.velocity.batch_size")
    snapshot = bytes_snapshot(run)
    line = refused(capsys, "lr-find", "moons", "--device", "cpu", f"train.velocity.batch_size={batch // 2}",
                   "--write", str(run))
    assert f"batch_size={batch // 2}," in line and f"has {batch}" in line, line
    assert f"sinkflow lr-find {run} --write {run}" in line, line
    assert bytes_snapshot(run) == snapshot

    # another method's phase (flow-digits' train.flow.lr went into a NSGF run, where no phase reads it), another
    # network or other data: a rate is measured for one recipe
    line = refused(capsys, "lr-find", "flow-digits", "--device", "cpu", "--write", str(run))
    assert "it trains no phase that reads train.flow.lr (method nsgf)" in line, line
    for other, key in ((["--method", "fm"], "experiment.method"), (["data.source=8gaussians"], "data.source"),
                       ([f"train.velocity.batch_size={batch}", "model.velocity.hidden=16"], "model.velocity.hidden")):
        line = refused(capsys, "lr-find", "moons", "--device", "cpu", f"train.velocity.batch_size={batch}", *other,
                       "--write", str(run))
        assert f"the sweep runs {key}=" in line and "a rate is measured for one recipe" in line, line
    assert bytes_snapshot(run) == snapshot

    # a YAML file that cannot be written: refused before the sweep (it failed after it, the plot written)
    line = refused(capsys, "lr-find", "moons", "--device", "cpu", "--write", str(tmp_path / "no" / "such" / "x.yaml"))
    assert "x.yaml cannot be written" in line and "name a .yaml file in a folder you can write" in line, line

    # the same batch passes this check and reaches the sweep (which no_work forbids here)
    with pytest.raises(AssertionError, match="started work"):
        main(["lr-find", "my.yaml", "--write", "my.yaml"])


@pytest.mark.parametrize("content, needle", [(b"train:\n  velocity: [unclosed\n", "is not valid YAML (line 3)"),
                                             (b"train:\n  \xff\xfe: 1\n", "is not valid YAML (neither UTF-8 nor UTF-16 text)")])
def test_write_to_a_broken_yaml_file_names_the_line(tmp_path, content, needle):
    """Every YAML file sinkflow reads reports its errors alike (config.parse_yaml): lr-find's target named no line,
    and a file of other bytes was a UnicodeDecodeError traceback. The file is left as it was."""
    from sinkflow.errors import SinkflowError
    from sinkflow.tools.lr_find import write_lr

    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(SinkflowError, match=re.escape(needle)):
        write_lr(path, "train.velocity.lr", 0.01)
    assert path.read_bytes() == content


def test_a_small_rate_written_into_a_config_file_reads_back(tmp_path, capsys, monkeypatch):
    """`lr-find --write` writes ``lr: 5e-05``, which YAML 1.1 reads as a string: `sinkflow train my.yaml` then
    refused the file it had just written. Config files read numbers decimal as typed."""
    from sinkflow import config
    from sinkflow.cli import main
    from sinkflow.tools.lr_find import write_lr

    monkeypatch.chdir(tmp_path)
    assert main(["config", "moons"]) == 0
    (tmp_path / "my.yaml").write_text(capsys.readouterr().out)
    write_lr(tmp_path / "my.yaml", "train.velocity.lr", 5e-05)
    assert "lr: 5e-05" in (tmp_path / "my.yaml").read_text()
    assert config.resolve("my.yaml")["train"]["velocity"]["lr"] == 5e-05


def test_write_to_a_file_without_the_key_keeps_its_comments_and_line_ends(tmp_path, monkeypatch):
    """A commented file that does not set the rate was rewritten whole by yaml.safe_dump: every comment gone, its
    Windows line ends turned to Unix ones, and not atomically. The key is appended as one dotted line; a file that
    sets it keeps its CRLF line ends."""
    from sinkflow import config
    from sinkflow.tools.lr_find import write_lr

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_bytes(b"# my recipe\r\nexperiment:\r\n  preset: moons   # the demo's target\r\n"
                                      b"pool:\r\n  eta: 0.05\r\n")
    write_lr(tmp_path / "c.yaml", "train.velocity.lr", 0.0123)
    raw = (tmp_path / "c.yaml").read_bytes()
    assert raw.startswith(b"# my recipe\r\n") and b"# the demo's target\r\n" in raw and b"\n" not in raw.replace(
        b"\r\n", b"")
    assert config.resolve("c.yaml")["train"]["velocity"]["lr"] == 0.0123
    write_lr(tmp_path / "c.yaml", "train.velocity.lr", 0.02)  # now it is there: its characters replaced
    assert config.resolve("c.yaml")["train"]["velocity"]["lr"] == 0.02
    assert (tmp_path / "c.yaml").read_bytes().count(b"train.velocity.lr") == 1


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_sweep_through_the_engine_goes_on_training_past_a_non_finite_step(runs_dir, poison):
    """lr-find through a ready Trainer's own step, with the fused kernel that skips a non-finite update on the device
    (the default): the bad step (a NaN loss, or NaN gradients under a finite loss) is one gap, and every later step is
    applied, as with foreach Adam's host check. The guard's record is sticky in the loop (it stops at the next check),
    so the sweep trained nothing after the bad step while it recorded every later loss, and NaN gradients as a point."""
    from helpers import nan_gradient_phase

    from sinkflow import config
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.tools.lr_find import phase_lr_find
    from sinkflow.tools.phases import ready_trainer

    cfg = config.resolve("moons", ["experiment.method=fm", "train.velocity.iters=1000", "train.velocity.batch_size=32",
                                   "train.velocity.log_every=1000", "train.velocity.ckpt_every=1000",
                                   "experiment.device=cpu"])
    run = RunFolder.create(cfg)
    trainer = ready_trainer(run, nan_gradient_phase(cfg, 4, poison=poison))
    assert trainer.skip_on_device
    moved, step = [], trainer.train_step

    def watched(batch):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        try:
            return step(batch)
        finally:
            moved.append(any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters())))

    trainer.train_step = watched
    res = phase_lr_find(trainer, start_lr=1e-4, end_lr=1e-2, steps=6)
    run.logger.close()
    gaps = [math.isnan(v) for v in res.losses]
    assert sum(gaps) == 1 and not gaps[0], res.losses
    assert moved == [not gap for gap in gaps], (moved, res.losses)


def _poisoned_sweep(runs_dir, precision):
    """A moons FM velocity phase whose gradients are NaN under a finite loss from its 9th sweep step on, through
    the engine's own step (the step graph's path, as on CUDA) in ``precision``."""
    from helpers import nan_gradient_phase

    from sinkflow import config
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.tools.lr_find import phase_lr_find
    from sinkflow.tools.phases import ready_trainer

    cfg = config.resolve("moons", ["experiment.method=fm", "train.velocity.iters=1000", "train.velocity.batch_size=32",
                                   "train.velocity.log_every=1000", "train.velocity.ckpt_every=1000",
                                   "experiment.device=cpu", f"experiment.name={precision}", "train.velocity.graph=step",
                                   f"train.velocity.precision={precision}"])
    run = RunFolder.create(cfg)
    trainer = ready_trainer(run, nan_gradient_phase(cfg, 10, persist=True))
    res = phase_lr_find(trainer, start_lr=1e-4, end_lr=1e-1, steps=40)
    run.logger.close()
    return res


def test_a_float16_sweep_reads_no_loss_where_gradscaler_applied_no_update(runs_dir):
    """float16 (the CUDA default for a UNet): GradScaler skips a step with Inf/NaN gradients and halves its scale,
    and the guard leaves those gradients to it. A sweep whose every gradient from its 9th step on was NaN recorded the
    frozen weights' losses as points at 32 rising rates, ran to "end of range" and put its loss minimum among them
    (7.0e-02 against float32's 3.5e-04, where the guard ends the sweep after 3 gaps). A skipped step's loss is still
    smoothed (it measures the weights as they are: a divergence shows there first), but no rate is suggested from it,
    the scale below 1 is non-finite (the loop's own stop), and both precisions suggest the same."""
    fp32, fp16 = _poisoned_sweep(runs_dir, "fp32"), _poisoned_sweep(runs_dir, "fp16")
    assert "non-finite" in fp16.stop_reason and "non-finite" in fp32.stop_reason, fp16.stop_reason
    assert fp16.suggestions == fp32.suggestions and fp16.min_loss_lr == fp32.min_loss_lr, (fp16.summary(),
                                                                                         fp32.summary())
    # the first step, at GradScaler's starting scale 2**16, is skipped (and is no divergence: the sweep goes on);
    # from the poisoned 9th on, the scale halves to 1 and below it each step is non-finite: 3 end the sweep
    assert fp16.skipped == [0, *range(8, 23)] and len(fp16.lrs) == 26, fp16.skipped
    assert all(math.isfinite(fp16.losses[i]) and math.isfinite(fp16.smoothed[i]) for i in fp16.skipped)
    assert fp32.skipped == [] and "16 of 26 updates skipped by float16's GradScaler" in fp16.summary()



def test_a_skipped_step_shows_a_divergence_but_holds_no_suggestion():
    """A step GradScaler skipped measured the weights as they are: a loss that blew up there ends the sweep as
    diverged (on moons FM in float16 the loss went 17 -> 725 on skipped steps), while the lowest loss of a skipped
    run (frozen weights) is no rate to suggest."""
    from sinkflow.tools.lr_find import UnappliedStep

    model, batch_fn, _ = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    curve = [1.0 - 0.02 * i for i in range(20)] + [0.3] * 8 + [0.9] * 2 + [500.0] * 10
    frozen = set(range(20, 28))  # the curve's lowest points, not applied: the smoothed minimum falls among them

    def step(batch):
        i = len(calls)
        calls.append(i)
        if i in frozen or i >= 30:
            raise UnappliedStep(curve[i])
        return torch.tensor(curve[i])

    calls = []
    res = lr_range_test(model, opt, None, batch_fn, start_lr=1e-5, end_lr=1, steps=40, train_step=step)
    assert "diverged" in res.stop_reason and len(res.lrs) == 31 and res.skipped == [*range(20, 28), 30], res.stop_reason
    lowest = min(range(len(res.lrs)), key=lambda i: res.smoothed[i])
    assert lowest in frozen and res.min_loss_lr in (res.lrs[19], res.lrs[28]), (lowest, res.min_loss_lr)


def test_the_sweep_stops_naming_the_rate_where_updates_stopped_being_applied():
    """Three non-finite steps in a row end a sweep: the reason named the third one's rate ("at lr" 2 steps past where
    the weights went bad, and on float16 16 skipped steps past it); it names the first step not applied now."""
    from sinkflow.engine.trainer import NonFiniteStep

    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    calls = []

    def step(batch):
        calls.append(1)
        if len(calls) > 6:
            raise NonFiniteStep("non-finite loss (nan)")
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss.detach()

    res = lr_range_test(model, opt, None, batch_fn, start_lr=1e-4, end_lr=1e-1, steps=20, train_step=step)
    assert len(res.lrs) == 9
    assert f"no update applied from lr {res.lrs[6]:.2e} to {res.lrs[8]:.2e}" in res.stop_reason, res.stop_reason


def test_the_output_names_the_step_path_the_rates_were_measured_through(runs_dir, capsys):
    """The rate belongs to the step it was measured through (digits' velocity phase on the CPU: float16 went
    non-finite from 1.15e-01, float32 diverged at 3.27), and a sweep muted the phase's speed-settings line, so a log of
    lr-find on a card did not say whether it had run the CUDA default (fp16, the whole step one CUDA graph). It says
    so now, and on a card how many steps were replays of the captured step."""
    from types import SimpleNamespace

    from sinkflow.cli import main
    from sinkflow.tools.lr_find import LRFindResult, step_path

    assert main(["lr-find", "moons", "--method", "fm", "--device", "cpu", "--steps", "12", "--end-lr", "1e-2",
                 "--out", "lr.png", "train.velocity.graph=step", "train.velocity.precision=fp16"]) == 0
    out = capsys.readouterr().out
    assert "  step: velocity on cpu: fp16 (autocast, GradScaler), eager, the step graph's path run eagerly" in out, out
    captured = SimpleNamespace(task=SimpleNamespace(model_key="velocity"), name="velocity", precision="fp16",
                               compile_mode="default", step_graph=object(), device=torch.device("cuda"))
    line = step_path(captured, LRFindResult(lrs=[1e-3] * 78, replays=75))
    assert line.startswith("velocity on cuda: fp16 (autocast, GradScaler), compiled (default), the whole step one "
                           "CUDA graph (75 of 78 steps replays of it)"), line


def test_on_a_captured_step_the_sweeps_rates_reach_the_graph(runs_dir, monkeypatch):
    """On CUDA the step is a graph replay: Adam reads its rate from ``StepGraph.lrs``, filled from the param groups
    before each replay, not from the groups lr-find sets. Here a stand-in for the graph (on a CPU nothing can be
    captured) replays the step with the rates ``lrs`` holds: the sweep is the eager path's (to float32's rounding of the
    rates), and all but the warm-up steps were replays (a rate that missed ``lrs`` would leave the replays at a stale
    one)."""
    from sinkflow import config
    from sinkflow.engine import step_graph
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.tools.lr_find import phase_lr_find
    from sinkflow.tools.phases import ready_trainer
    from test_prefetch import otcfm_step

    class Replay:
        """What the captured kernels do: the step on the static batch, Adam at the rates in ``lrs``."""
        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            g, groups = self.graph, self.graph.optimizer.param_groups
            kept = [group["lr"] for group in groups]
            for group, lr in zip(groups, g.lrs):
                group["lr"] = float(lr)
            try:
                g.outputs = g.update(g.static, g.step)
            finally:
                for group, lr in zip(groups, kept):
                    group["lr"] = lr

    def warmup(self):
        self.eager_steps += 1
        return self.update(self.static, self.step)

    def sweep(graph):
        cfg = config.resolve("moons", ["experiment.method=otcfm", "experiment.device=cpu", f"experiment.name={graph}",
                                       f"train.velocity.graph={graph}", "train.velocity.batch_size=64"])
        run = RunFolder.create(cfg)
        trainer = ready_trainer(run, otcfm_step(cfg))
        if graph == "step":
            trainer.step_graph.captures = True
            assert trainer.captures_steps
        res = phase_lr_find(trainer, start_lr=1e-5, end_lr=1, steps=30)
        run.logger.close()
        return res

    plain = sweep("none")
    monkeypatch.setattr(step_graph.StepGraph, "_warmup", warmup)
    monkeypatch.setattr(step_graph.StepGraph, "_capture", lambda self: setattr(self, "graph", Replay(self)))
    captured = sweep("step")
    # the same curve up to float32's rounding of the rates in ``lrs`` (the kernel reads a float32 tensor)
    assert len(captured.lrs) == len(plain.lrs) and captured.suggestions == plain.suggestions, (captured.summary(),
                                                                                               plain.summary())
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(captured.losses, plain.losses)), (captured.losses,
                                                                                                  plain.losses)
    assert captured.replays == len(captured.lrs) - step_graph.WARMUP and plain.replays is None


def finished_and_opened(*overrides: str):
    """A 12-step moons FM run trained to its end with ``overrides``, then opened as lr-find / doctor open a phase:
    (run folder, trainer, final.pt's state, the first batch final.pt's generator draws)."""
    from sinkflow import config
    from sinkflow.engine.trainer import Trainer
    from sinkflow.runtime.checkpoint import load
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.tools.phases import open_run_phase, training_phase

    cfg = config.resolve("moons", ["experiment.method=fm", "experiment.device=cpu", "experiment.name=r",
                                   "train.velocity.iters=12", *overrides])
    run = RunFolder.create(cfg)
    Trainer(run, training_phase(cfg, None)).fit()
    run.release()
    run.logger.close()
    final = load(run.dir / "checkpoints" / "velocity" / "final.pt")  # read before the opening
    opened, trainer = open_run_phase(run.dir, None)
    opened.logger.close()
    gen = torch.Generator()
    gen.set_state(final["generator"])
    first = trainer.task.batch(gen, cfg["train"]["velocity"]["batch_size"], trainer.device)
    return run.dir, trainer, final, first, gen


def test_a_finished_phase_without_a_step_checkpoint_is_opened_at_its_final_state(runs_dir):
    """`lr-find RUN` and `doctor RUN` open the run's phase through the loop's resume, which reads step checkpoints
    only: a finished phase with none (``ckpt_every`` above ``iters``) was swept from a fresh init under the run's name
    (step 0, weights unlike final.pt's). Its final state, optimizer and generator included, is the one opened now."""
    run_dir, trainer, final, first, _ = finished_and_opened("train.velocity.ckpt_every=1000",
                                                            "train.velocity.log_every=6")
    assert sorted(p.name for p in (run_dir / "checkpoints" / "velocity").iterdir()) == ["final.pt"]
    assert trainer.step == 12
    assert all(torch.equal(final["model"][k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.optimizer.state_dict()["state"][0]["step"] == 12
    assert all(torch.equal(a, b) for a, b in zip(trainer.batch, first))  # the batch final.pt's generator draws next


def test_a_finished_phase_opened_with_batches_drawn_ahead_keeps_its_final_generator(runs_dir):
    """With batches drawn ahead (``prefetch``: CUDA's default) the phase's final state is loaded before the first
    batch is drawn: the trainer's generator state (what its ``state_dict`` saves and lr-find's restore puts back)
    follows the batch it holds. Loaded after the loop had drawn ahead from the last step checkpoint's generator, the
    prefetcher's record of where the next batch came from still pointed into that earlier stream."""
    _, trainer, _, first, gen = finished_and_opened("train.velocity.ckpt_every=5", "train.velocity.prefetch=always")
    assert trainer.step == 12 and all(torch.equal(a, b) for a, b in zip(trainer.batch, first))
    assert torch.equal(trainer.state_dict()["generator"], gen.get_state())


def test_a_phases_sweep_holds_one_copy_of_the_state_not_two(runs_dir, monkeypatch):
    """``phase_lr_find`` restores the trainer's whole state from its own copy; ``lr_range_test`` (told restore=False)
    still copied the model, its gradients and the optimizer's moments once more and never used them: three times
    the weights held on the card for nothing (audit PP). The phase's sweep still leaves the trainer as it was."""
    from sinkflow import config
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.tools import lr_find
    from sinkflow.tools.phases import ready_trainer
    from test_prefetch import otcfm_step

    cfg = config.resolve("moons", ["experiment.method=otcfm", "train.velocity.iters=1000",
                                   "train.velocity.batch_size=32", "experiment.device=cpu"])
    run = RunFolder.create(cfg)
    trainer = ready_trainer(run, otcfm_step(cfg))
    copies, snapshot = [], lr_find._snapshot
    monkeypatch.setattr(lr_find, "_snapshot", lambda *a: copies.append(1) or snapshot(*a))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    lr_find.phase_lr_find(trainer, start_lr=1e-4, end_lr=1e-2, steps=6)
    run.logger.close()
    assert copies == []
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("grads", ["none", "held"])
def test_a_phases_sweep_leaves_the_gradients_as_they_were(runs_dir, grads):
    """``phase_lr_find`` restored the trainer from its ``state_dict``, which holds no gradients: the sweep's last
    step's gradients stayed on every parameter (a ready trainer has none; docs/preflight.md says the model's grads
    are restored bit for bit), one more copy of the weights held on the device after the sweep."""
    from sinkflow import config
    from sinkflow.runtime.run_folder import RunFolder
    from sinkflow.tools import lr_find
    from sinkflow.tools.phases import ready_trainer
    from test_prefetch import otcfm_step

    cfg = config.resolve("moons", ["experiment.method=otcfm", "train.velocity.iters=1000",
                                   "train.velocity.batch_size=32", "experiment.device=cpu"])
    run = RunFolder.create(cfg)
    trainer = ready_trainer(run, otcfm_step(cfg))
    if grads == "held":  # a caller's own gradients (a step of its own before the sweep) come back as they were
        for p in trainer.model.parameters():
            p.grad = torch.full_like(p, 0.5)
    before = [None if p.grad is None else p.grad.clone() for p in trainer.model.parameters()]
    lr_find.phase_lr_find(trainer, start_lr=1e-4, end_lr=1e-2, steps=6)
    run.logger.close()
    after = [p.grad for p in trainer.model.parameters()]
    assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(before, after))


@pytest.mark.parametrize("mode", ["1", "lines", "0"])
def test_the_sweep_says_its_progress_as_a_phase_does(runs_dir, capsys, monkeypatch, mode):
    """lr-find ran its whole sweep inside ``quiet()`` and said nothing until it ended: mnist's velocity phase on the
    2-core CPU took 47 s for 17 steps, so the default 100 are minutes of silence. Its steps are shown as a phase's
    now (in a log file, the default's choice there, or with SINKFLOW_PROGRESS=lines: whole lines with a rate and an
    ETA); SINKFLOW_PROGRESS=0 still shows nothing, and the scratch run's own bars stay muted."""
    from sinkflow.cli import main

    monkeypatch.setenv("SINKFLOW_PROGRESS", mode)
    monkeypatch.setenv("SINKFLOW_PROGRESS_EVERY", "0")
    assert main(["lr-find", "moons", "--method", "fm", "--device", "cpu", "--steps", "6", "--end-lr", "1e-2",
                 "--out", "lr.png"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lr-find velocity: ")]
    if mode == "0":
        assert lines == [], err
        return
    assert len(lines) == 6 and "\r" not in err and "velocity: " not in err.replace("lr-find velocity: ", ""), err
    assert lines[-1].startswith("lr-find velocity: 6/6 steps (100.0%), ") and "ETA 00:00" in lines[-1], err


def test_the_output_says_which_weights_the_sweep_started_from(runs_dir, capsys):
    """`lr-find RUN` of a finished phase sweeps the trained weights, whose best rate (to train on from there) is not a
    fresh run's, and the output did not say where the sweep had started; a preset's sweep starts at step 0."""
    from sinkflow.cli import main

    args = ["--steps", "4", "--end-lr", "1e-2", "--out", "lr.png"]
    assert main(["train", "moons", "--method", "fm", "--device", "cpu", "--train-iters", "3", "--batch-size", "16",
                 "--name", "f", "--no-report"]) == 0
    capsys.readouterr()
    assert main(["lr-find", str(runs_dir / "f"), *args]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("steps) from the run's weights at step 3 of 3 (finished: rates for training on from its "
                          "weights, not for a fresh start)"), first
    assert main(["lr-find", "moons", "--method", "fm", "--device", "cpu", "--batch-size", "16", *args]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "lr-find moons, phase velocity (batch 16, 4 steps) from step 0 (the phase's initial weights)", first


def test_a_coarse_sweep_says_its_picks_are_no_finer_than_its_steps():
    """`--steps 6` over the default 8 decades gave three picks to three digits from rates 1.6 decades apart (its
    steepest fall at its loss minimum) with nothing said; the summary now says how far apart the rates are and the
    steps that bring them within a quarter decade. The default sweep says nothing of it."""
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    res = lr_range_test(model, opt, loss_fn, batch_fn, start_lr=1e-6, end_lr=1.0, steps=9, diverge=1e9)
    assert res.suggestions, res.summary()
    assert res.summary().endswith("; coarse: the rates are 0.75 decades apart, so no pick is finer than that: raise "
                                  "--steps to 25 or more"), res.summary()
    res = lr_range_test(model, opt, loss_fn, batch_fn)  # the defaults: 100 steps over 1e-7..10, 0.081 apart
    assert res.suggestions and "coarse" not in res.summary(), res.summary()


def test_a_plot_over_an_earlier_one_says_it_replaced_it(runs_dir, capsys):
    """The default --out is lr_find.png in the working folder, so sweeping a run's phases one by one replaced each
    plot by the next with nothing said; the second sweep's line now says it replaced the file."""
    from sinkflow.cli import main

    args = ["lr-find", "moons", "--method", "fm", "--device", "cpu", "--batch-size", "16", "--steps", "4",
            "--end-lr", "1e-2", "--out", "lr.png"]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("plot: lr.png")
    assert main(args) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith("plot: lr.png (replacing the earlier file: --out NAME keeps both)"), last


def test_a_sweep_that_stops_early_says_its_last_count_in_lines(monkeypatch, capsys):
    """In a log file (SINKFLOW_PROGRESS=lines) the sweep's progress ends with a line of its last count, as a phase's
    does when it finishes, stops or fails. A sweep usually ends early (it diverges), and ``progress`` said that line
    only after a loop that ran to its end: a sweep that diverged within the line interval printed nothing at all."""
    monkeypatch.setenv("SINKFLOW_PROGRESS_EVERY", "3600")
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    res = lr_range_test(model, opt, loss_fn, batch_fn, start_lr=1e-4, end_lr=1e3, steps=60,
                        progress=("lr-find velocity", "lines"))
    assert res.stop_reason.startswith("diverged") and len(res.lrs) < 60, res.stop_reason
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lr-find velocity: ")]
    assert len(lines) == 1 and lines[0].startswith(f"lr-find velocity: {len(res.lrs)}/60 steps "), lines
