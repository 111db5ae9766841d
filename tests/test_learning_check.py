"""A training phase whose loss did not fall says so at its end (``sinkflow.engine.learning``): a run that silently
did not learn, the users' pain that no guard saw (nothing diverged, nothing was non-finite)."""

import logging

import pytest
import torch

from sinkflow import config, methods
from sinkflow.engine.learning import LearningCheck
from sinkflow.engine.trainer import Trainer
from sinkflow.methods.flow_matching import InterpolantStep
from sinkflow.methods.nsgfpp import TimeStep
from sinkflow.runtime.callbacks import LEARNING_LOG
from sinkflow.runtime.run_folder import RunFolder


def train_fm(name, *overrides, iters=120):
    cfg = config.resolve("moons", ["experiment.method=fm", f"train.velocity.iters={iters}", "experiment.device=cpu",
                                   "train.velocity.batch_size=64", "train.velocity.log_every=20",
                                   "train.velocity.warmup=0", f"experiment.name={name}", *overrides])
    run = RunFolder.create(cfg)
    source, target = methods.distributions(cfg)
    trainer = Trainer(run, InterpolantStep("velocity", source, target))
    trainer.fit()
    run.logger.close()
    return trainer


def learning_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LEARNING_LOG]


def test_a_phase_whose_loss_did_not_fall_says_so_and_one_that_learned_does_not(runs_dir, caplog):
    with caplog.at_level(logging.WARNING, logger=LEARNING_LOG):
        train_fm("frozen", "train.velocity.lr=1e-12")  # the network never moves: the loss stays where it began
    (line,) = learning_warnings(caplog)
    assert line.startswith("velocity: the loss did not fall (") and "the one trained to step 120: 100%)" in line
    assert "train.velocity.lr (now 1e-12; `sinkflow lr-find --phase velocity`" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LEARNING_LOG):
        train_fm("learns")  # the preset's lr: on the same batch the trained network's loss is well below the initial one's
        train_fm("short", "train.velocity.lr=1e-12", iters=60)  # too short to judge (smoke tests, tools' cut runs)
    assert learning_warnings(caplog) == []


def test_the_verdict_is_recorded_and_status_says_it_after_the_run(runs_dir):
    """The warning was the console's alone: after a frozen run `sinkflow status` said FINISHED, and neither
    metrics.jsonl nor TensorBoard held the check. Both probe losses and the verdict are recorded at the phase's last
    step, and status says a phase that did not learn (and nothing of one that did)."""
    import json

    from sinkflow.tools.status import format_status, read_status

    for name, lr, learned in (("frozen", "1e-12", False), ("learns", "1e-3", True)):
        train_fm(name, f"train.velocity.lr={lr}")
        (rec,) = [r for r in map(json.loads, (runs_dir / name / "metrics.jsonl").read_text().splitlines())
                  if "learned" in r]
        assert (rec["phase"], rec["step"], rec["learned"]) == ("velocity", 120, learned)
        assert (rec["probe_loss_end"] == rec["probe_loss_start"] > 0) is not learned
        said = [line for line in format_status(read_status(runs_dir / name)).splitlines()
                if line.startswith("learning")]
        assert said == ([] if learned else [f"learning     velocity: the loss did not fall ({rec['probe_loss_start']:.4g} "
                                            f"on a fixed batch at the phase start, {rec['probe_loss_end']:.4g}: 100%): "
                                            "the phase may not have learned; check train.velocity.lr"])


def test_a_resumed_phase_is_judged_against_where_it_began(runs_dir, caplog):
    """The initial network's loss lives in the phase's checkpoints: a phase killed after its step-60 checkpoint and
    resumed is judged against the loss it began with (the run's own, bit-equal to an uninterrupted run's), not
    against the step-60 network it was resumed at (a phase resumed past step 0 measures none)."""
    from sinkflow.cli import main

    args = ["train", "moons", "--method", "fm", "--device", "cpu", "--train-iters", "120", "train.velocity.warmup=0",
            "train.velocity.batch_size=64", "train.velocity.ckpt_every=60", "--no-report"]
    assert main([*args, "--name", "whole"]) == 0
    assert main([*args, "--name", "r"]) == 0
    ckpts = runs_dir / "r/checkpoints/velocity"
    (ckpts / "final.pt").unlink()  # as if killed after its step-60 checkpoint
    (ckpts / "step_00000120.pt").unlink(missing_ok=True)
    assert (ckpts / "step_00000060.pt").exists()
    with caplog.at_level(logging.INFO):
        assert main(["train", "--resume", str(runs_dir / "r"), "--no-report"]) == 0
    assert "resuming from step 60" in caplog.text and not learning_warnings(caplog)

    def initial(run):
        return torch.load(runs_dir / run / "checkpoints/velocity/final.pt", weights_only=True)["callbacks"][
            "LearningCheck"]["initial"]

    assert initial("r") == initial("whole") > 0


def test_the_time_predictor_keeps_its_own_sharper_check(runs_dir):
    cfg = config.resolve("digits", ["experiment.device=cpu"])
    run = RunFolder.create(cfg)
    source, target = methods.distributions(cfg)
    kinds = {type(cb) for cb in Trainer(run, TimeStep(source, target)).callbacks}
    assert LearningCheck not in kinds
    assert LearningCheck in {type(cb) for cb in Trainer(run, InterpolantStep("velocity", source, target)).callbacks}
    run.logger.close()


@pytest.mark.parametrize("preset,extra", [
    ("moons", ["--method", "fm", "train.velocity.batch_size=32"]),
    # a Glow: ActNorm initialised from the first batch before the check's first forward, the 1x1 convs' caches
    ("flow-digits", ["model.flow.hidden_channels=8", "model.flow.depth_per_level=2", "train.flow.batch_size=8",
                     "train.flow.warmup=0"]),
])
def test_the_check_leaves_the_training_bit_equal(runs_dir, monkeypatch, preset, extra):
    from sinkflow.cli import main
    from sinkflow.methods.base import TrainingStep

    args = ["train", preset, *extra, "--device", "cpu", "--train-iters", "100", "--no-report"]
    assert main([*args, "--name", "checked"]) == 0
    monkeypatch.setattr(TrainingStep, "learning_check", False)
    assert main([*args, "--name", "plain"]) == 0
    phase = "velocity" if preset == "moons" else "flow"

    def final(run):
        state = torch.load(runs_dir / run / "checkpoints" / phase / "final.pt", weights_only=True)
        return state["model"], state["callbacks"]

    (a, checked), (b, plain) = final("checked"), final("plain")
    assert "LearningCheck" in checked and "LearningCheck" not in plain
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("preset,method", [("mnist", "nsgfpp"), ("cifar10", "otcfm")])
def test_the_check_leaves_the_unet_phases_bit_equal(runs_dir, tmp_path, monkeypatch, preset, method):
    """At the image shapes, (N, 1, 28, 28) and (N, 3, 32, 32), with a tiny UNet: NSGF++'s velocity phase and its NSF
    phase (which reads the disk pool), and OT-CFM (its coupling solved per batch): the check runs its probe forwards
    (its step threshold lowered so that 12 steps are judged) and the weights equal a run without it; the initial
    loss is kept in each phase's checkpoint. Dropout on, so a probe forward that drew random numbers (not in eval
    mode) would change the training that follows."""
    from sinkflow import methods as registry
    from sinkflow.cli import main
    from sinkflow.engine import learning
    from sinkflow.methods.base import TrainingStep
    from test_images import TINY, TINY_FM, setup_data

    monkeypatch.setattr(learning, "MIN_STEPS", 10)
    extra, _ = setup_data(preset, tmp_path)
    if method != "nsgfpp":  # OT-CFM reads no NSF key (config.check_read)
        extra = [o for o in extra if not o.startswith("model.nsf.")]
    args = ["train", preset, "--method", method, *(TINY if method == "nsgfpp" else TINY_FM), *extra,
            "--train-iters", "12", "--no-report", "model.velocity.dropout=0.1"]
    if method == "nsgfpp":
        args += ["pool.storage=disk", "pool.dtype=float16", "model.nsf.dropout=0.1"]
    phases = ("velocity", "nsf") if method == "nsgfpp" else ("velocity",)
    registry._distributions.cache_clear()
    assert main([*args, "--name", "checked"]) == 0
    monkeypatch.setattr(TrainingStep, "learning_check", False)
    assert main([*args, "--name", "plain"]) == 0
    for phase in phases:
        checked, plain = (torch.load(runs_dir / run / "checkpoints" / phase / "final.pt", weights_only=True)
                          for run in ("checked", "plain"))
        assert checked["callbacks"]["LearningCheck"]["initial"] > 0 and "LearningCheck" not in plain["callbacks"]
        a, b = checked["model"], plain["model"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), phase
    registry._distributions.cache_clear()
