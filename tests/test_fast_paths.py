"""Every fast path gives the plain path's result within a stated tolerance (CPU-checkable parts)."""

import copy
import json

import numpy as np
import pytest
import torch

from sinkflow import config
from sinkflow.methods import distributions, nsgf
from sinkflow.methods.pool import choose_in_flight
from sinkflow.models import build_model
from sinkflow.runtime.rng import device_generator
from sinkflow.engine.ema import EMA
from sinkflow.engine.trainer import Trainer, to_channels_last, use_channels_last
from sinkflow.runtime.run_folder import RunFolder

POOL = ["pool.batches=6", "pool.steps=3", "pool.batch_size=24", "pool.chunk=3", "experiment.device=cpu"]


def _pool(name, *overrides):
    cfg = config.resolve("moons", [*POOL, f"experiment.name={name}", *overrides], {})
    run = RunFolder.create(cfg)
    Trainer(run, nsgf.pool_task(cfg, *distributions(cfg))).fit()
    return run, {k: np.load(run.dir / "pool" / f"{k}.npy") for k in "xvt"}


def test_batched_pool_equals_one_at_a_time_and_resumes(runs_dir):
    """Tolerance: identical on CPU (same diameter, same per-batch generators); 1e-5 allowed for GPU rounding."""
    _, one = _pool("one", "pool.in_flight=1")
    _, three = _pool("three", "pool.in_flight=3")
    run, auto = _pool("auto", "pool.in_flight=0")
    for k in "xvt":
        np.testing.assert_allclose(three[k], one[k], atol=1e-5, rtol=0)
        np.testing.assert_allclose(auto[k], one[k], atol=1e-5, rtol=0)
    assert np.abs(one["v"]).max() > 0.1  # a real flow was simulated
    # chunk resume unchanged: pretend only chunk 0 finished, wipe the rest, rebuild batched
    progress = json.loads((run.dir / "pool" / "progress.json").read_text())
    assert progress["chunks"] == [0, 1] and progress["diameter"] > 0
    (run.dir / "pool" / "progress.json").write_text(json.dumps({**progress, "chunks": [0]}))
    x = np.load(run.dir / "pool" / "x.npy", mmap_mode="r+")
    x[3 * 3 * 24 :] = 0
    x.flush()
    (run.checkpoints("pool").final_path).unlink()
    Trainer(run, nsgf.pool_task(run.cfg, *distributions(run.cfg))).fit()
    np.testing.assert_array_equal(np.load(run.dir / "pool" / "x.npy"), auto["x"])


def test_in_flight_from_memory_budget():
    cfg = config.resolve("moons", POOL, {})["pool"]
    assert choose_in_flight({**cfg, "in_flight": 4}, (2,), torch.device("cpu")) == 4
    assert choose_in_flight({**cfg, "in_flight": 99}, (2,), torch.device("cpu")) == cfg["batches"]
    big = {**cfg, "batches": 100000, "batch_size": 256, "steps": 5, "in_flight": 0}
    small_pts, images = choose_in_flight(big, (2,), torch.device("cpu")), choose_in_flight(big, (3, 32, 32), torch.device("cpu"))
    assert 1 <= images < small_pts <= 100000  # the 1 GiB CPU budget holds fewer image batches


def test_ot_velocity_stays_float32_under_autocast():
    from sinkflow.ot import sinkhorn_velocity

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 2, generator=g), torch.randn(64, 2, generator=g) + 2
    plain = sinkhorn_velocity(x, y, blur=0.1, scaling=0.8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = sinkhorn_velocity(x, y, blur=0.1, scaling=0.8)
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)


def _train(opt_kwargs, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **opt_kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_fast_adam_matches_plain(kind):
    """foreach (where no fused kernel exists) and fused (the default on CUDA, and on the CPU from torch 2.4) vs the
    for-loop Adam: 1e-6."""
    plain = _train({"foreach": False})
    for a, b in zip(_train({kind: True}), plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ema_uses_foreach_lerp_and_matches_formula(monkeypatch):
    model = torch.nn.Linear(4, 3)
    decay = 0.9
    ema = EMA(model, decay)  # the Trainer's EMA
    calls = []
    real = torch._foreach_lerp_
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    manual = [p.detach().clone() for p in model.parameters()]
    for i in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (i + 1))
        ema.update_parameters(model)
        if i == 0:  # the first update copies the weights
            manual = [p.detach().clone() for p in model.parameters()]
        else:
            manual = [decay * m + (1 - decay) * p.detach() for m, p in zip(manual, model.parameters())]
    assert calls, "EMA did not use torch._foreach_lerp_"
    for a, b in zip(ema.module.parameters(), manual):
        torch.testing.assert_close(a, b)


def _unet():
    cfg = {"channels": 16, "res_blocks": 1, "channel_mult": [1, 2], "num_heads": 1, "num_head_channels": -1,
           "attention_resolutions": [4], "dropout": 0.0}
    torch.manual_seed(0)
    return build_model("unet", cfg, (3, 8, 8))


def _loss_and_grads(model, x, t, dtype=None):
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = (model(x, t).float() - x).pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_channels_last_matches_plain_and_is_gated():
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.rand(4, generator=torch.Generator().manual_seed(3))
    plain = _unet()
    fast = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    xc, tc = to_channels_last((x, t))
    assert xc.is_contiguous(memory_format=torch.channels_last) and torch.equal(xc, x) and tc is t
    l0, g0 = _loss_and_grads(plain, x, t)
    l1, g1 = _loss_and_grads(fast, xc, tc)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    cuda = torch.device("cuda")
    assert use_channels_last({"channels_last": True}, cuda, (3, 32, 32))
    assert not use_channels_last({"channels_last": True}, cuda, (2,))  # point clouds: no 4-D tensors
    assert not use_channels_last({"channels_last": False}, cuda, (3, 32, 32))
    assert not use_channels_last({"channels_last": True}, torch.device("cpu"), (3, 32, 32))
    assert not use_channels_last({}, cuda, (3, 32, 32))  # off unless asked: measured slower (docs/performance.md)


def test_a_phase_names_the_fp16_key_in_its_first_lines_on_a_t4(runs_dir, tmp_path, monkeypatch, caplog):
    """The Trainer's call of fast_path.fp16_hint, end to end on an (N, 1, 28, 28) FM run: the phase is told its
    device is a compute-capability-7.5 card (the hint reads only that), and its first lines carry the hint."""
    import logging

    from sinkflow.cli import main
    from sinkflow.engine import fast_path
    from test_images import TINY_FM, setup_data

    real, asked = fast_path.fp16_hint, []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(fast_path, "fp16_hint", lambda tcfg, kind, device, key: asked.append((kind, key, str(device)))
                        or real(tcfg, kind, "cuda", key))
    extra, _ = setup_data("mnist", tmp_path)
    with caplog.at_level(logging.INFO):
        assert main(["train", "mnist", "--method", "fm", *TINY_FM, *extra, "--name", "t4", "--no-report"]) == 0
    assert asked == [("unet", "velocity", "cpu")]
    assert any("compute capability 7.5" in r.getMessage() and "train.velocity.precision=fp16" in r.getMessage()
               for r in caplog.records)


def test_a_torchrun_phase_left_eager_by_graph_auto_names_the_key_that_captures_it(runs_dir, tmp_path, monkeypatch,
                                                                                    caplog):
    """Under torchrun ``graph: auto`` is ``none`` (DDP's hooks are not captured), so a UNet or time-predictor phase on
    CUDA cards steps eagerly, at an eighth of one process's captured rate, in silence: the phase's first lines name
    ``graph=step``. Not on a CPU, in one process, for an MLP, nor where graph was set. End to end on an (N, 1, 28, 28)
    FM run, the Trainer's call seen with the device and world it passes made a card's and two."""
    import logging

    from sinkflow.cli import main
    from sinkflow.engine import fast_path
    from sinkflow.engine.fast_path import ddp_graph_hint
    from test_images import TINY_FM, setup_data

    auto = config.resolve("mnist", [])["train"]["velocity"]
    hint = ddp_graph_hint(auto, "unet", "cuda", 2, "velocity")
    assert "under torchrun" in hint and "train.velocity.graph=step" in hint
    assert ddp_graph_hint(auto, "time_predictor", "cuda:3", 8, "time") is not None
    assert ddp_graph_hint(auto, "unet", "cuda", 1, "velocity") is None  # one process: the step is captured
    assert ddp_graph_hint(auto, "unet", "cpu", 2, "velocity") is None
    assert ddp_graph_hint(auto, "mlp", "cuda", 2, "velocity") is None
    assert ddp_graph_hint({**auto, "graph": "none"}, "unet", "cuda", 2, "velocity") is None  # asked for

    real, asked = fast_path.ddp_graph_hint, []
    monkeypatch.setattr(fast_path, "ddp_graph_hint", lambda tcfg, kind, device, world, key:
                        asked.append((kind, key, world)) or real(tcfg, kind, "cuda", 2, key))
    extra, _ = setup_data("mnist", tmp_path)
    with caplog.at_level(logging.INFO):
        assert main(["train", "mnist", "--method", "fm", *TINY_FM, *extra, "--name", "ddp", "--no-report"]) == 0
    assert asked == [("unet", "velocity", 1)]
    assert any("train.velocity.graph=step" in r.getMessage() for r in caplog.records)


def test_auto_speed_settings_resolve_per_device_network_and_process_count(monkeypatch):
    """auto = bf16 + the whole step one CUDA graph for a UNet on a bf16 CUDA card in one process (the time predictor:
    the step graph in fp32); the plain path everywhere else; an explicit value is never changed. The card is faked:
    only its compute capability is read."""
    from sinkflow.engine.fast_path import fp16_hint, resolve

    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    auto = config.resolve("mnist", [])["train"]["velocity"]
    assert (auto["precision"], auto["compile"], auto["compile_mode"], auto["graph"], auto["channels_last"]) == \
        ("auto", "auto", "auto", "auto", False)

    def speed(tcfg, kind="unet", device="cuda", world=1):
        r = resolve(tcfg, kind, device, world)
        return r["precision"], r["compile"], r["compile_mode"], r["graph"]

    assert speed(auto) == ("fp16", True, "default", "step")  # compiled inside the captured step
    assert speed(auto, device="cuda:1") == ("fp16", True, "default", "step")
    assert speed(auto, device="cpu") == ("fp32", False, "default", "none")
    assert speed(auto, kind="time_predictor") == ("fp32", False, "default", "step")
    assert speed(auto, kind="mlp") == ("fp32", False, "reduce-overhead", "none")  # mode only matters if compiled
    assert speed(auto, kind="flow") == ("fp32", False, "reduce-overhead", "none")
    assert speed(auto, world=2) == ("fp16", False, "default", "none")  # DDP: the all-reduce is not captured
    # asked for under torchrun: two graphs around the all-reduce, the plain model compiled inside as in one process
    assert speed({**auto, "graph": "step"}, world=2) == ("fp16", True, "default", "step")
    assert fp16_hint(auto, "unet", "cuda", "velocity") is None  # fp16 is the default there
    capability["value"] = (7, 5)  # a T4: no bf16 tensor cores
    assert speed(auto) == ("fp32", True, "default", "step")
    # ... but float16 ones, unmeasured here: the phase's first lines name the key that uses them
    hint = fp16_hint(auto, "unet", "cuda", "velocity")
    assert "compute capability 7.5" in hint and "train.velocity.precision=fp16" in hint
    assert fp16_hint({**auto, "precision": "fp32"}, "unet", "cuda", "velocity") is None  # asked for: said nothing
    assert fp16_hint(auto, "mlp", "cuda", "velocity") is None and fp16_hint(auto, "unet", "cpu", "velocity") is None
    capability["value"] = (6, 1)  # a P100: no tensor cores at all
    assert fp16_hint(auto, "unet", "cuda", "velocity") is None
    capability["value"] = (7, 5)
    assert resolve(auto, "unet", "cuda", bf16=True)["precision"] == "fp16"  # the planner's card, not this one
    explicit = {**auto, "precision": "fp16", "compile": False, "compile_mode": "max-autotune"}
    assert speed(explicit) == ("fp16", False, "max-autotune", "none")  # an asked-for graphs mode wins
    assert speed({**auto, "precision": "fp16"}) == ("fp16", True, "default", "step")  # loss scaling is captured
    assert speed({**auto, "graph": "none"}) == ("fp32", True, "reduce-overhead", "none")  # graphs of the model
    assert speed({**auto, "compile_mode": "reduce-overhead"}) == ("fp32", True, "reduce-overhead", "none")
    # kernels chosen by timing and no graphs of its own: inside the captured step
    timed = {**auto, "compile_mode": "max-autotune-no-cudagraphs"}
    assert speed(timed) == ("fp32", True, "max-autotune-no-cudagraphs", "step")
    assert speed({**auto, "compile": True}, device="cpu") == ("fp32", True, "default", "none")


def test_a_plain_cuda_device_gets_the_current_index_for_the_prefetch_worker(monkeypatch):
    """The worker thread's set_device refuses an index-less ``cuda`` (it killed a plain-``cuda`` run's first
    step on an H100): the prefetcher names the training thread's current device."""
    from sinkflow.engine.prefetch import indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu")) == torch.device("cpu")


def test_bf16_autocast_close_to_fp32_and_master_weights_fp32():
    """bf16 autocast: loss within 2 % and gradients within 10 % (relative norm) of fp32; weights stay fp32."""
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.rand(4, generator=torch.Generator().manual_seed(3))
    model = _unet()
    l0, g0 = _loss_and_grads(model, x, t)
    l1, g1 = _loss_and_grads(model, x, t, torch.bfloat16)
    assert abs(float(l1 - l0)) <= 0.02 * float(l0)
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(g1, g0)) ** 0.5
    den = sum(float(b.pow(2).sum()) for b in g0) ** 0.5
    assert num <= 0.1 * den
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_device_generator_is_reproducible_from_the_cpu_state():
    g = torch.Generator().manual_seed(5)
    assert device_generator(g, torch.device("cpu")) is g  # CPU: draw from the phase generator directly
    if torch.cuda.is_available():
        a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        na = torch.randn(1000, generator=device_generator(a, "cuda"), device="cuda")
        nb = torch.randn(1000, generator=device_generator(b, "cuda"), device="cuda")
        assert torch.equal(na, nb) and torch.equal(a.get_state(), b.get_state())


def test_bench_stopped_by_a_signal_names_no_resume_and_caps_its_warmup(monkeypatch, capsys):
    """A SIGTERM during bench printed "checkpoint saved; resume with `sinkflow train --resume RUN`" of its scratch
    run, gone with its folder; --warmup 10^12 (a typo) ran for ever, where --steps is capped."""
    import signal

    from sinkflow.cli import main
    from sinkflow.runtime.signals import Interrupted

    def stopped(*args, **kwargs):
        raise Interrupted(int(signal.SIGTERM), "velocity", 3)

    monkeypatch.setattr("sinkflow.tools.bench.profile", stopped)
    assert main(["bench", "moons", "--steps", "2", "--device", "cpu"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "sinkflow: bench stopped by signal 15" in err and "resume" not in err, err
    assert main(["bench", "moons", "--warmup", "1000000000000"]) == 2
    assert "--warmup from 0 to 100,000" in capsys.readouterr().err


def test_bench_profile_reports_data_and_compute(runs_dir, capsys):
    from sinkflow.cli import main

    assert main(["bench", "--profile", "moons", "--method", "nsgf", "pool.steps=2", "pool.batch_size=16",
                 "--batch-size", "32", "--steps", "4", "--warmup", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("velocity"))
    steps, step_ms, data_ms, compute_ms = row.split()[1:5]
    assert int(steps) == 4 and abs(float(data_ms) + float(compute_ms) - float(step_ms)) < 0.02
    assert "compute-bound" in row or "data-bound" in row
    assert "pool.storage" not in out and "image cache" not in out  # the levers this run has: its pool is in RAM
    assert main(["bench", "--profile", "moons", "pool.storage=disk", "pool.steps=2", "pool.batch_size=16",
                 "--batch-size", "32", "--steps", "2", "--warmup", "0", "--device", "cpu"]) == 0
    assert "set pool.storage=memory" in capsys.readouterr().out  # a pool memory-mapped from the disk: the lever
    assert not runs_dir.exists()  # the profile runs in a throw-away folder
    assert main(["bench", "--profile", "moons", "--method", "otcfm", "--batch-size", "32", "--steps", "2",
                 "--warmup", "0", "--device", "cpu", "--name", "mine", "experiment.runs_dir=kept"]) == 0
    out, err = capsys.readouterr()  # OT-CFM has no pool and 2D points no image cache: it advised both
    # a run folder's name and place, dropped without a word: said (nothing is kept)
    assert "note: --name and experiment.runs_dir not used: bench trains in a scratch folder it deletes" in err
    assert not runs_dir.exists() and not (runs_dir.parent / "kept").exists()
    assert "data-bound (> 30 % waiting): use fewer but larger batches" in out and "pool.storage" not in out
    flow = ["bench", "--profile", "flow-digits", "model.flow.depth_per_level=1", "model.flow.hidden_channels=8",
            "--batch-size", "8", "--steps", "2", "--warmup", "0", "--device", "cpu"]
    assert main([*flow, "model.flow.memory=invertible"]) == 0  # bf16 was advised, which that mode refuses
    out = capsys.readouterr().out
    assert "model.flow.memory=invertible trains in fp32" in out and "other networks can try" not in out
    assert main(flow) == 0  # keys a user can paste (train.*.precision=bf16 was advised: no override reads it)
    assert "other networks can try --precision bf16 (every training phase), train.flow.compile=true" in \
        capsys.readouterr().out


def test_compiled_sampling_draws_the_eager_samples_and_counts_every_call(tiny_run, tmp_path, capsys):
    """`sample.compile=true` (torch.compile of the sampled networks; CUDA graphs on a GPU) draws what the eager
    sampler draws from the same seed, and the forward hooks still count each Euler step's network call."""
    from torch._dynamo.utils import counters

    from sinkflow.cli import main

    outs, graphs = {}, []
    for flag in ("false", "true"):
        out = tmp_path / f"{flag}.npy"
        assert main(["sample", str(tiny_run), f"sample.compile={flag}", "--n", "48", "--steps", "5", "--seed", "3",
                     "--out", str(out)]) == 0
        assert "(5 steps, 5 network evaluations)" in capsys.readouterr().out
        outs[flag] = np.load(out, allow_pickle=False)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] > graphs[0]  # the compiled sampler really ran compiled code
    assert outs["true"].shape == (48, 2)
    np.testing.assert_allclose(outs["true"], outs["false"], atol=1e-5)


def test_sampling_that_cannot_compile_is_one_line_naming_sample_compile(tiny_run, tmp_path, capsys, monkeypatch):
    """`sample.compile=true` where torch.compile cannot compile (no C++ compiler on a CPU machine, no Triton for the
    card) ended `sinkflow sample` in dynamo's traceback, pages of it, where training says one line (audit GG)."""
    from torch._dynamo.exc import TorchDynamoException

    from sinkflow.cli import main
    from sinkflow.methods import base

    class CannotCompile(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise TorchDynamoException("InvalidCxxCompiler: No working C++ compiler found\n(pages of it)")

    monkeypatch.setattr(base, "compiled_for_sampling", lambda model, device: CannotCompile())
    out = tmp_path / "s.npy"
    assert main(["sample", str(tiny_run), "sample.compile=true", "--n", "8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("sinkflow: error: torch.compile failed while sampling: InvalidCxxCompiler: No working C++ compiler "
                   "found; set sample.compile=false to sample eager"), err
    assert not out.exists()


def test_half_precision_sampling_stays_close_to_fp32_with_a_float32_state(tiny_run, tmp_path, capsys):
    """`sample.precision=bf16` / `fp16` run the sampled network under that autocast: the draw is float32, close to
    the fp32 draw from the same seed, and not the same draw (the autocast really ran); fp16's 11-bit mantissa stays
    closer than bf16's 8 bits."""
    from sinkflow.cli import main

    outs = {}
    for precision in ("fp32", "bf16", "fp16"):
        out = tmp_path / f"{precision}.npy"
        assert main(["sample", str(tiny_run), f"sample.precision={precision}", "--n", "64", "--steps", "5",
                     "--seed", "3", "--out", str(out)]) == 0
        outs[precision] = np.load(out, allow_pickle=False)
    capsys.readouterr()
    diffs = {}
    for half in ("bf16", "fp16"):
        assert outs[half].dtype == np.float32 and np.isfinite(outs[half]).all()
        diffs[half] = np.abs(outs[half] - outs["fp32"])
        assert 0 < diffs[half].max() < 0.05 * (np.abs(outs["fp32"]).max() + 1), half
    assert diffs["fp16"].mean() < diffs["bf16"].mean()


def test_sampling_precision_auto_is_fp16_where_training_auto_is(monkeypatch):
    """`sample.precision: auto` (the default since the H200's 2026-11-30 rows: eager fp16 1.56x fp32's images/s, the
    samples fp32's to a paired FD-CNN change <= 0.05) is fp16 for a UNet on a CUDA card with bf16 tensor cores, as a
    training phase's auto, and fp32 on a CPU, on a T4, for a 2-D MLP; an explicit value is kept; a method that does
    not read the key (a flow's one inverse pass) samples in fp32. The planner's sample row follows it for the card
    it plans for. The card is faked: only its compute capability is read."""
    from sinkflow import methods
    from sinkflow.runtime.autocast import sampling_precision
    from sinkflow.tools import memory_plan

    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    assert config.resolve("mnist", [])["sample"]["precision"] == "auto"
    assert sampling_precision("auto", "unet", "cuda") == "fp16"
    assert sampling_precision("auto", "unet", "cpu") == "fp32"
    assert sampling_precision("auto", "mlp", "cuda") == "fp32"
    assert [sampling_precision(v, "unet", "cuda") for v in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]
    assert sampling_precision("auto", "unet", "cpu", bf16=True) == "fp32"  # the plan's card flag is for CUDA only
    capability["value"] = (7, 5)
    assert sampling_precision("auto", "unet", "cuda") == "fp32"
    assert sampling_precision("auto", "unet", "cuda", bf16=True) == "fp16"  # the planner's card, not this one
    # a set bf16 (a run trained on an A100) sampled on a card without bf16 tensor cores: fp32, as training's auto
    assert [sampling_precision("auto", "unet", "cuda", trained=t) for t in ("bf16", "fp16", "fp32")] == \
        ["fp32", "fp16", "fp32"]
    assert sampling_precision("bf16", "unet", "cuda") == "bf16"  # asked for by name: kept
    capability["value"] = (9, 0)
    # a network whose training precision was set is sampled in it: fp32 kept out of half precision on purpose
    assert [sampling_precision("auto", "unet", "cuda", trained=t) for t in ("fp32", "bf16", "auto")] == \
        ["fp32", "bf16", "fp16"]
    # ... on a CUDA card: a run trained in a set half precision (a T4's fp16 key) and sampled on a laptop's CPU ran
    # its convolutions in fp16 there, which a CPU has no fast kernels for; auto is fp32 on a CPU, as training's
    assert [sampling_precision("auto", "unet", "cpu", trained=t) for t in ("fp32", "bf16", "fp16")] == ["fp32"] * 3
    on_gpu = config.resolve("mnist", ["train.velocity.precision=fp16"])
    assert methods.of(on_gpu).sample_precision(on_gpu, "cpu") == "fp32"
    assert methods.of(on_gpu).sample_precision(on_gpu, "cuda") == "fp16"
    forced = config.resolve("mnist", ["train.velocity.precision=fp32"])
    assert methods.of(forced).sample_precision(forced, "cuda") == "fp32"
    for preset, method, want in (("mnist", "nsgfpp", "fp16"), ("mnist", "otcfm", "fp16"), ("moons", "nsgf", "fp32"),
                                 ("flow-digits", "flow", "fp32")):
        cfg = config.resolve(preset, [f"experiment.method={method}"] if method != "flow" else [])
        assert methods.of(cfg).sample_precision(cfg, "cuda", bf16=True) == want, (preset, method)
    cfg = config.resolve("digits", ["experiment.method=fm"])
    rows = {}
    for value in ("auto", "fp32"):
        cfg["sample"]["precision"] = value
        rows[value] = memory_plan.estimate(cfg, bf16=True)[-1].terms["forward transient"]
    assert rows["fp32"] == 2 * rows["auto"] > 0  # auto samples the fp16-trained UNet in fp16: half the bytes


def test_samples_that_overflow_under_auto_name_what_auto_became(tiny_run):
    """A NaN / Inf draw sampled in fp16 by `sample.precision: auto` names fp16 and the key's value: a user who never
    set it is told where fp16 came from, and the fix (bf16 or fp32) is the same as for an explicit fp16."""
    from sinkflow.errors import SinkflowError
    from sinkflow.eval.points import check_finite_samples

    cfg = RunFolder.open(tiny_run).cfg
    cfg["sample"]["precision"] = "auto"
    x = torch.zeros(4, 2)
    x[1, 0] = float("inf")
    with pytest.raises(SinkflowError) as e:
        check_finite_samples(cfg, x, 3, "fp16")
    assert e.value.problem.endswith("1 of 4 samples of nsgf with 3 steps are NaN/Inf under fp16 "
                                    "(sample.precision=auto)")
    assert "sample.precision=bf16" in e.value.fix
    with pytest.raises(SinkflowError) as e:
        check_finite_samples(cfg, x, 3, "fp32")
    assert "diverged" in e.value.fix


def test_sample_names_a_half_precision_it_sampled_in(tiny_run, tmp_path, capsys):
    """`sinkflow sample`'s line says the networks ran in half precision when they did (auto takes fp16 on a CUDA
    card: a user reading the line knows what made the samples) and says nothing of fp32."""
    from sinkflow.cli import main

    for i, (precision, said) in enumerate((("bf16", True), ("fp32", False), ("auto", False))):  # auto, a CPU: fp32
        out = tmp_path / f"s{i}.npy"
        assert main(["sample", str(tiny_run), f"sample.precision={precision}", "--n", "8", "--steps", "3",
                     "--out", str(out)]) == 0
        line = capsys.readouterr().out
        assert ("the networks in bf16" in line) is said and "fp32" not in line, (precision, line)


def test_samples_that_overflow_float16_are_refused_naming_the_precision(tiny_run, tmp_path, monkeypatch, capsys):
    """A velocity network whose output float16 cannot hold (here scaled by 1e6 inside the network, after its last
    layer's half-precision product) gave Inf samples under `sample.precision=fp16`, which `sinkflow sample` saved as
    they were; now the draw is refused in one line naming fp16 and the fix, nothing is written, and the same network
    in fp32 (finite, large) or with NaN weights (any precision: "diverged") is told apart."""
    from sinkflow.cli import main
    from sinkflow.errors import SinkflowError
    from sinkflow.eval.points import generate

    run = RunFolder.open(tiny_run)
    net = run.model("velocity")
    last = [m for m in net.modules() if isinstance(m, torch.nn.Linear)][-1]
    last.register_forward_hook(lambda m, i, out: out * 1e6)  # in the layer's own dtype: float16 under autocast
    x, _ = generate(run, 16, 3, seed=0)
    assert torch.isfinite(x).all() and x.abs().max() > 1e4  # fp32 holds it
    run.cfg["sample"]["precision"] = "fp16"
    with pytest.raises(SinkflowError) as e:
        generate(run, 16, 3, seed=0)
    assert e.value.problem.endswith("of 16 samples of nsgf with 3 steps are NaN/Inf under sample.precision=fp16")
    assert "sample.precision=bf16" in e.value.fix
    run.cfg["sample"]["precision"] = "fp32"
    with torch.no_grad():
        last.weight.fill_(float("nan"))
    with pytest.raises(SinkflowError) as e:
        generate(run, 16, 3, seed=0)
    assert e.value.problem == "16 of 16 samples of nsgf with 3 steps are NaN/Inf" and "diverged" in e.value.fix

    def overflowing(module):  # the CLI's own run folder, its network scaled the same way
        return [m for m in module.modules() if isinstance(m, torch.nn.Linear)][-1].register_forward_hook(
            lambda m, i, out: out * 1e6)

    load = RunFolder.model
    monkeypatch.setattr(RunFolder, "model", lambda self, phase: (lambda net: (overflowing(net), net)[1])(
        load(self, phase)))
    out = tmp_path / "s.npy"
    assert main(["sample", str(tiny_run), "sample.precision=fp16", "--n", "8", "--steps", "3", "--out", str(out)]) == 2
    assert "NaN/Inf under sample.precision=fp16" in capsys.readouterr().err and not out.exists()


def test_an_evaluation_record_names_a_half_precision_it_sampled_in(tiny_run):
    """`sample.precision: auto` samples a UNet in fp16 on a CUDA card and in fp32 on a CPU: the same run's scores from
    the two machines differ in how they were made, so a record says the precision where it is not fp32 (and says
    nothing of fp32, as before: older records and CPU runs read the same)."""
    from sinkflow.eval.records import setting

    run = RunFolder.open(tiny_run)
    assert "precision" not in setting(run, 8, 1)  # auto on this CPU: fp32
    run.cfg["sample"]["precision"] = "bf16"
    assert setting(run, 8, 1)["precision"] == "bf16"


def test_a_resume_on_another_machine_says_what_its_auto_speed_settings_became(runs_dir, monkeypatch, caplog):
    """A run trained where `precision: auto` / `graph: auto` were fp16 (with GradScaler) and the step graph (a UNet on
    an Ampere+ card), stopped mid-phase and resumed on a CPU or a T4 (fp32, no graph): config.yaml holds `auto` both
    times, so no change was recorded, and the resume printed only its new settings. It now says both, and trains on
    (the scaler's state set aside); the other way (fp32 -> fp16) starts a fresh loss scale and says so. The GPU
    machine is faked by fast_path.resolve's answer (its other settings are this CPU's)."""
    import logging

    import sinkflow
    from sinkflow.engine import fast_path
    from sinkflow.runtime.callbacks import Callback

    class StopAt(Callback):
        def __init__(self, step):
            self.at = step

        def on_train_batch_end(self, trainer, batch, out):
            if trainer.name == "velocity" and trainer.step == self.at:
                trainer.request_stop()

    real = fast_path.resolve

    def gpu(tcfg, kind, device, world=1, bf16=None):
        return {**real(tcfg, kind, device, world, bf16), "precision": "fp16", "graph": "step"}

    small = {"pool.batches": 2, "pool.steps": 4, "pool.batch_size": 32, "pool.chunk": 1,
             "train.velocity.ckpt_every": 100, "train.velocity.log_every": 2, "train.velocity.graph": "auto"}
    monkeypatch.setattr(fast_path, "resolve", gpu)
    with pytest.raises(BaseException, match="request_stop"):
        sinkflow.train("moons", name="r", device="cpu", runs_dir=runs_dir, callbacks=[StopAt(3)], train_iters=8,
                       **small)
    monkeypatch.setattr(fast_path, "resolve", real)  # the CPU's own answer: fp32, no graph
    with caplog.at_level(logging.INFO, logger="sinkflow"), pytest.raises(BaseException, match="request_stop"):
        sinkflow.resume(runs_dir / "r", device="cpu", callbacks=[StopAt(5)])
    said = [r.getMessage() for r in caplog.records if "resumes in" in r.getMessage()]
    assert said == ["velocity: trained to step 3 in fp16, graph step on cpu; resumes in fp32, graph none on cpu "
                    "(train.velocity.precision / graph: auto, decided per machine and process count); fp16's loss "
                    "scale is set aside"], said
    caplog.clear()
    monkeypatch.setattr(fast_path, "resolve", gpu)  # back on the card
    with caplog.at_level(logging.INFO, logger="sinkflow"):
        sinkflow.resume(runs_dir / "r", device="cpu")
    said = [r.getMessage() for r in caplog.records if "resumes in" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("velocity: trained to step 5 in fp32") and \
        said[0].endswith("fp16's loss scale starts afresh"), said
    final = torch.load(runs_dir / "r" / "checkpoints" / "velocity" / "final.pt", weights_only=True)
    assert final["step"] == 8 and final["scaler"]["scale"] > 0
    assert final["resolved"] == {"device": "cpu", "precision": "fp16", "graph": "step", "compile": "off"}


def test_a_phase_in_fp16_on_a_cpu_names_the_key_that_gives_it_fp32(runs_dir, monkeypatch, caplog):
    """A run trained on a GPU with train.velocity.precision=fp16 set (the key a T4 user is told) and resumed on a
    laptop keeps fp16 there, where float16 autocast has no fast kernels (a moons step 5-6x slower than fp32 on this
    VM): the first lines said only "fp16"; they now name precision=auto. Nothing on a CUDA card, nor for fp32/bf16."""
    import logging

    from helpers import TINY_2D
    from sinkflow.cli import main
    from sinkflow.engine import fast_path
    from sinkflow.engine.fast_path import cpu_fp16_hint

    assert cpu_fp16_hint("fp16", "cuda", "velocity", "unet") is None
    assert cpu_fp16_hint("bf16", "cpu", "velocity", "unet") is None
    assert cpu_fp16_hint("fp32", "cpu", "velocity", "unet") is None
    # auto on a card follows the network (fast_path.resolve): fp16 for a UNet, fp32 for moons' MLP, which the line
    # had promised fp16 on a card too
    assert cpu_fp16_hint("fp16", "cpu", "velocity", "unet").endswith(
        "precision=auto is fp32 here and fp16 on a CUDA card of compute capability 8.0+")
    assert fast_path.resolve({"precision": "auto"}, "mlp", "cuda", bf16=True)["precision"] == "fp32"
    with caplog.at_level(logging.INFO, logger="sinkflow"):
        assert main(["train", "moons", *TINY_2D, "train.velocity.precision=fp16", "--name", "h", "--no-report"]) == 0
    said = [r.getMessage() for r in caplog.records if "no fast float16 kernels" in r.getMessage()]
    assert said == ["velocity: fp16 on a CPU, which has no fast float16 kernels (steps several times slower than "
                    "fp32's); train.velocity.precision=auto is fp32 here and on a CUDA card too: auto's fp16 is a "
                    "UNet's"], said


def test_sampling_precision_auto_reads_a_methods_own_network_names(monkeypatch):
    """`auto` decided on ``model.velocity``'s kind: a method whose sampled UNet is its own phase (a plugin's ``net``)
    was read as having none (a KeyError, or fp32 on a card where its UNet would run fp16). It now takes the first of
    the method's networks the fast path was measured on, and that network's set training precision."""
    from sinkflow.config import schema
    from sinkflow.methods.base import Method

    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])

    class Toy(Method):
        name = "toyprec"

    schema.register_method("toyprec", schema.MethodSpec("sinkflow_toy.toyprec:METHOD", ("pool", "net", "head"),
                                                        schema.EULER_READS))
    try:
        cfg = {"sample": {"precision": "auto"}, "model": {"head": {"kind": "mlp"}, "net": {"kind": "unet"}},
               "train": {"net": {"precision": "auto"}, "head": {"precision": "fp32"}}}
        assert Toy().sample_precision(cfg, "cuda") == "fp16"  # its UNet, not the MLP head listed after it
        cfg["train"]["net"]["precision"] = "bf16"
        assert Toy().sample_precision(cfg, "cuda") == "bf16"
        assert Toy().sample_precision(cfg, "cpu") == "fp32"
    finally:
        schema.unregister_method("toyprec")


def test_a_w2_table_names_a_half_precision_it_sampled_in(tiny_run, tmp_path, capsys):
    """The image table says a half precision after its protocol line; the W2 table said nothing, though a 2-D run
    sampled in one where it is set (sample.precision=bf16, or auto keeping a set train.velocity.precision on a CUDA
    card): a W2 at 1e-3 is sensitive to it (docs/performance.md). A line under the table says it; nothing for fp32."""
    import shutil

    from sinkflow.cli import main

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    assert main(["eval", str(run), "--seeds", "1", "--n", "64", "sample.precision=bf16"]) == 0
    out = capsys.readouterr().out
    assert "W2 on" in out and "\nthe networks sampled in sample.precision=bf16\n" in out, out
    assert main(["eval", str(run), "--seeds", "1", "--n", "64"]) == 0  # auto on this CPU: fp32, said by nothing
    out = capsys.readouterr().out
    assert "W2 on" in out and "sampled in" not in out, out


def test_a_compile_mode_auto_decided_is_said_as_auto_on_resume():
    """`compile: true` with `compile_mode: auto` (reduce-overhead for one CUDA process, default under torchrun or on
    a CPU): a resume whose mode changed with the machine or the process count read as a hand edit (no "auto, decided
    per machine" reason), since only the `compile` key was looked at."""
    from types import SimpleNamespace

    from sinkflow.engine.trainer import Trainer

    def resume(tcfg, now, saved):
        fake = SimpleNamespace(resolved=lambda: now, task=SimpleNamespace(model_key="velocity"), name="velocity",
                               run=SimpleNamespace(cfg={"train": {"velocity": tcfg}}))
        return Trainer.resolved_change(fake, saved, 7)

    saved = {"device": "cuda", "precision": "fp16", "graph": "none", "compile": "reduce-overhead"}
    now = {**saved, "compile": "default"}
    line = resume({"precision": "fp16", "graph": "none", "compile": True, "compile_mode": "auto"}, now, saved)
    assert line == ("velocity: trained to step 7 in fp16, compile reduce-overhead on cuda; resumes in fp16, compile "
                    "default on cuda (train.velocity.compile: auto, decided per machine and process count)"), line
    # set by hand (an override of the resume, an edit of config.yaml: each said in its own line), on the same device:
    # said once, not again here; on another device the line stays (without an auto reason); a loss-scale note stays
    hand = {"precision": "fp16", "graph": "none", "compile": True, "compile_mode": "default"}
    assert resume(hand, now, saved) is None
    line = resume(hand, {**now, "device": "cpu"}, saved)
    assert line.endswith("resumes in fp16, compile default on cpu"), line
    line = resume({**hand, "precision": "fp32"}, {**saved, "precision": "fp32"}, saved)
    assert line == "velocity: fp16's loss scale is set aside", line
    assert resume({"compile": "auto"}, saved, saved) is None and resume({"compile": "auto"}, saved, None) is None
