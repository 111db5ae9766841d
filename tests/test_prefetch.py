"""Issue 23's CPU-side mechanisms: batches drawn one step ahead (same batches, same order, resume still bit-equal),
the OT coupling computed off the training thread (still the exact plan), and the non-finite guard that skips a bad
update on the device instead of reading the loss every step."""

import logging
import signal
import threading

import numpy as np
import ot
import pytest
import torch

from sinkflow.engine.finite import optimizer_steps
from sinkflow import config, methods
from sinkflow.errors import SinkflowError
from sinkflow.methods.flow_matching import InterpolantStep, ot_permutation
from sinkflow.engine import trainer as trainer_mod
from sinkflow.runtime.callbacks import Callback
from sinkflow.engine.prefetch import BatchPrefetcher, use_prefetch
from sinkflow.runtime.run_folder import RunFolder
from sinkflow.runtime.signals import Interrupted
from sinkflow.engine.trainer import Trainer
from helpers import nan_gradient_phase


def moons_cfg(*overrides, method="otcfm", iters=12):
    return config.resolve("moons", [f"experiment.method={method}", f"train.velocity.iters={iters}",
                                    "train.velocity.batch_size=64", "train.velocity.log_every=5",
                                    "train.velocity.ckpt_every=4", "experiment.device=cpu", *overrides])


def otcfm_step(cfg):
    source, target = methods.distributions(cfg)
    return InterpolantStep("velocity", source, target, ot_pairs=True)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetched_batches_equal_inline_ones_in_order_and_resume_point(depth):
    """OT-CFM's batch split into its draw and its OT plan, made ``depth`` at a time on worker threads: the same
    batches in the same order as drawn inline in one piece, the same resume point before every step, and no batch
    made past the last one wanted."""
    cfg = moons_cfg()
    step = otcfm_step(cfg)

    def draws(ahead, n=6):
        gen = torch.Generator().manual_seed(7)
        if ahead:
            pf = BatchPrefetcher(lambda: step.draw(gen, 64, "cpu"), gen, torch.device("cpu"), ahead=True,
                                 prepare=lambda drawn: step.prepare(drawn, "cpu"), depth=depth)
        else:
            pf = BatchPrefetcher(lambda: step.batch(gen, 64, "cpu"), gen, torch.device("cpu"), ahead=False)
        out, states = [], []
        for i in range(n):
            states.append(pf.generator_state().clone())  # where a checkpoint written now would resume
            out.append(pf.next(wanted=n - i - 1))
        pf.close()
        return out, states, pf, gen.get_state()

    inline, inline_states, inline_pf, inline_end = draws(False)
    ahead, ahead_states, ahead_pf, ahead_end = draws(True)
    # the workers' batches are timed (bench's "draw ms"); inline draws have no worker to time
    assert (inline_pf.draws, ahead_pf.draws) == (0, 6) and ahead_pf.draw_s > 0
    for a, b in zip(inline, ahead):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(a, b) for a, b in zip(inline_states, ahead_states))
    assert torch.equal(inline_end, ahead_end)  # nothing drawn beyond the sixth batch
    # the batches really differ from step to step (the test would pass trivially otherwise)
    assert not torch.equal(inline[0][0], inline[1][0])


def test_the_next_batch_is_drawn_while_one_is_prepared():
    """The pipeline itself: each batch's prepare waits (on an event, not a clock) until the next batch is drawn; made
    one stage after the other this would hang, and the test fails after 10 s."""
    gen = torch.Generator().manual_seed(0)
    drawn = [threading.Event() for _ in range(5)]

    def draw():
        i = sum(e.is_set() for e in drawn)
        torch.rand(1, generator=gen)
        drawn[i].set()
        return i

    def prepare(i):
        if i < 3:
            assert drawn[i + 1].wait(timeout=10), f"batch {i} was prepared before batch {i + 1} was drawn"
        return i

    pf = BatchPrefetcher(draw, gen, torch.device("cpu"), ahead=True, prepare=prepare, depth=2)
    assert [pf.next(wanted=3 - k) for k in range(4)] == [0, 1, 2, 3]
    pf.close()
    assert not drawn[4].is_set()  # nothing made past the last batch wanted


def test_a_prepare_that_fails_raises_on_the_training_thread_and_does_not_hang():
    gen = torch.Generator().manual_seed(0)
    pf = BatchPrefetcher(lambda: torch.rand(1, generator=gen), gen, torch.device("cpu"), ahead=True,
                         prepare=lambda drawn: 1 / 0, depth=2)
    with pytest.raises(ZeroDivisionError):
        pf.next(wanted=5)
    pf.close()


def test_a_checkpoint_taken_with_batches_in_the_making_resumes_before_the_first_of_them():
    """Three batches in the making when the state is read: it is the state before the first unconsumed draw, and
    drawing from it gives that batch (then close() drops them all)."""
    step = otcfm_step(moons_cfg())
    gen = torch.Generator().manual_seed(3)
    pf = BatchPrefetcher(lambda: step.draw(gen, 64, "cpu"), gen, torch.device("cpu"), ahead=True,
                         prepare=lambda drawn: step.prepare(drawn, "cpu"), depth=3)
    first = pf.next(wanted=10)
    state = pf.generator_state().clone()
    second = pf.next(wanted=9)
    pf.close()
    replay = torch.Generator()
    replay.set_state(state)
    again = step.batch(replay, 64, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(second, again))
    assert not torch.equal(first[0], second[0])


def test_a_draw_that_fails_raises_on_the_training_thread():
    gen = torch.Generator()
    pf = BatchPrefetcher(lambda: 1 / 0, gen, torch.device("cpu"), ahead=True)
    with pytest.raises(ZeroDivisionError):
        pf.next()
    pf.close()


def test_prefetch_setting():
    assert use_prefetch("auto", torch.device("cpu")) is False
    assert use_prefetch("always", torch.device("cpu")) is True
    assert use_prefetch("never", torch.device("cpu")) is False
    with pytest.raises(SinkflowError, match="train.velocity.prefetch"):
        config.resolve("moons", ["train.velocity.prefetch=maybe"])


def test_the_ot_pairs_drawn_ahead_are_the_exact_plan():
    """OT-CFM's coupling, now computed on the prefetch thread, is still the exact minibatch plan: the matched
    cost equals POT's EMD optimum."""
    cfg = moons_cfg()
    step = otcfm_step(cfg)
    gen = torch.Generator().manual_seed(3)
    pf = BatchPrefetcher(lambda: step.batch(gen, 64, "cpu"), gen, torch.device("cpu"), ahead=True)
    pf.next()
    state = pf.generator_state()
    pf.close()
    replay = torch.Generator()
    replay.set_state(state)
    x0 = step.source.sample(64, replay, "cpu")
    x1 = step.target.sample(64, replay, "cpu")
    perm = ot_permutation(x0, x1)
    cost = torch.cdist(x0.double(), x1.double()) ** 2
    optimum = ot.emd2(np.full(64, 1 / 64), np.full(64, 1 / 64), cost.numpy())
    assert sorted(perm.tolist()) == list(range(64))
    assert float(cost[torch.arange(64), perm].mean()) == pytest.approx(optimum, rel=1e-9)


def final_weights(run):
    from sinkflow.runtime.checkpoint import load

    return load(run.dir / "checkpoints" / "velocity" / "final.pt")["model"]


def train(cfg, name, callbacks=()):
    cfg["experiment"]["name"] = name
    run = RunFolder.create(cfg)
    Trainer(run, otcfm_step(cfg), callbacks).fit()
    run.logger.close()
    return run


class StopAt(Callback):
    def __init__(self, step):
        self.at = step

    def on_train_batch_end(self, trainer, batch, outputs):
        if trainer.step == self.at:
            trainer.request_stop(signal.SIGTERM)


def test_prefetch_on_trains_the_same_weights_and_resumes_bit_equal(runs_dir):
    plain = final_weights(train(moons_cfg("train.velocity.prefetch=never"), "plain"))
    ahead = final_weights(train(moons_cfg("train.velocity.prefetch=always"), "ahead"))
    assert all(torch.equal(plain[k], ahead[k]) for k in plain)

    cfg = moons_cfg("train.velocity.prefetch=always")
    cfg["experiment"]["name"] = "stopped"
    run = RunFolder.create(cfg)
    with pytest.raises(Interrupted):  # stopped at step 6 with batch 7 already drawn on the worker
        Trainer(run, otcfm_step(cfg), [StopAt(6)]).fit()
    Trainer(run, otcfm_step(cfg)).fit()  # resumes from step 6's checkpoint
    run.logger.close()
    resumed = final_weights(run)
    assert all(torch.equal(plain[k], resumed[k]) for k in plain)


def test_compiled_training_with_cuda_graph_mode_trains_what_eager_trains_and_resumes(runs_dir, caplog):
    """`train.*.compile=true compile_mode=reduce-overhead` (CUDA graphs on a GPU; inductor alone on a CPU): the
    same weights as eager within float rounding, checkpoints under the raw module's keys, a resume that picks the
    compiled step up again, and the mode in the phase's first line."""
    from torch._dynamo.utils import counters

    plain = final_weights(train(moons_cfg(iters=6), "eager"))
    graphs = counters["stats"]["unique_graphs"]
    cfg = moons_cfg("train.velocity.compile=true", "train.velocity.compile_mode=reduce-overhead", iters=6)
    cfg["experiment"]["name"] = "compiled"
    run = RunFolder.create(cfg)
    with caplog.at_level(logging.INFO), pytest.raises(Interrupted):
        Trainer(run, otcfm_step(cfg), [StopAt(4)]).fit()
    assert "compiled (reduce-overhead)" in caplog.text
    Trainer(run, otcfm_step(cfg)).fit()  # resumes from step 4's checkpoint
    run.logger.close()
    compiled = final_weights(run)
    assert counters["stats"]["unique_graphs"] > graphs  # the steps really ran compiled code
    assert compiled.keys() == plain.keys()  # no torch.compile prefix in what is saved
    assert max((plain[k] - compiled[k]).abs().max().item() for k in plain) < 1e-5


def test_a_compile_that_fails_falls_back_to_eager_under_auto_and_stops_with_the_fix_when_asked(runs_dir, caplog,
                                                                                                 monkeypatch):
    """A user's machine that cannot compile (no Triton for the card, no C compiler) must not lose the run to the
    new CUDA default: `compile: auto` trains eager after one warning and ends with eager's weights; an explicit
    `compile: true` stops with one line naming the key, before any step is applied. The compiler's failure is
    planted (torch.compile returns a module whose first call raises dynamo's error); `auto` is made to resolve to
    compile on this CPU."""
    from helpers import plant_compile_failure

    plant_compile_failure(monkeypatch)
    plain = final_weights(train(moons_cfg("train.velocity.compile=false", iters=6), "eager"))
    with caplog.at_level(logging.WARNING):
        fallback = final_weights(train(moons_cfg(iters=6), "auto"))
    assert "velocity: torch.compile failed (backend='inductor' raised: no working C compiler); training eager" \
        in caplog.text
    assert all(torch.equal(plain[k], fallback[k]) for k in plain)  # nothing of the failed attempt was applied
    cfg = moons_cfg("train.velocity.compile=true", iters=6)
    cfg["experiment"]["name"] = "asked"
    run = RunFolder.create(cfg)
    with pytest.raises(SinkflowError, match=r"torch.compile failed in phase 'velocity'.*compile=false") as err:
        Trainer(run, otcfm_step(cfg)).fit()
    ckpts = run.dir / "checkpoints" / "velocity"
    assert not ckpts.exists() or not any(ckpts.iterdir())  # it stopped before any step was saved
    assert "\n" not in str(err.value)  # one line: the problem and the fix
    assert err.value.every_rank  # under torchrun rank 0 alone prints it (each rank printed its own line)


def test_a_resume_where_compile_falls_back_again_says_no_speed_setting_changed(runs_dir, caplog, monkeypatch):
    """On a machine that cannot compile, `compile: auto` falls back to eager at the first step; the step checkpoint
    recorded the fallen-back state ("off") as what auto resolved to, and the resume on the same machine (set up
    compiled, before its first step falls back again) said "trained ... compile off; resumes in ... compile default"
    on every resume, though nothing about the machine changed. The record is what auto resolved to."""
    from helpers import plant_compile_failure

    plant_compile_failure(monkeypatch)
    cfg = moons_cfg(iters=8)
    cfg["experiment"]["name"] = "fallback"
    run = RunFolder.create(cfg)
    with pytest.raises(Interrupted):
        Trainer(run, otcfm_step(cfg), [StopAt(4)]).fit()
    saved = torch.load(run.dir / "checkpoints" / "velocity" / "step_00000004.pt", weights_only=True)
    assert saved["resolved"]["compile"] == "default"  # auto's answer here, though the steps ran eager
    with caplog.at_level(logging.INFO, logger="sinkflow"):
        Trainer(run, otcfm_step(cfg)).fit()
    run.logger.close()
    assert "resuming from step 4" in caplog.text and "torch.compile failed" in caplog.text
    assert "resumes in" not in caplog.text, caplog.text


class Snapshots(Callback):
    def __init__(self):
        self.weights = {}

    def on_train_batch_end(self, trainer, batch, outputs):
        self.weights[trainer.step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture
def foreach_adam(monkeypatch):
    """Adam without a fused kernel (torch < 2.4 on the CPU, devices without one): it cannot take the skip flag."""
    monkeypatch.setattr(trainer_mod, "adam_kernel", lambda device: {"foreach": True})


def test_the_cpu_runs_the_gpus_optimizer_kernel(runs_dir):
    """Fused Adam on the CPU as on CUDA (torch >= 2.4): the CPU suite covers the path a GPU run takes."""
    cfg = moons_cfg()
    cfg["experiment"]["name"] = "kernel"
    run = RunFolder.create(cfg)
    trainer = Trainer(run, otcfm_step(cfg), [StopAt(1)])
    with pytest.raises(Interrupted):
        trainer.fit()
    run.logger.close()
    assert trainer.optimizer.defaults["fused"] is True and trainer.skip_on_device


def test_a_phase_prints_its_speed_settings_at_the_start(runs_dir, caplog):
    """What the phase runs with, each one key away, before its first step."""
    cfg = moons_cfg("train.velocity.precision=bf16", "train.velocity.prefetch=always")
    cfg["experiment"]["name"] = "settings"
    run = RunFolder.create(cfg)
    with caplog.at_level(logging.INFO, logger="sinkflow"), pytest.raises(Interrupted):
        Trainer(run, otcfm_step(cfg), [StopAt(1)]).fit()
    run.logger.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("velocity on cpu:")]
    assert lines == ["velocity on cpu: bf16, fused Adam, plain layout, eager, batches drawn ahead (two in the making) "
                     "(train.velocity.precision / channels_last / compile / graph / prefetch)"]


def stopped_under_foreach_adam(monkeypatch, name: str):
    """(run, cfg) of a moons OT-CFM run trained to its step-6 checkpoint with foreach Adam (a CPU without the fused
    kernel: torch < 2.4, or sinkflow before 2026-11-26), for a resume on this machine's fused kernel."""
    cfg = moons_cfg()
    cfg["experiment"]["name"] = name
    run = RunFolder.create(cfg)
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "adam_kernel", lambda device: {"foreach": True})
        with pytest.raises(Interrupted):
            Trainer(run, otcfm_step(cfg), [StopAt(6)]).fit()
    return run, cfg


def test_a_run_saved_with_foreach_adam_resumes_on_the_fused_kernel(runs_dir, monkeypatch):
    """A checkpoint of foreach Adam names foreach in its param groups; resumed as saved on the fused kernel (the
    skip flag passed as found_inf), Adam refused the flag. Resume puts this device's kernel back."""
    run, cfg = stopped_under_foreach_adam(monkeypatch, "foreach-then-fused")
    assert run.checkpoints("velocity").latest()["optimizer"]["param_groups"][0]["foreach"] is True
    trainer = Trainer(run, otcfm_step(cfg))
    trainer.fit()
    run.logger.close()
    assert trainer.step == 12 and trainer.skip_on_device
    assert trainer.optimizer.param_groups[0]["fused"] is True and not trainer.optimizer.param_groups[0]["foreach"]


def test_a_foreach_checkpoints_step_counts_are_placed_for_the_fused_kernel(runs_dir, monkeypatch):
    """torch places each Adam ``step`` count by the flags of the groups *saved* in the state dict
    (``Optimizer._process_value_according_to_param_policy``: fused or capturable, float32 on the param's device;
    else left where it was), not by the optimizer's own. A foreach checkpoint, loaded to the CPU, kept its counts there
    under fused CUDA Adam, whose kernel reads them on the device (``state_steps_addresses``). On a CPU both places are
    one, so the rule torch applied to them is what is read here; the run then counts on from the checkpoint's step."""
    from sinkflow.engine.finite import optimizer_steps

    run, cfg = stopped_under_foreach_adam(monkeypatch, "foreach-steps")
    rules, real = [], torch.optim.Optimizer._process_value_according_to_param_policy

    def policy(param, value, param_id, param_groups, key=None):
        if key == "step":  # the flags torch reads for this count: the fused rule moves it to the param's device
            group = next(g for g in param_groups if param_id in g["params"])
            rules.append(bool(group.get("fused") or group.get("capturable")))
        return real(param, value, param_id, param_groups, key)

    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(policy))
    trainer = Trainer(run, otcfm_step(cfg))
    trainer.fit()
    run.logger.close()
    params = list(trainer.model.parameters())
    assert rules and all(rules), rules
    assert all(trainer.optimizer.state[p]["step"].device == p.device for p in params)
    assert trainer.step == 12 and optimizer_steps(trainer.optimizer) == 12


def fit_with_nan_gradients_at_step_3(name):
    """(run, trainer, weight snapshots per step, the error) of a run whose step 3 has NaN gradients."""
    cfg = moons_cfg("train.velocity.log_every=5", "train.velocity.ckpt_every=100")
    cfg["experiment"]["name"] = name
    run = RunFolder.create(cfg)
    snaps = Snapshots()
    trainer = Trainer(run, nan_gradient_phase(cfg, 3, ot_pairs=True), [snaps])
    with pytest.raises(SinkflowError) as e:
        trainer.fit()
    return run, trainer, snaps, e


def test_host_check_stops_before_the_bad_update_where_the_optimizer_cannot_skip(runs_dir, foreach_adam):
    run, trainer, snaps, e = fit_with_nan_gradients_at_step_3("hostcheck")
    assert not trainer.skip_on_device
    assert "non-finite gradient norm" in str(e.value) and "at step 3" in str(e.value), str(e.value)
    assert max(snaps.weights) == 2  # stopped inside step 3, before its update: step 2's weights are the last
    assert not (run.dir / "checkpoints" / "velocity" / "final.pt").exists()
    run.logger.close()


def test_device_skip_never_applies_a_bad_update_and_stops_at_the_next_check(runs_dir):
    run, trainer, snaps, e = fit_with_nan_gradients_at_step_3("skip")
    assert trainer.skip_on_device
    msg = str(e.value)
    assert "non-finite gradient norm" in msg and "at step 3" in msg, msg
    assert trainer.step == 5  # it ran on to the log step, where the flag is read
    for step in (3, 4, 5):  # the bad update and every one after it were skipped on the device
        assert all(torch.equal(snaps.weights[2][k], snaps.weights[step][k]) for k in snaps.weights[2])
    assert not any(torch.equal(snaps.weights[1][k], snaps.weights[2][k]) for k in snaps.weights[1] if "weight" in k)
    assert not (run.dir / "checkpoints" / "velocity" / "final.pt").exists()
    run.logger.close()


class CountReads(Callback):
    """Counts reads of a tensor's value (item / float / int / bool) during the loop's non-log steps."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.active = False
        for name in ("item", "__float__", "__int__", "__bool__"):
            real = getattr(torch.Tensor, name)

            def wrapped(t, *a, _real=real, **kw):
                if self.active:
                    self.count += 1
                return _real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, wrapped)

    def on_train_batch_start(self, trainer, batch):
        self.active = (trainer.step + 1) % trainer.cfg["log_every"] != 0 and (trainer.step + 1) % trainer.cfg["ckpt_every"]

    def on_train_batch_end(self, trainer, batch, outputs):
        self.active = False


def test_no_value_is_read_from_the_device_on_an_ordinary_step(runs_dir, monkeypatch):
    """With the fused optimizer (the default on CUDA and the CPU) an ordinary step reads nothing back from the device: the loss,
    grad norm and non-finite flag stay tensors until a log or checkpoint step."""
    counter = CountReads(monkeypatch)
    cfg = moons_cfg("train.velocity.log_every=10", "train.velocity.ckpt_every=100", method="fm", iters=20)
    cfg["experiment"]["name"] = "nosync"
    run = RunFolder.create(cfg)
    source, target = methods.distributions(cfg)
    Trainer(run, InterpolantStep("velocity", source, target), [counter]).fit()
    run.logger.close()
    assert counter.count == 0


# ---- sinkflow bench --throughput ---------------------------------------------------------------------------

@pytest.mark.parametrize("preset,extra", [("moons", ["--method", "otcfm"]), ("mnist", [])])
def test_bench_throughput_reports_rates_wait_and_peak_fraction(runs_dir, capsys, preset, extra):
    """The throughput table on the CPU, (N, 2) and (N, 1, 28, 28) batches: rates, the wait share and a FLOP
    count that matches the model's, against this CPU's measured peak."""
    from sinkflow.cli import main

    if preset == "mnist":  # synthetic digits of the real shape (no download here)
        from sinkflow.tools.data import real_or_synthetic

        ctx = real_or_synthetic(config.resolve("mnist"), force=True)
        extra = ["--method", "otcfm", "model.velocity.channels=8", "model.velocity.attention_resolutions=[]"]
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx:
        assert main(["bench", "--throughput", preset, *extra, "--batch-size", "4", "--steps", "2", "--warmup", "1",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("velocity")).split()
    steps_s, samples_s, wait, draw, busy, gflop, tflops, peak = row[2:10]
    assert float(steps_s) > 0 and float(samples_s) == pytest.approx(4 * float(steps_s), rel=0.01, abs=0.6)
    assert 0 <= float(wait.rstrip("%")) < 100 and busy == "-"  # busy is a CUDA measurement
    assert draw == "-"  # batches are drawn inline on a CPU (prefetch: auto): no worker to time
    assert float(gflop) > 0 and 0 < float(peak.rstrip("%")) < 100
    assert not runs_dir.exists()


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16)])
def test_the_cpu_peak_is_measured_in_the_phases_precision(monkeypatch, precision, dtype):
    """% peak is the phase's FLOP/s over a matrix product in its precision; on a CPU the product was taken in float32
    whatever the precision, though CPU autocast runs a bf16 phase's products and convolutions in bf16 (the dev VM:
    112 GFLOP/s float32, 484 bf16; `bench --throughput digits --precision bf16` read 54 % of a peak for 13 %)."""
    from sinkflow.tools import throughput

    made, real = [], torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: made.append(k.get("dtype")) or real(*a, **k))
    assert throughput.peak_flops(torch.device("cpu"), precision, size=32) > 0
    assert made == [dtype, dtype]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the products a bf16 phase runs on a CPU
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_bench_throughput_projects_the_runs_own_budget_from_the_measured_rates(runs_dir, capsys):
    """The last line: each phase's own iters over its measured steps/s, and the pool from two chunks built (the
    second at the real run's group size), scaled to the run's batches; nothing of the cut run is projected."""
    import re

    from sinkflow.cli import main

    assert main(["bench", "--throughput", "moons", "pool.chunk=2", "pool.batch_size=16", "train.velocity.iters=7000",
                 "--batch-size", "4", "--steps", "20", "--warmup", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    steps_s = float(next(line for line in out.splitlines() if line.startswith("velocity")).split()[2])
    line = out.splitlines()[-1]
    m = re.fullmatch(r"the run's own budget at these rates: pool 768 batches (\d+) s \(from the 4 built here\); "
                     r"velocity 7,000 steps ([\d.]+) (s|min); ([\d.]+) (s|min) in all, not counting .*", line)
    assert m, line
    velocity = float(m[2]) * (60 if m[3] == "min" else 1)
    assert velocity == pytest.approx(7000 / steps_s, abs=0.05 * 60 if m[3] == "min" else 0.5)
    assert float(m[4]) * (60 if m[5] == "min" else 1) >= velocity + int(m[1]) - 6


def test_the_pool_projection_takes_the_first_chunk_as_measured_and_the_rest_at_the_later_chunks_rate():
    from types import SimpleNamespace

    from sinkflow.tools.bench import PhaseClock, projected_pool, projected_run

    full = {"pool": {"batches": 100, "chunk": 10}, "train": {"velocity": {"iters": 5000}, "nsf": {"iters": 100}}}
    cut = {"pool": {"batches": 20, "chunk": 10}}
    clock = PhaseClock()
    clock.seconds, clock.units = {"pool": 9.0}, {"pool": [7.0, 2.0]}  # set-up in the first chunk: 5 s
    assert projected_pool(full, cut, clock) == pytest.approx(7.0 + 0.2 * 90)
    assert projected_pool(full, {"pool": {"batches": 100, "chunk": 10}}, clock) == 9.0  # not cut: as built
    assert projected_pool(full, cut, SimpleNamespace(seconds={}, units={})) is None  # no pool phase (FM, OT-CFM)
    rows = [{"phase": "velocity", "steps": 30, "steps_per_s": 50.0}, {"phase": "nsf", "steps": 0}]
    line = projected_run(rows, full, cut, clock)
    assert "pool 100 batches 25 s (from the 20 built here); velocity 5,000 steps 1.7 min; nsf not timed" in line
    assert "at least 2.1 min in all" in line
    assert "velocity 500,000 steps 2.8 h" in projected_run(rows, {**full, "train": {"velocity": {"iters": 500_000},
                                                                                   "nsf": {"iters": 1}}}, cut, clock)


def test_bench_cuts_the_phases_without_warnings_about_the_users_config(runs_dir, caplog):
    """bench cuts every phase to a few steps: the digits preset's warm-up of 50 and EMA of 0.99 over them printed four
    warnings about settings that are right for the real run (the cut keeps both on the step's path, shortened)."""
    import logging

    from sinkflow.cli import main

    with caplog.at_level(logging.WARNING):
        assert main(["bench", "--throughput", "digits", "--batch-size", "4", "--steps", "2", "--warmup", "1",
                     "--device", "cpu", "pool.batch_size=16"]) == 0
    assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_bench_windows_end_before_the_phase_log_step(runs_dir, monkeypatch):
    """The engine's own callbacks do a log step's work (weight snapshot, histograms, a captured step's probe
    forward) before a measuring callback's hook runs: no measured window may hold that step, nor a histogram step
    of the user's config. With those steps made 0.5 s slower, both `bench` tables time the 3 steps in far less."""
    import time

    from sinkflow.engine.health import Health
    from sinkflow.tools.bench import profile, throughput

    logged = []
    original = Health.on_train_batch_end

    def slow_log_step(self, trainer, batch, outputs):
        original(self, trainer, batch, outputs)
        if trainer.log_step():
            logged.append(trainer.step)
            time.sleep(0.5)
        elif self.hist_every:  # histograms a user asked for in the config: none are written in a bench run
            time.sleep(0.5)

    monkeypatch.setattr(Health, "on_train_batch_end", slow_log_step)
    cfg = moons_cfg("train.velocity.batch_size=8", "train.velocity.hist_every=1")
    row = throughput(cfg, steps=3, warmup=1)[0]
    assert row["steps"] == 3 and 3 / row["steps_per_s"] < 0.5 and logged == [5]  # warm-up 1 + 3 timed + log step
    row = profile(cfg, steps=3, warmup=1)[0]
    assert row["steps"] == 3 and row["compute_ms"] < 500 and row["data_ms"] < 500 and logged == [5, 6]


def test_step_flops_counts_forward_and_backward_of_a_linear_model():
    from types import SimpleNamespace

    from sinkflow.tools.throughput import step_flops

    model = torch.nn.Linear(10, 4, bias=False)
    task = SimpleNamespace(loss=lambda m, b: m(b).pow(2).mean())
    trainer = SimpleNamespace(precision="fp32", device=torch.device("cpu"), task=task, model=model)
    # forward 2*N*in*out; backward: the weight gradient only (the input needs none) = another 2*N*in*out
    assert step_flops(trainer, torch.randn(32, 10)) == 2 * (2 * 32 * 10 * 4)


def test_fp16_stops_when_loss_scaling_gives_up_instead_of_skipping_for_ever(runs_dir):
    """NaN gradients on every step from the 2nd: GradScaler skips each update and halves its scale (2**16 at the
    start). A run would go on without learning; at the first log step with the scale below 1 it stops, with the
    fix."""
    cfg = moons_cfg("train.velocity.log_every=10", "train.velocity.ckpt_every=100", "train.velocity.precision=fp16",
                    iters=40)
    cfg["experiment"]["name"] = "fp16-gives-up"
    run = RunFolder.create(cfg)
    trainer = Trainer(run, nan_gradient_phase(cfg, 2, persist=True))
    with pytest.raises(SinkflowError) as e:
        trainer.fit()
    run.logger.close()
    # every step skipped (the first overflows at the starting scale, as unpoisoned): step 10 at 2**6, step 20 at 2**-4
    assert trainer.step == 20 and optimizer_steps(trainer.optimizer) == 0
    assert "float16 loss scale 0.062 (20 of 20 updates skipped" in str(e.value) and "at step 20" in str(e.value)
    assert "precision=bf16" in e.value.fix


def test_fp16_device_guard_lets_gradscaler_skip_and_still_stops_on_a_nan_loss(runs_dir):
    """Under float16 GradScaler hands the fused kernel its own Inf/NaN flag; the guard still records a NaN loss
    on the device and stops at the next check, with finite weights."""
    cfg = moons_cfg("train.velocity.log_every=5", "train.velocity.ckpt_every=100", "train.velocity.precision=fp16")
    cfg["experiment"]["name"] = "fp16"
    run = RunFolder.create(cfg)
    trainer = Trainer(run, nan_gradient_phase(cfg, 3, poison="loss"))
    with pytest.raises(SinkflowError, match=r"non-finite loss \(nan\) in phase 'velocity' at step 3"):
        trainer.fit()
    assert trainer.skip_on_device and trainer.step == 5
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    run.logger.close()


def test_fp16_never_applies_a_step_whose_loss_is_nan_with_finite_gradients(runs_dir):
    """Under float16 the fused kernel takes GradScaler's Inf/NaN flag, which sees only the gradients: a NaN loss with
    finite gradients was applied, and every step after it until the check, while the stop said it was not. The
    guard's flag is or-ed into GradScaler's: step 3 and every later update are skipped, as under fp32."""
    cfg = moons_cfg("train.velocity.log_every=5", "train.velocity.ckpt_every=100", "train.velocity.precision=fp16",
                    method="fm")
    cfg["experiment"]["name"] = "fp16-nan-term"
    run = RunFolder.create(cfg)
    snaps = Snapshots()
    trainer = Trainer(run, nan_gradient_phase(cfg, 3, poison="nan_term"), [snaps])
    with pytest.raises(SinkflowError, match=r"non-finite loss \(nan\) in phase 'velocity' at step 3; the step was not"):
        trainer.fit()
    run.logger.close()
    assert trainer.step == 5
    for step in (3, 4, 5):
        assert all(torch.equal(snaps.weights[2][k], snaps.weights[step][k]) for k in snaps.weights[2]), step
    assert not all(torch.equal(snaps.weights[1][k], snaps.weights[2][k]) for k in snaps.weights[1])
