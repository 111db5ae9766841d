"""``train.<phase>.graph: step`` (the whole step as one CUDA graph, sinkflow.engine.step_graph) and the EMA without
host reads. On a CPU nothing is captured, but the step runs through the same static tensors: these tests pin that
path to the plain one bit for bit, at every experiment shape, with a resume, a skipped non-finite step and no host
read; the capture itself is checked where CUDA is (the last test, and benchmarks/gpu_checks.py)."""

import contextlib
import math

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from sinkflow import config, methods
from sinkflow.engine import fast_path
from sinkflow.engine.ema import EMA
from sinkflow.engine.step_graph import WARMUP, StepGraph
from sinkflow.engine.trainer import Trainer, check_step_graph
from sinkflow.errors import SinkflowError
from sinkflow.methods.flow_matching import InterpolantStep
from sinkflow.runtime.run_folder import RunFolder
from sinkflow.runtime.signals import Interrupted
from helpers import nan_gradient_phase
from test_prefetch import CountReads, Snapshots, StopAt, final_weights, moons_cfg, otcfm_step


def fit(cfg, name, callbacks=(), task=None):
    cfg["experiment"]["name"] = name
    run = RunFolder.create(cfg)
    trainer = Trainer(run, task or otcfm_step(cfg), callbacks)
    trainer.fit()
    run.logger.close()
    return run, trainer


def test_a_graphed_step_trains_the_plain_weights_and_resumes_bit_equal(runs_dir, caplog):
    """(N, 2), OT-CFM, with EMA: the same final weights and EMA weights as graph=none, also across a SIGTERM resume."""
    ema = "train.velocity.ema=0.9"
    plain_run, _ = fit(moons_cfg(ema), "plain")
    with caplog.at_level("INFO"):
        graph_run, trainer = fit(moons_cfg(ema, "train.velocity.graph=step"), "graph")
    assert isinstance(trainer.step_graph, StepGraph) and not trainer.captures_steps  # a CPU: run eagerly
    assert "the step graph's path run eagerly" in caplog.text
    plain, graphed = final_weights(plain_run), final_weights(graph_run)
    assert all(torch.equal(plain[k], graphed[k]) for k in plain)
    from sinkflow.runtime.checkpoint import load

    ema_plain = load(plain_run.dir / "checkpoints" / "velocity" / "final.pt")["ema"]
    ema_graph = load(graph_run.dir / "checkpoints" / "velocity" / "final.pt")["ema"]
    assert all(torch.equal(ema_plain[k], ema_graph[k]) for k in ema_plain)

    cfg = moons_cfg(ema, "train.velocity.graph=step")
    cfg["experiment"]["name"] = "stopped"
    run = RunFolder.create(cfg)
    with pytest.raises(Interrupted):
        Trainer(run, otcfm_step(cfg), [StopAt(6)]).fit()
    Trainer(run, otcfm_step(cfg)).fit()
    run.logger.close()
    resumed = final_weights(run)
    assert all(torch.equal(plain[k], resumed[k]) for k in plain)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("preset", ["mnist", "cifar10"])
def test_a_graphed_step_at_the_image_shapes_with_accumulation(runs_dir, preset, precision):
    """(N, 1, 28, 28) and (N, 3, 32, 32) through a tiny UNet, two micro-batches: bit-equal to graph=none; also in
    float16 (the CUDA default for UNets: GradScaler scales each micro-batch's loss and unscales their sum)."""
    from sinkflow.tools.data import real_or_synthetic

    def cfg(*extra):
        return config.resolve(preset, ["experiment.method=fm", "experiment.device=cpu",
                                       "model.velocity.channels=8", "model.velocity.attention_resolutions=[]",
                                       "model.velocity.num_head_channels=-1", "model.velocity.channel_mult=[1,2]",
                                       "train.velocity.iters=3", "train.velocity.batch_size=4",
                                       "train.velocity.accum=2", "train.velocity.log_every=2",
                                       f"train.velocity.precision={precision}", *extra])

    with real_or_synthetic(config.resolve(preset), force=True):
        runs = []
        for name, extra in (("plain", ()), ("graph", ("train.velocity.graph=step",))):
            c = cfg(*extra)
            source, target = methods.distributions(c)
            runs.append(fit(c, f"{preset}-{precision}-{name}", task=InterpolantStep("velocity", source, target))[0])
    plain, graphed = final_weights(runs[0]), final_weights(runs[1])
    assert next(v for k, v in plain.items() if v.dim() == 4).dim() == 4  # really a conv net
    assert all(torch.equal(plain[k], graphed[k]) for k in plain)


def test_a_graphed_step_reads_nothing_from_the_device(runs_dir, monkeypatch):
    counter = CountReads(monkeypatch)
    cfg = moons_cfg("train.velocity.log_every=10", "train.velocity.ckpt_every=100", "train.velocity.graph=step",
                    method="fm", iters=20)
    source, target = methods.distributions(cfg)
    fit(cfg, "nosync", [counter], InterpolantStep("velocity", source, target))
    assert counter.count == 0


def test_a_graphed_step_skips_a_non_finite_update_on_the_device(runs_dir):
    cfg = moons_cfg("train.velocity.log_every=5", "train.velocity.ckpt_every=100", "train.velocity.graph=step")
    cfg["experiment"]["name"] = "nan"
    run = RunFolder.create(cfg)
    snaps = Snapshots()
    trainer = Trainer(run, nan_gradient_phase(cfg, 3, ot_pairs=True), [snaps])
    with pytest.raises(SinkflowError) as e:
        trainer.fit()
    run.logger.close()
    assert "non-finite gradient norm" in str(e.value) and "at step 3" in str(e.value), str(e.value)
    assert trainer.step == 5  # ran on to the log step, where the device's record is read
    for step in (3, 4, 5):  # the bad update and every later one were skipped on the device
        assert all(torch.equal(snaps.weights[2][k], snaps.weights[step][k]) for k in snaps.weights[2])
    assert not any(torch.equal(snaps.weights[1][k], snaps.weights[2][k]) for k in snaps.weights[1] if "weight" in k)


def test_a_graphed_fp16_step_scales_skips_and_trains_the_plain_weights(runs_dir):
    """float16: GradScaler's scale, unscale, skip and scale update run inside the step (no host read): the same
    weights, scale and applied updates as graph=none; the NaN-gradient step 4 is skipped and the scale halved."""
    from sinkflow.engine.finite import optimizer_steps

    results = {}
    for mode in ("none", "step"):
        cfg = moons_cfg("train.velocity.precision=fp16", f"train.velocity.graph={mode}")
        run, trainer = fit(cfg, f"fp16-{mode}", task=nan_gradient_phase(cfg, 4, ot_pairs=True))
        results[mode] = (final_weights(run), float(trainer.scaler.get_scale()), optimizer_steps(trainer.optimizer))
    (plain, scale, steps), (graphed, graph_scale, graph_steps) = results["none"], results["step"]
    assert all(torch.isfinite(plain[k]).all() and torch.equal(plain[k], graphed[k]) for k in plain)
    # 12 steps, two skipped: one overflow at GradScaler's starting scale 2**16 (as unpoisoned) and the poisoned step
    assert scale == graph_scale == 2.0 ** 14 and steps == graph_steps == 10

    # stopped by SIGTERM after step 6 and resumed: the scale comes back from the checkpoint, the weights are the same
    cfg = moons_cfg("train.velocity.precision=fp16", "train.velocity.graph=step")
    cfg["experiment"]["name"] = "fp16-stopped"
    run = RunFolder.create(cfg)
    with pytest.raises(Interrupted):
        Trainer(run, nan_gradient_phase(cfg, 4, ot_pairs=True), [StopAt(6)]).fit()
    trainer = Trainer(run, nan_gradient_phase(cfg, 99, ot_pairs=True))  # step 4 is behind it: nothing to poison
    trainer.fit()
    run.logger.close()
    resumed = final_weights(run)
    assert all(torch.equal(plain[k], resumed[k]) for k in plain) and float(trainer.scaler.get_scale()) == 2.0 ** 14


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_capture_that_fails_trains_on_without_the_graph_under_auto_and_stops_with_the_fix_when_asked(
        runs_dir, caplog, monkeypatch, precision):
    """A user's network that a CUDA graph cannot hold (a host read in its forward, an op capture refuses) must not
    lose the run to the CUDA default `graph: auto`: it trains on with the plain step after one warning and ends with
    graph=none's weights (nothing of the failed capture applied; under fp16 GradScaler had unscaled the step's
    gradients when the capture failed, and its next unscale_ refused: "unscale_() has already been called"); a step
    checkpoint still records what auto resolved to, so a resume on the same machine says no speed setting changed.
    An explicit `graph: step` stops with one line naming the key. The capture's failure is planted
    (helpers.plant_capture_failure; on a card: benchmarks/gpu_checks.py)."""
    from helpers import plant_capture_failure

    plant_capture_failure(monkeypatch)
    half = f"train.velocity.precision={precision}"
    plain = final_weights(fit(moons_cfg(half, "train.velocity.graph=none"), "plain")[0])
    with caplog.at_level("WARNING"):
        run, trainer = fit(moons_cfg(half, "train.velocity.graph=auto"), "auto")
    assert "velocity: capturing phase 'velocity''s training step as a CUDA graph failed: CUDA error: operation not " \
           "permitted when stream is capturing; training without the step graph" in caplog.text
    assert trainer.step_graph is None and caplog.text.count("training without the step graph") == 1
    fallback = final_weights(run)
    assert all(torch.equal(plain[k], fallback[k]) for k in plain)

    cfg = moons_cfg(half, "train.velocity.graph=auto", iters=12)
    cfg["experiment"]["name"] = "resumed"
    run = RunFolder.create(cfg)
    with pytest.raises(Interrupted):
        Trainer(run, otcfm_step(cfg), [StopAt(6)]).fit()
    saved = torch.load(run.dir / "checkpoints" / "velocity" / "step_00000006.pt", weights_only=True)
    assert saved["resolved"]["graph"] == "step"  # auto's answer here, though steps 4-6 ran without the graph
    caplog.clear()
    with caplog.at_level("INFO", logger="sinkflow"):
        Trainer(run, otcfm_step(cfg)).fit()
    run.logger.close()
    assert "resuming from step 6" in caplog.text and "training without the step graph" in caplog.text
    assert "resumes in" not in caplog.text, caplog.text

    cfg = moons_cfg(half, "train.velocity.graph=step")
    cfg["experiment"]["name"] = "asked"
    run = RunFolder.create(cfg)
    with pytest.raises(SinkflowError, match=r"as a CUDA graph failed: .*; set train.velocity.graph=none") as err:
        Trainer(run, otcfm_step(cfg)).fit()
    assert "\n" not in str(err.value)
    run.logger.close()


def test_a_finished_graphed_phase_releases_its_graph_and_batch(runs_dir):
    """The graph, its static batch and the gradients its replays wrote are dropped when ``fit`` ends, as is the
    graph's hold on the Trainer (its update, a bound method): a caller that keeps the trainer (lr-find, doctor, a
    benchmark) keeps no captured step, and nothing waits for the cyclic garbage collector."""
    run, trainer = fit(moons_cfg("train.velocity.graph=step", iters=6), "released")
    graph = trainer.step_graph
    assert graph.graph is None and graph.static is None and graph.outputs is None and graph.update is None
    assert all(p.grad is None for p in trainer.params)


def test_a_ready_trainer_keeps_its_step_graph_for_the_steps_taken_after_fit(runs_dir, tmp_path):
    """lr-find, doctor and memory_estimate.py stop a phase before its first step and then step the trainer
    themselves: a stop is not the phase's end, so the step graph stays (releasing it there broke them on an H100)."""
    from sinkflow.tools.phases import workspace

    run, trainer = workspace(moons_cfg("train.velocity.graph=step"), "velocity", tmp_path)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for _ in range(3):
        loss, _ = trainer.train_step(trainer.batch)
    assert torch.isfinite(loss) and trainer.step_graph.update is not None
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    run.logger.close()


def test_a_loaded_state_makes_the_step_graph_capture_anew(runs_dir, tmp_path):
    """lr-find restores the trainer's state after its range test: Adam's moments become new tensors, so a graph
    recorded before would update the old ones. Loading a state drops the graph (here a stand-in: a CPU captures
    nothing); the steps after it train as the plain path's."""
    from sinkflow.tools.lr_find import phase_lr_find
    from sinkflow.tools.phases import workspace

    run, trainer = workspace(moons_cfg("train.velocity.graph=step"), "velocity", tmp_path)
    trainer.step_graph.graph = "recorded before"  # what a CUDA capture would have left
    phase_lr_find(trainer, steps=8)
    assert trainer.step_graph.graph is None and trainer.step_graph.update is not None
    loss, _ = trainer.train_step(trainer.batch)
    assert torch.isfinite(loss)
    run.logger.close()


def test_a_graphed_step_is_refused_where_a_graph_cannot_hold_it():
    ok = {"precision": "bf16"}
    check_step_graph(ok, "velocity", "default", True)
    check_step_graph({"precision": "fp16"}, "velocity", None, True)  # GradScaler's work is all on the device
    check_step_graph(ok, "velocity", None, True)
    check_step_graph(ok, "velocity", "max-autotune-no-cudagraphs", True)  # timed kernels, no graphs of its own
    for args, words in [((ok, "nsf", "reduce-overhead", True), "train.nsf.compile_mode=default"),
                        ((ok, "nsf", "max-autotune", True), "train.nsf.compile_mode=default"),
                        ((ok, "velocity", None, False), "fused kernel")]:
        with pytest.raises(SinkflowError, match=words):
            check_step_graph(*args)
    # auto's compile mode leaves the graphs to the step graph
    auto = config.resolve("mnist", ["train.velocity.graph=step"])["train"]["velocity"]
    assert fast_path.resolve(auto, "unet", "cpu")["compile_mode"] == "default"
    graph = StepGraph(lambda batch, step: (batch[0].sum(), step), torch.optim.SGD([torch.zeros(1)], lr=0.1), "cpu")
    graph((torch.ones(3, 2),), 1)
    with pytest.raises(SinkflowError, match="graph=none for a phase whose batches vary"):
        graph((torch.ones(4, 2),), 2)


def test_ema_is_torchs_averaged_model_without_reading_the_device():
    """The same weights as AveragedModel's EMA after every update, its checkpoint loads either way, and no update
    reads the counter (it lives on the meta device here: any read would raise)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    ours, theirs = EMA(model, 0.9, warmup=False), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for i in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (i + 1))
        model(torch.randn(16, 4))  # moves the BatchNorm buffers
        ours.update_parameters(model)
        theirs.update_parameters(model)
        for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
            assert torch.equal(a, b)
    fresh = EMA(model, 0.9, warmup=False)
    fresh.load_state_dict(theirs.state_dict())
    assert fresh.updates == 4
    blind = EMA(model, 0.9)
    blind.n_averaged = torch.zeros((), dtype=torch.long, device="meta")
    for _ in range(3):
        blind.update_parameters(model)  # a read of the meta counter would raise here
    theirs.n_averaged = torch.zeros((), dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        theirs.update_parameters(model)  # torch's reads it, twice an update: a host sync each on a GPU


def test_the_ema_warm_up_ramps_the_decay_and_resumes_where_it_was():
    """Update t uses min(decay, (1 + t) / (10 + t)) (torch_ema / diffusers), a loaded checkpoint continues the ramp from
    its count, and first_step_share is the product of the decays the updates used (with the ramp and without it)."""
    from sinkflow.engine.ema import first_step_share
    from sinkflow.engine.trainer import too_short

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema, half = EMA(model, 0.99, warmup=True), None
    expected = [p.detach().clone() for p in model.parameters()]
    for t in range(12):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update_parameters(model)
        d = min(0.99, (1 + t) / (10 + t))
        expected = [p.detach().clone() if t == 0 else d * e + (1 - d) * p.detach() for e, p in zip(expected, model.parameters())]
        for a, b in zip(ema.module.parameters(), expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        if t == 5:
            half = EMA(model, 0.99, warmup=True)
            half.load_state_dict(ema.state_dict())
    assert half.updates == 6
    with torch.no_grad():  # the resumed EMA takes update 6 as the running one did
        model.weight.add_(1.0)
    ema6 = EMA(model, 0.99, warmup=True)
    ema6.load_state_dict(half.state_dict())
    ema6.update_parameters(model)
    d = 7 / 16
    torch.testing.assert_close(ema6.module.weight, d * half.module.weight + (1 - d) * model.weight)
    for decay, iters in ((0.99, 1000), (0.9999, 20000), (0.5, 3), (0.9, 2)):
        for warmup in (False, True):
            brute = math.prod(min(decay, (1 + t) / (10 + t)) if warmup else decay for t in range(1, iters))
            assert first_step_share(decay, iters, warmup) == pytest.approx(brute, rel=1e-4, abs=1e-300)
    assert first_step_share(0.9999, 20000) == pytest.approx(0.1353, abs=1e-4)  # the trap the warm-up removes
    assert first_step_share(0.9999, 20000, warmup=True) < 1e-9
    train = {"iters": 20000, "warmup": 0, "ema": 0.9999}
    assert too_short({**train, "ema_warmup": True}, "velocity") == []
    assert "ema_warmup=true" in too_short({**train, "ema_warmup": False}, "velocity")[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph: needs CUDA")
def test_on_cuda_the_step_is_captured_and_trains_what_eager_trains(runs_dir):
    cfg = moons_cfg("experiment.device=cuda", "train.velocity.precision=fp32", iters=12)
    plain_run, _ = fit(cfg, "cuda-plain")
    cfg = moons_cfg("experiment.device=cuda", "train.velocity.precision=fp32", "train.velocity.graph=step", iters=12)
    graph_run, trainer = fit(cfg, "cuda-graph")
    assert trainer.captures_steps and trainer.step_graph.replays == 12 - 3 - 1 + 1  # all but the warm-up steps
    assert trainer.step_graph.graph is None  # released when the phase ended
    plain, graphed = final_weights(plain_run), final_weights(graph_run)
    assert max((plain[k] - graphed[k]).abs().max().item() for k in plain) < 1e-5


def test_health_counts_dead_activations_also_where_the_step_is_a_replay(runs_dir, monkeypatch):
    """A captured step runs no Python, so its forward hooks would not fire: on a logged replay Health watches a
    no-grad probe forward of the same batch instead. On a CPU nothing is captured, so the replay is faked
    (``captures_steps`` forced): the probe's counts are logged where the hooks saw nothing of the step itself, they
    are near the eager step's own (the probe sees the weights one update later), and the weights are unchanged."""
    import json

    def logged(run):
        rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "dead_frac" in r]

    relu = ["model.velocity.activation=relu"]
    eager_run, _ = fit(moons_cfg(*relu), "eager")
    monkeypatch.setattr(Trainer, "captures_steps", property(lambda self: True))
    probed_run, trainer = fit(moons_cfg(*relu), "probed")
    eager, probed = logged(eager_run), logged(probed_run)
    assert [r["step"] for r in probed] == [r["step"] for r in eager] == [5, 10, 12]
    assert all(0.05 < r["dead_frac"] < 0.95 for r in probed)  # ReLU on a fresh MLP: a real share, not 0 or 1
    assert all(abs(p["dead_frac"] - e["dead_frac"]) < 0.05 for p, e in zip(probed, eager))
    assert trainer.model.training  # the probe's eval mode is undone
    plain, with_probe = final_weights(eager_run), final_weights(probed_run)
    assert all(torch.equal(plain[k], with_probe[k]) for k in plain)


def test_health_counts_dead_activations_on_the_logged_step_whose_capture_failed(runs_dir, monkeypatch):
    """``graph: auto``'s fall-back runs the step its capture failed on as a plain step: Health, which left its hooks
    off at the step's start (a replay was coming), must watch it by the probe forward at its end, as it would a
    replay; it read ``captures_steps`` again there, now False, and logged that step without its dead-activation
    counts. A replay is faked on the CPU (``captures_steps`` while the step graph is held) and the capture at step 4
    fails (helpers.plant_capture_failure), step 4 a log step."""
    import json

    from helpers import plant_capture_failure

    plant_capture_failure(monkeypatch)
    monkeypatch.setattr(Trainer, "captures_steps", property(lambda self: self.step_graph is not None))
    run, trainer = fit(moons_cfg("model.velocity.activation=relu", "train.velocity.graph=auto",
                                 "train.velocity.log_every=4"), "fallback-logged")
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert trainer.step_graph is None
    assert [r["step"] for r in rows if "dead_frac" in r] == [4, 8, 12], rows


def test_the_probe_forward_gives_every_module_its_own_mode_back(tmp_path):
    """``Trainer.probe_forward`` (Health's and the learning check's look at a captured step) runs in eval mode and
    restored the root's flag on every module: a submodule a network keeps in eval (a frozen, pretrained part) came
    back in train mode, its dropout and batch statistics then live in training (audit NN's open item)."""
    from sinkflow.tools.phases import workspace

    run, trainer = workspace(moons_cfg(), "velocity", tmp_path)
    frozen = next(m for m in trainer.model.modules() if m is not trainer.model)
    frozen.eval()
    modes = {name: m.training for name, m in trainer.model.named_modules()}
    assert not frozen.training and trainer.model.training
    trainer.probe_forward(trainer.batch)
    assert {name: m.training for name, m in trainer.model.named_modules()} == modes


def test_the_release_between_phases_frees_the_streams_blas_workspaces(monkeypatch):
    """cuBLAS / cuBLASLt keep a workspace per stream that ran a product (64 MiB a stream on an H200), allocated for
    good; each phase's step graph and prefetch workers run on new streams, so every finished phase left its own
    behind and the next phase started above them (memory_estimate.py's rows climbed 130 and 312 MiB). The release
    between phases drops them before it empties the cache; on a CPU it touches neither."""
    from types import SimpleNamespace

    from sinkflow.runtime.run_folder import RunFolder

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cache"))
    RunFolder.release(SimpleNamespace(device=torch.device("cpu")))
    assert calls == []
    RunFolder.release(SimpleNamespace(device=torch.device("cuda", 0)))
    assert calls == ["workspaces", "cache"]


def test_nothing_of_a_finished_phase_outlives_it_in_the_run_or_a_scratch_run(runs_dir, tmp_path, monkeypatch):
    """What a user's later phase runs beside: when a phase starts, no earlier phase's trainer, optimizer, step graph or
    gradient is left (their memory on a card; the cuBLAS workspaces are freed by ``RunFolder.release``). The CUDA
    path's pieces run here: the step graph on its static batch, batches drawn ahead on worker threads. Through
    ``run_phases`` (sinkflow train) and ``workspace`` (doctor, lr-find), with no collection but the run's own."""
    import weakref

    from sinkflow.engine.experiment import run_phases
    from sinkflow.runtime.callbacks import Callback
    from sinkflow.tools.phases import workspace

    seen, alive = [], []

    class Watch(Callback):
        def on_phase_start(self, trainer):
            alive.extend(name for name, refs in seen if any(r() is not None for r in refs))
            if trainer.training:
                seen.append((trainer.name, [weakref.ref(o) for o in (trainer, trainer.optimizer, trainer.step_graph,
                                                                     trainer.params[0])]))

    fast = [f"train.{k}.{key}={v}" for k in ("velocity", "nsf", "time") for key, v in (("graph", "step"),
                                                                                   ("prefetch", "always"))]
    small = ["pool.batch_size=16", "train.velocity.batch_size=16", "train.nsf.batch_size=16",
             "train.time.batch_size=16"]
    cut = [o for k in ("velocity", "nsf", "time") for o in (f"train.{k}.iters=3", f"train.{k}.warmup=0",
                                                            f"train.{k}.ema=0.0")]
    cfg = config.resolve("digits", [*small, *fast, *cut, "pool.batches=1", "pool.steps=2", "experiment.name=watched"],
                         {"device": "cpu"})
    run = RunFolder.create(cfg)
    run_phases(run, methods.phases(cfg, *methods.distributions(cfg)), [Watch()])
    run.logger.close()
    assert [name for name, _ in seen] == ["velocity", "nsf", "time"] and alive == [], alive

    seen.clear()
    from sinkflow.engine import trainer as trainer_mod

    real_setup = trainer_mod.Trainer.setup

    def setup(self):
        real_setup(self)
        seen.append((self.name, [weakref.ref(o) for o in (self, self.optimizer, self.step_graph, self.params[0])]))

    monkeypatch.setattr(trainer_mod.Trainer, "setup", setup)
    run, ready = workspace(cfg, "time", tmp_path / "scratch")
    run.logger.close()
    assert [name for name, _ in seen] == ["velocity", "nsf", "time"]
    assert [name for name, refs in seen[:2] if any(r() is not None for r in refs)] == []


def stand_in_capture(monkeypatch, graph, cuda_graph, pool, set_stream=None, end=None, release=None) -> None:
    """torch.cuda's capture API stood in for on a CPU: ``torch.cuda.graph`` (a context manager class), its
    ``CUDAGraph``, the pool handle ``pool`` (None: the test sets its own), the phase's stream, and the caching
    allocator's end / release of a pool (no-ops unless given)."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cuda_graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    if pool is not None:
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pool)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the phase's stream")
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream or (lambda stream: None))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end or (lambda device, pool: None), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", release or (lambda device, pool: None), raising=False)


def test_a_failed_capture_ends_its_pool_under_the_older_name_of_torch_2_7(monkeypatch):
    """Torch 2.4 to 2.7 end a pool's routing with ``_cuda_endAllocateCurrentStreamToPool`` (no
    ``_cuda_endAllocateToPool`` yet): the cleanup raised AttributeError there, in place of the capture's own error."""
    from sinkflow.engine.step_graph import end_failed_capture

    ended, released = [], []
    monkeypatch.delattr(torch._C, "_cuda_endAllocateToPool", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", lambda device, pool: ended.append(pool),
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: released.append(pool), raising=False)
    end_failed_capture(0, (0, 41))
    assert ended == released == [(0, 41)]


def test_a_failed_capture_ends_its_pool_in_the_caching_allocator(monkeypatch):
    """torch's ``capture_end`` raises (the capture was invalidated by the step: a host read) before it ends the
    caching allocator's routing to the graph's pool, and a graph whose capture did not end never releases it: the
    capture stayed "underway" for the process, where the allocator defers every free of a block used on a second
    stream (the prefetched batches) for good and fails an internal assert in ``empty_cache`` (between phases). No
    CUDA here: torch.cuda's capture API is stood in for by one that keeps the allocator's list as torch does (a pool
    routed to at the capture's start, left routed when its end raises), and the failed capture must leave it empty."""
    import types

    from sinkflow.engine.step_graph import CaptureFailed

    underway, released, streams = [], [], []

    class Graph:
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            self.pool = pool if pool is not None else ("torch's own", len(underway))

        def __enter__(self):
            underway.append(self.pool)  # capture_begin: beginAllocateToPool

        def __exit__(self, *exc):  # capture_end: cudaStreamEndCapture fails first, endAllocateToPool never runs
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def end(device, pool):
        if pool not in underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        underway.remove(pool)

    stand_in_capture(monkeypatch, Graph, lambda *a, **k: object(), (0, 41), set_stream=streams.append, end=end,
                     release=lambda device, pool: released.append(pool))

    def update(batch, step):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    model = torch.nn.Linear(2, 2)
    graph = StepGraph(update, torch.optim.Adam(model.parameters()), "cpu")
    graph.captures, graph.stream = True, types.SimpleNamespace(device=torch.device("cuda", 0))
    graph.static = torch.zeros(4, 2)
    with pytest.raises(CaptureFailed, match="operation not permitted when stream is capturing"):
        graph._capture()
    assert underway == [] and released == [(0, 41)], (underway, released)
    assert streams == ["the phase's stream"]  # the phase's own stream current again
    # out of memory while capturing: the out-of-memory error itself (the CLI's line with its fixes), not a capture
    # failure that graph: auto would train on past in eager steps needing the same memory; the pool ended all the same
    graph.update = lambda batch, step: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory. Tried to "
                                                                                    "allocate 2.00 GiB"))
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        graph._capture()
    assert underway == [] and released == [(0, 41)] * 2
    # the step's own error is named, not capture_end's after it, nor one the user's code handled before raising it
    def handled(batch, step):
        try:
            {}["missing"]
        except KeyError:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (a .item() in forward)")

    graph.update = handled
    with pytest.raises(CaptureFailed, match=r"failed: CUDA error: operation not permitted when stream is capturing "
                                            r"\(a .item\(\) in forward\); set train.velocity.graph=none"):
        graph._capture()


def test_a_split_step_replays_the_backward_the_all_reduce_and_the_update_in_turn(monkeypatch):
    """Under torchrun a captured step is two graphs in one memory pool with the gradients' all-reduce run eagerly
    between their replays (sinkflow.engine.grad_sync: DDP's hooks cannot be captured). No CUDA here: torch.cuda's
    capture API is stood in for (a capture runs its body once, as recording does; a replay is logged), so the order
    is what is checked: both parts recorded once, then at every step the backward's replay, the all-reduce, the
    update's replay, and the update's outputs returned. A failure recording the update drops both graphs."""
    import types

    from sinkflow.engine.step_graph import CaptureFailed

    log, pools, carries = [], [], []

    class CUDAGraph:
        def replay(self):
            log.append(f"replay {self.name}")

    class Graph:
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            cuda_graph.name = "backward" if not pools else "update"
            pools.append(pool)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    stand_in_capture(monkeypatch, Graph, CUDAGraph, (0, 41))

    def backward(batch, step):
        log.append("record backward")
        return (batch.sum(),)

    def update(step, carry):
        log.append("record update")
        return carry[0] * 2, step.clone()

    def whole(batch, step):
        raise AssertionError("a captured step runs its parts, not the whole update")

    def graphed(parts):
        graph = StepGraph(whole, torch.optim.SGD([torch.zeros(1)], lr=0.1), "cpu", parts=parts)
        graph.captures, graph.stream = True, types.SimpleNamespace(device=torch.device("cuda", 0))
        graph.eager_steps = WARMUP  # warmed up: the next step records
        return graph

    graph = graphed((backward, lambda carry: log.append("all-reduce") or carries.append(carry), update))
    out = graph(torch.ones(3, 2), 4)
    assert log == ["record backward", "record update", "replay backward", "all-reduce", "replay update"], log
    assert pools == [(0, 41), (0, 41)]  # one pool: the update's graph reads the gradients the backward's wrote
    assert float(out[0]) == 12.0 and int(out[1]) == 4
    assert len(carries) == 1 and float(carries[0][0]) == 6.0  # the all-reduce is handed the backward's carry
    log.clear()
    graph(torch.ones(3, 2), 5)
    assert log == ["replay backward", "all-reduce", "replay update"]

    def host_read(step, carry):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    pools.clear()
    graph = graphed((backward, lambda carry: None, host_read))
    with pytest.raises(CaptureFailed, match="operation not permitted"):
        graph(torch.ones(3, 2), 4)
    assert graph.graph is None and graph.second is None


@contextlib.contextmanager
def group_of_one():
    """A gloo process group of this one process: the trainer's torchrun path for a captured step (grad_sync.py)."""
    import socket

    import torch.distributed as tdist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tdist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        tdist.destroy_process_group()


def test_a_split_step_skips_on_another_ranks_non_finite_loss_with_no_collective_in_the_update(runs_dir, monkeypatch):
    """The skip decision of a torchrun job's captured step is every rank's: a rank whose own loss is finite skips the
    update where another rank's was not. That OR over the ranks was the non-finite guard's own all-reduce
    (``dist.any_over_ranks``), inside the update, which the update's CUDA graph would have captured (an NCCL
    collective in the graph, what the split exists to avoid; a group of one never reaches it, so gpu_checks'
    split_step could not show it). It travels in the gradients' all-reduce between the graphs now: here, in a group
    of one, the all-reduce stood in for brings a NaN loss from another rank at step 3, and the update is skipped
    there and after, the stop at the log step naming step 3; the guard made no collective of its own."""
    from sinkflow.engine import finite, grad_sync

    inside = []
    monkeypatch.setattr(finite.dist, "any_over_ranks", lambda flag: inside.append(1) or flag)
    real = grad_sync.GradSync.__call__
    steps = []

    def synced(self, *loss):
        real(self, *loss)
        steps.append(1)
        if len(steps) == 3 and loss:  # step 3: another rank's loss was NaN (its share of the flag)
            self.loss_bad.fill_(0.5)

    monkeypatch.setattr(grad_sync.GradSync, "__call__", synced)
    cfg = moons_cfg("train.velocity.log_every=5", "train.velocity.ckpt_every=100", "train.velocity.graph=step")
    cfg["experiment"]["name"] = "other-rank-nan"
    snaps = Snapshots()
    with group_of_one():
        run = RunFolder.create(cfg)
        trainer = Trainer(run, otcfm_step(cfg), [snaps])
        with pytest.raises(SinkflowError, match="at step 3"):
            trainer.fit()
        run.logger.close()
    assert trainer.grad_sync is not None and trainer.step == 5
    for step in (3, 4, 5):
        assert all(torch.equal(snaps.weights[2][k], snaps.weights[step][k]) for k in snaps.weights[2])
    assert not inside


def test_a_split_steps_parts_run_in_turn_train_what_the_whole_update_trains(runs_dir, monkeypatch):
    """On a CPU the step graph runs ``update`` whole, so the torchrun suite never runs the trainer's ``parts`` (the
    backward, the all-reduce, the update) as a card replays them. Here they are run in turn in place of ``update``,
    as the replays do, with float16 (GradScaler scales in the first part and unscales, skips and updates in the
    second), two micro-batches and EMA: the final weights and EMA are graph=none's in one process, bit for bit, and
    each part ran at every step (a swapped, dropped or mis-fed part ends elsewhere)."""
    from sinkflow.engine import step_graph
    from sinkflow.runtime.checkpoint import load

    ran = []
    real = step_graph.StepGraph.__init__

    def split_init(self, update, optimizer, device, phase="velocity", parts=None):
        real(self, update, optimizer, device, phase, parts)
        assert parts is not None  # in a process group, a captured step is split

        def in_turn(batch, step):
            first, between, then = parts
            carry = first(batch, step)
            between(carry)
            ran.append(step.item())
            return then(step, carry)

        self.update = in_turn

    overrides = ("train.velocity.precision=fp16", "train.velocity.accum=2", "train.velocity.ema=0.9")
    plain_run, _ = fit(moons_cfg(*overrides), "plain")
    monkeypatch.setattr(step_graph.StepGraph, "__init__", split_init)
    with group_of_one():
        split_run, trainer = fit(moons_cfg(*overrides, "train.velocity.graph=step"), "split")
    assert trainer.grad_sync is not None and ran == list(range(1, 13))
    plain, split = (load(r.dir / "checkpoints" / "velocity" / "final.pt") for r in (plain_run, split_run))
    assert all(torch.equal(plain["model"][k], split["model"][k]) for k in plain["model"])
    assert all(torch.equal(plain["ema"][k], split["ema"][k]) for k in plain["ema"])
    assert plain["scaler"] == split["scaler"]


def test_a_split_steps_failed_update_capture_leaves_its_shared_pool_released_once(monkeypatch):
    """The two graphs of a torchrun job's step share one pool, each capture holding it once (torch's
    ``beginAllocateToPool`` increments its use count; a graph whose capture ended releases it when it goes). When the
    update's capture fails after the backward's ended, the failed one is ended and released here and the backward's
    graph releases its own as it goes: the count must come back to 0 (a pool released once too few is never freed,
    once too many is freed under a live graph), with no capture left underway. Stood-in capture API, as above."""
    import gc
    import types

    from sinkflow.engine.step_graph import CaptureFailed

    uses, underway = {}, []

    class CUDAGraph:
        ended = None

        def __del__(self):
            if self.ended is not None:  # CUDAGraph::reset: releasePool after a capture that ended
                uses[self.ended] -= 1

    class Graph:
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            self.cuda_graph, self.pool = cuda_graph, pool

        def __enter__(self):
            uses[self.pool] = uses.get(self.pool, 0) + 1
            underway.append(self.pool)

        def __exit__(self, kind, exc, tb):
            if kind is not None:  # the step invalidated the capture: cudaStreamEndCapture fails, routing left on
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            underway.remove(self.pool)
            self.cuda_graph.ended = self.pool
            return False

    def end(device, pool):
        if pool not in underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        underway.remove(pool)

    stand_in_capture(monkeypatch, Graph, CUDAGraph, None, end=end,  # the pool: one per case, below
                     release=lambda device, pool: uses.__setitem__(pool, uses[pool] - 1))

    def host_read(*args):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    for n, parts in enumerate([(lambda batch, step: batch.sum(), lambda carry: None, host_read),  # the update fails
                               (host_read, lambda carry: None, lambda step, carry: (carry,))]):  # the backward fails
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, n))
        graph = StepGraph(host_read, torch.optim.SGD([torch.zeros(1)], lr=0.1), "cpu", parts=parts)
        graph.captures, graph.stream = True, types.SimpleNamespace(device=torch.device("cuda", 0))
        graph.static = torch.zeros(4, 2)
        with pytest.raises(CaptureFailed, match="operation not permitted"):
            graph._capture()
        gc.collect()  # the backward's graph, held by the failure's traceback until then
        assert uses[(0, n)] == 0 and underway == [], (n, uses, underway)
        assert graph.graph is None and graph.second is None and graph.carry is None


def test_a_failed_capture_names_its_own_error_not_an_earlier_captures(monkeypatch):
    """``StepGraph._record`` keeps the step's own error in ``step_error`` for the failure line. It was a local of one
    capture, now an attribute: a capture left by an error that was not a RuntimeError (its capture_end succeeded, so
    nothing cleared it) left that error behind, and a later capture whose capture_end failed by itself (the step raised
    nothing) was named by the earlier capture's error. Stood-in capture API, as above."""
    import types

    from sinkflow.engine.step_graph import CaptureFailed

    ends = []

    class Graph:
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            pass

        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            if ends.pop(0):
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing (capture_end)")
            return False

    stand_in_capture(monkeypatch, Graph, lambda: types.SimpleNamespace(), (0, 7))
    steps = [KeyError("an earlier capture's own error"), None]

    def update(batch, step):
        error = steps.pop(0)
        if error is not None:
            raise error
        return (batch.sum(),)

    graph = StepGraph(update, torch.optim.SGD([torch.zeros(1)], lr=0.1), "cpu")
    graph.captures, graph.stream = True, types.SimpleNamespace(device=torch.device("cuda", 0))
    graph.static = torch.zeros(4, 2)
    ends += [False, True]
    with pytest.raises(KeyError):
        graph._capture()
    with pytest.raises(CaptureFailed, match=r"failed: CUDA error: operation not permitted .*\(capture_end\)"):
        graph._capture()
