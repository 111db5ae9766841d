"""``nsgf.nsf_source: velocity``: NSGF++'s straight flow and time predictor learn paths that start at the trained
velocity network's own NSGF states (on the real MNIST and CIFAR-10 shapes, (N, 1, 28, 28) and (N, 3, 32, 32)): the
states are that network's, computed once and kept in the run folder, every straight-flow batch starts at one of them,
a resume inside the straight-flow phase is bit-equal, a read-only look at a run does not write them, and a config
that cannot work is refused first."""

import json

import numpy as np
import pytest
import torch

from test_images import TINY_UNET, fresh_distributions, setup_data  # noqa: F401  (the fixture, for this module too)
from sinkflow import config, data
from sinkflow.engine.experiment import train_run
from sinkflow.errors import SinkflowError
from sinkflow.methods import nsgfpp
from sinkflow.runtime.callbacks import Callback
from sinkflow.runtime.rng import phase_generator
from sinkflow.runtime.run_folder import RunFolder, read_config
from sinkflow.runtime.signals import Interrupted

N_STATES = 24
OVERRIDES = ["pool.batches=3", "pool.batch_size=8", "pool.chunk=1", "pool.in_flight=1", "train.nsf.ckpt_every=2",
             "sample.nsf_steps=3", "eval.n=8", "eval.seeds=1", "data.download=false", "train.velocity.ema=0.9",
             "train.velocity.warmup=0",  # cifar10's 5,000-step warm-up would leave 4 steps unmoved
             "nsgf.nsf_source=velocity", f"nsgf.nsf_states={N_STATES}", *TINY_UNET]
SHORT = {"train_iters": 4, "batch_size": 4, "device": "cpu"}


class Batches(Callback):
    """Each phase's first batch; with ``stop_at``, a stop request at that step of the straight-flow phase."""

    def __init__(self, stop_at=None):
        self.first, self.stop_at = {}, stop_at

    def on_train_batch_end(self, trainer, batch, outputs):
        self.first.setdefault(trainer.name, batch)
        if trainer.name == "nsf" and trainer.step == self.stop_at:
            trainer.request_stop()


def expected_states(run_dir):
    """The velocity network's NSGF part from the states' own noise stream, recomputed here."""
    run = RunFolder(run_dir, read_config(run_dir), log=False)
    source, _ = data.distributions(run.cfg)
    x0 = source.sample(N_STATES, phase_generator(run.cfg["experiment"]["seed"], "nsf_states"))
    times, etas = nsgfpp.nsgf_grid(run.cfg)
    return nsgfpp.nsgf_part(run.model("velocity"), x0, times, etas), x0


@pytest.mark.parametrize("preset", ["mnist", "cifar10"])
def test_the_straight_flow_starts_at_the_velocity_networks_states_and_resumes_bit_equal(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra, shape = setup_data(preset, tmp_path)
    whole = Batches()
    train_run(config.resolve(preset, [*OVERRIDES, *extra, "experiment.name=whole"], SHORT), callbacks=[whole])
    run_dir = tmp_path / "runs" / "whole"
    kept = np.load(run_dir / nsgfpp.STATES_FILE, allow_pickle=False)
    assert kept.shape == (N_STATES, *shape) and kept.dtype == np.float32
    states, noise = expected_states(run_dir)
    assert torch.allclose(torch.from_numpy(kept), states, atol=1e-5)
    assert (states - noise).abs().mean() > 1e-3  # the network (4 steps here) moved them: these are not the noise

    for phase in ("nsf", "time"):  # x_t = x0 + t (x1 - x0): every path's x0 is one of the kept states
        x, t = whole.first[phase][:2]
        if phase == "nsf":
            x0 = x - t.view(-1, 1, 1, 1) * whole.first[phase][2]
            gap = torch.cdist(x0.flatten(1), states.flatten(1)).min(1).values
            assert gap.max() < 1e-3, gap
        assert x.shape == (4, *shape)

    cut = Batches(stop_at=2)
    with pytest.raises(Interrupted):
        train_run(config.resolve(preset, [*OVERRIDES, *extra, "experiment.name=cut"], SHORT), callbacks=[cut])
    saved = np.load(tmp_path / "runs" / "cut" / nsgfpp.STATES_FILE, allow_pickle=False)
    train_run(resume=tmp_path / "runs" / "cut")
    assert np.array_equal(np.load(tmp_path / "runs" / "cut" / nsgfpp.STATES_FILE, allow_pickle=False), saved)
    for phase in ("nsf", "time"):
        a = torch.load(run_dir / "checkpoints" / phase / "final.pt", weights_only=True)
        b = torch.load(tmp_path / "runs" / "cut" / "checkpoints" / phase / "final.pt", weights_only=True)
        assert a["step"] == b["step"] == 4
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (phase, k)

    # a read-only look at the run (lr-find, doctor) computes the states, writes nothing
    (run_dir / nsgfpp.STATES_FILE).unlink()
    look = nsgfpp.NSGFStates(data.distributions(read_config(run_dir))[0])
    look.open(RunFolder(run_dir, read_config(run_dir), log=False))
    assert torch.allclose(look.states, states, atol=1e-5)
    assert not (run_dir / nsgfpp.STATES_FILE).exists()

    # states that are not the run's are refused in one line naming the file and the fix
    np.save(run_dir / nsgfpp.STATES_FILE, np.zeros((3, 1, 28, 28), np.float32), allow_pickle=False)
    with pytest.raises(SinkflowError, match="not the run's 24 float32 states.*delete"):
        nsgfpp.NSGFStates(look.source).open(RunFolder(run_dir, read_config(run_dir)))


def test_states_are_drawn_only_once_opened():
    states = nsgfpp.NSGFStates(type("S", (), {"shape": (2,)})())
    with pytest.raises(SinkflowError, match="before the phase opened them"):
        states.sample(4, torch.Generator())


def test_a_straight_flow_trained_only_late_is_refused_before_a_run_folder(tmp_path, monkeypatch, capsys):
    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    extra, _ = setup_data("mnist", tmp_path)
    assert main(["train", "mnist", *OVERRIDES, *extra, "nsgf.nsf_t_min=0.5", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sinkflow: error: nsgf.nsf_source=velocity starts the straight flow's paths at the NSGF "
                          "states (t = 0), but nsgf.nsf_t_min=0.5 trains it only from there on; set nsgf.nsf_t_min=0")
    assert not (tmp_path / "runs").exists()


def test_a_signal_while_the_states_are_computed_stops_before_the_straight_flow_steps(tmp_path, monkeypatch):
    """A SIGTERM while rank 0 computes the states: the computation ran to its end first (under torchrun the other ranks
    waited for it, and 16,384 CIFAR states on a slow card can outlast torchrun's 30 s before its SIGKILL: no stop
    line, status DEAD). It stops between two of the sampler's chunks now, keeps no states file, the phase stops at
    step 0 as on any stop, and the resume computes the same states."""
    import signal

    from sinkflow.runtime import signals
    from sinkflow.tools.status import format_status, read_status

    monkeypatch.chdir(tmp_path)
    extra, _ = setup_data("mnist", tmp_path)
    cfg = config.resolve("mnist", [*OVERRIDES, *extra, "experiment.name=sig", "sample.batch_size=8"], SHORT)
    real, calls = nsgfpp.nsgf_part, []

    def signalled_after_first_chunk(*args, **kwargs):
        calls.append(1)
        signals._requested.append(signal.SIGTERM)  # what the handler does on SIGTERM
        return real(*args, **kwargs)

    monkeypatch.setattr(nsgfpp, "nsgf_part", signalled_after_first_chunk)
    with pytest.raises(Interrupted) as stop:
        train_run(cfg)
    run_dir = tmp_path / "runs" / "sig"
    assert (stop.value.phase, stop.value.step, stop.value.signum) == ("nsf", 0, signal.SIGTERM)
    assert len(calls) == 1 and not (run_dir / nsgfpp.STATES_FILE).exists()  # 1 of 3 chunks, nothing kept
    assert "STOPPED" in format_status(read_status(run_dir))
    monkeypatch.setattr(nsgfpp, "nsgf_part", real)
    train_run(resume=run_dir)
    states, _ = expected_states(run_dir)
    assert torch.allclose(torch.from_numpy(np.load(run_dir / nsgfpp.STATES_FILE, allow_pickle=False)), states,
                          atol=1e-5)


def test_states_that_overflow_float16_are_refused_naming_the_precision(tiny_run):
    """The states are a sample of the velocity network under sample.precision: a network output float16 cannot hold
    (scaled by 1e6 after its last half-precision product, as the sampler's own test does) made Inf states, which were
    kept in RUN/nsf_states.npy; the straight flow then stopped at its first log step on a NaN loss, "lower the learning
    rate", and a resume read the same file. Refused in one line naming fp16 before anything is kept; in fp32 the same
    network's states are finite."""
    run = RunFolder(tiny_run, read_config(tiny_run), log=False)  # read-only: the states are computed, never written
    net = run.model("velocity")
    last = [m for m in net.modules() if isinstance(m, torch.nn.Linear)][-1]
    last.register_forward_hook(lambda m, i, out: out * 1e6)  # in the layer's own dtype: float16 under autocast
    run.model = lambda phase: net  # loaded once, so the count below is not checked against its checkpoint's
    run.cfg["nsgf"]["nsf_states"] = 64
    states = nsgfpp.NSGFStates(data.distributions(run.cfg)[0])
    states.open(run)
    assert np.isfinite(states.states.numpy()).all() and states.states.abs().max() > 1e4  # fp32 holds it
    run.cfg["sample"]["precision"] = "fp16"
    with pytest.raises(SinkflowError) as e:
        nsgfpp.NSGFStates(states.source).open(run)
    assert e.value.problem == "64 of 64 NSGF states for the straight flow's paths (nsgf.nsf_source=velocity) are " \
                              "NaN/Inf under sample.precision=fp16"
    assert "sample.precision=bf16" in e.value.fix
    assert not (tiny_run / nsgfpp.STATES_FILE).exists()


def test_the_states_do_not_depend_on_the_sampling_batch(tmp_path, monkeypatch):
    """The states were drawn chunk by chunk, ``sample.batch_size`` rows a draw: another batch size (a sampling key a
    resume may change before the states are computed, the fix an out-of-memory there names) drew other noise, and the
    straight flow and time predictor trained on other states than the run it continued. The noise is one draw now;
    only the network's chunks follow ``sample.batch_size``."""
    monkeypatch.chdir(tmp_path)
    cfg = config.resolve("moons", ["experiment.method=nsgfpp", "nsgf.nsf_source=velocity", "nsgf.nsf_states=40",
                                   "pool.batches=2", "pool.steps=3", "pool.batch_size=32", "pool.chunk=1",
                                   "experiment.name=s"], {"train_iters": 2, "device": "cpu"})
    train_run(cfg).logger.close()
    run_dir = tmp_path / "runs" / "s"
    kept = np.load(run_dir / nsgfpp.STATES_FILE, allow_pickle=False)  # sample.batch_size 500: one chunk
    for rows in (7, 16):
        view = read_config(run_dir)
        view["sample"]["batch_size"] = rows
        source, _ = data.distributions(view)
        assert np.array_equal(nsgfpp.NSGFStates(source)._compute(RunFolder(run_dir, view, log=False), stoppable=False),
                              kept), rows


def test_out_of_memory_while_the_states_are_computed_names_the_sampling_batch(tmp_path, monkeypatch, capsys):
    """The states go through the network in sampling's chunks (``sample.batch_size``), before the straight flow's
    first step; an out-of-memory error there said "in nsf at step 1; resume with double train.nsf.accum", a resume
    that ran out of memory again. It names the sampling batch now, and the resume with a smaller one finishes."""
    from helpers import error_line, run_main

    monkeypatch.chdir(tmp_path)
    real = nsgfpp.nsgf_part

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(nsgfpp, "nsgf_part", out_of_memory)
    args = ["moons", "--method", "nsgfpp", "nsgf.nsf_source=velocity", "nsgf.nsf_states=40", "pool.batches=2",
            "pool.steps=3", "pool.batch_size=32", "pool.chunk=1", "--train-iters", "2", "--device", "cpu"]
    line = error_line(*run_main(capsys, "train", *args, "--no-report", "--name", "o"),
                      "CUDA out of memory in the NSGF states", "sample.batch_size", "--resume")
    assert "accum" not in line and "step 1" not in line
    monkeypatch.setattr(nsgfpp, "nsgf_part", real)
    rc, err = run_main(capsys, "train", "--resume", str(tmp_path / "runs" / "o"), "--no-report", "sample.batch_size=8")
    assert rc == 0, err


def test_a_long_states_computation_beats_and_status_counts_its_states(tmp_path, monkeypatch):
    """Nothing wrote a heartbeat while rank 0 computed NSGF++'s states (16,384 CIFAR states on a slow card: minutes),
    so `sinkflow status` said STALE after its 300 s of silence (audit KK). The computation beats every
    ``HEARTBEAT_EVERY_S`` (0 here: every chunk) with the states done, which status counts as states."""
    from sinkflow.runtime.metrics import MetricsLogger
    from sinkflow.tools.status import format_status, read_status

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(nsgfpp, "HEARTBEAT_EVERY_S", 0.0)
    beats = []
    real = MetricsLogger.heartbeat

    def seen(self, **status):
        if status.get("unit") == "states":
            beats.append(status)
        return real(self, **status)

    monkeypatch.setattr(MetricsLogger, "heartbeat", seen)
    cfg = config.resolve("moons", ["experiment.method=nsgfpp", "nsgf.nsf_source=velocity", "nsgf.nsf_states=40",
                                   "sample.batch_size=16", "pool.batches=2", "pool.steps=3", "pool.batch_size=32",
                                   "pool.chunk=1", "experiment.name=b"], {"train_iters": 2, "device": "cpu"})
    train_run(cfg).logger.close()
    assert [(b["phase"], b["done"], b["of"]) for b in beats] == [("nsf", 0, 40), ("nsf", 16, 40), ("nsf", 32, 40)]
    run_dir = tmp_path / "runs" / "b"
    (run_dir / "status.json").write_text(json.dumps({**beats[1], "time": 0.0, "pid": 1, "host": "elsewhere"}))
    assert "phase        nsf  states 16/40 (40.0%)" in format_status(read_status(run_dir)), \
        format_status(read_status(run_dir))


def test_a_tools_scratch_run_asks_the_method_what_of_its_own_to_cut():
    """doctor's and lr-find's scratch runs keep NSGF++'s states to a few hundred (the run's 16,384 would be computed
    before the straight flow's first step); the tools ask the method (``Method.scratch_overrides``), so no tool names
    NSGF++'s keys, and a method without such keys cuts nothing."""
    from sinkflow.tools.phases import scratch_overrides

    cfg = config.resolve("moons", ["experiment.method=nsgfpp", "nsgf.nsf_source=velocity"])
    assert scratch_overrides(cfg) == [f"nsgf.nsf_states={nsgfpp.SCRATCH_STATES}"]
    small = config.resolve("moons", ["experiment.method=nsgfpp", "nsgf.nsf_states=100"])
    assert scratch_overrides(small) == ["nsgf.nsf_states=100"]
    assert scratch_overrides(config.resolve("moons", ["experiment.method=otcfm"])) == []
