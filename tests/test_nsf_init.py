"""``nsgf.nsf_init: velocity``: NSGF++'s straight flow starts from the trained velocity network (on the real MNIST
shape, (N, 1, 28, 28)), a resume inside the NSF phase continues from its own checkpoint bit-for-bit (without reading
the velocity network first), and networks that differ are refused before a run folder exists."""

import pytest
import torch

from test_images import TINY_UNET, fresh_distributions, setup_data  # noqa: F401  (the fixture, for this module too)
from sinkflow import config
from sinkflow.engine.experiment import train_run
from sinkflow.methods.base import TrainingStep
from sinkflow.runtime.callbacks import Callback
from sinkflow.runtime.signals import Interrupted

OVERRIDES = ["pool.batches=3", "pool.batch_size=8", "pool.chunk=1", "pool.in_flight=1", "train.velocity.ckpt_every=3",
             "train.nsf.ckpt_every=2", "train.time.ckpt_every=3", "sample.nsf_steps=3", "eval.n=8", "eval.seeds=1",
             "data.download=false", "train.velocity.ema=0.9", "nsgf.nsf_init=velocity", *TINY_UNET]
SHORT = {"train_iters": 4, "batch_size": 4, "device": "cpu"}


class AtNSFStart(Callback):
    """The NSF network's weights before its first step; with ``stop_at``, a stop request at that step."""

    def __init__(self, stop_at=None):
        self.start, self.stop_at = None, stop_at

    def on_phase_start(self, trainer):
        if trainer.name == "nsf":
            self.start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    def on_train_batch_end(self, trainer, batch, outputs):
        if trainer.name == "nsf" and trainer.step == self.stop_at:
            trainer.request_stop()


def final(run_dir, phase):
    return torch.load(run_dir / "checkpoints" / phase / "final.pt", weights_only=True)


def test_the_straight_flow_starts_from_the_velocity_network_and_resumes_bit_equal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra, _ = setup_data("mnist", tmp_path)
    whole = AtNSFStart()
    train_run(config.resolve("mnist", [*OVERRIDES, *extra, "experiment.name=whole"], SHORT), callbacks=[whole])
    velocity = final(tmp_path / "runs" / "whole", "velocity")
    assert velocity["ema"] is not None  # the EMA weights are the ones a sampler (and the NSF) takes
    assert whole.start.keys() == velocity["ema"].keys()
    for k, v in velocity["ema"].items():
        assert torch.equal(whole.start[k], v), k
    assert any(not torch.equal(velocity["ema"][k], velocity["model"][k]) for k in velocity["model"])

    cut = AtNSFStart(stop_at=2)
    with pytest.raises(Interrupted):
        train_run(config.resolve("mnist", [*OVERRIDES, *extra, "experiment.name=cut"], SHORT), callbacks=[cut])
    asked = []  # a phase resumed from its own checkpoint does not read the velocity network's final.pt first
    warm_start = TrainingStep.initial_weights
    monkeypatch.setattr(TrainingStep, "initial_weights",
                        lambda task, run: asked.append(task.name) or warm_start(task, run))
    train_run(resume=tmp_path / "runs" / "cut")
    assert "nsf" not in asked
    a, b = final(tmp_path / "runs" / "whole", "nsf"), final(tmp_path / "runs" / "cut", "nsf")
    assert a["step"] == b["step"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_the_paper_init_is_fresh(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra, _ = setup_data("mnist", tmp_path)
    seen = AtNSFStart()
    train_run(config.resolve("mnist", [*OVERRIDES, *extra, "experiment.name=r", "nsgf.nsf_init=random"], SHORT),
              callbacks=[seen])
    velocity = final(tmp_path / "runs" / "r", "velocity")["ema"]
    differ = [k for k, v in velocity.items() if not torch.equal(seen.start[k], v)]
    assert len(differ) > len(velocity) / 2, differ  # (a parameter no step reached is its init in both)


def test_networks_that_differ_are_refused_before_a_run_folder(tmp_path, monkeypatch, capsys):
    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    extra, _ = setup_data("mnist", tmp_path)
    assert main(["train", "mnist", *OVERRIDES, *extra, "model.nsf.channels=16", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sinkflow: error: nsgf.nsf_init=velocity starts the straight flow from the velocity "
                          "network, but model.nsf and model.velocity differ in channels; give both")
    assert not (tmp_path / "runs").exists()
