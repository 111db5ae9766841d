"""Preflight passes the real presets and catches planted faults; the memory estimate matches measurement."""

import math
import shutil

import numpy as np
import pytest
import torch

from sinkflow import config, methods
from sinkflow.errors import SinkflowError
from sinkflow.models import build_model
from sinkflow.ot.sinkhorn_peak import cpu_peak_bytes
from sinkflow.tools import memory_plan
from sinkflow.tools.preflight import format_report, preflight

SMALL = ["moons", "8gaussians", "8gaussians-moons", "checkerboard", "scurve", "digits"]


def failed(report):
    return [(c.phase, c.name, c.detail) for c in report.checks if c.ok is False]


def apply_fit(cfg: dict, overrides: list[str]) -> dict:
    """``cfg`` with the planner's proposed ``overrides``, validated as a resolved config is."""
    new = config.apply_overrides(cfg, overrides)
    config.validate(new)
    return new


def test_preflight_all_presets(tmp_path, caplog):
    """`sinkflow preflight --all` in-process: every preset with small networks runs its full tiny preflight
    (every phase stopped and resumed, sample, evaluate, memory estimate); the big-UNet presets (mnist,
    cifar10, folder) run their config, flag and memory checks here and the full tiny run in
    test_preflight_image_preset_shapes / `sinkflow preflight --all` (minutes on 2 cores). The tiny run's own
    counts warn of nothing (digits' warmup of 50 against 3 tiny steps printed four warnings, and its EMA of 0.99 would
    keep 98 % of the first step's weights over them)."""
    names = config.preset_names()
    assert set(SMALL) <= set(names)
    for name in names:
        if name in SMALL:
            report = preflight(name, workdir=tmp_path / name, gpu=memory_plan.gpu_bytes("T4"))
            assert report.ok, format_report(report)
            assert {c.name for c in report.checks} >= {"kill and resume", "sample", "evaluate + plots", "fits T4"}
            assert not [r.getMessage() for r in caplog.records
                        if r.levelname == "WARNING" and ("warm" in r.getMessage() or ".ema=" in r.getMessage())]
        else:
            cfg = config.resolve(name, ["data.path=/nonexistent"] if name == "folder" else [])
            mems = memory_plan.estimate(cfg)
            assert [m.phase for m in mems][-1] == "sample+eval" and all(m.total > 0 for m in mems if m.terms)


def test_settings_the_real_run_is_too_short_for_fail_its_preflight(tmp_path):
    """The tiny runs are cut without these warnings (tools.phases.quiet_cut), so the real config is checked for
    them: under `--train-iters 40` a warm-up of 50 never ends and an EMA of 0.99 keeps 0.99^39 = 67.6 % of the first
    step's weights without its warm-up; each is named with its fix, and the rest of the preflight still runs."""
    report = preflight("moons", ["train.velocity.warmup=50", "train.velocity.ema=0.99", "train.velocity.ema_warmup=false"],
                       {"train_iters": 40},
                       workdir=tmp_path, memory=False)
    bad = [c for c in report.checks if c.ok is False]
    assert [(c.name, c.phase) for c in bad] == [("settings fit the run's length", "velocity")]
    assert "train.velocity.warmup=50 >= train.velocity.iters=40" in bad[0].detail
    assert "train.velocity.ema=0.99 over train.velocity.iters=40 keeps 67.6 %" in bad[0].detail
    assert "set train.velocity.ema_warmup=true or train.velocity.ema=0.8886 or lower" in bad[0].detail
    assert any(c.name == "kill and resume" and c.ok for c in report.checks)
    fine = preflight("moons", ["train.velocity.ema=0.8"], {"train_iters": 40}, workdir=tmp_path / "fine", memory=False)
    assert [c.ok for c in fine.checks if c.name == "settings fit the run's length"] == [True]


def test_preflight_image_preset_shapes(tmp_path, monkeypatch):
    """mnist with synthetic images of the real shape (no download here): every phase, real UNet config. Run from
    an empty folder: a checkout with the MNIST files in data/ (as a GPU session copies them) would use them. The
    real run's 5.6 GiB pool is checked against the free disk ("this machine"): a disk of 64 GiB is pretended, so the
    test does not depend on the one it runs on."""
    from collections import namedtuple

    from sinkflow.methods import pool

    monkeypatch.chdir(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**37, 2**36, 2**36))
    report = preflight("mnist", workdir=tmp_path, memory=False)
    assert report.ok, format_report(report)
    assert "synthetic mnist" in report.data_note
    assert "(1, 28, 28)" in next(c.detail for c in report.checks if c.name == "phases build")


def test_preflight_of_a_flow_preset_scores_its_validation_split_without_the_data(tmp_path, monkeypatch):
    """flow-mnist evaluates on its validation split (data.val_fraction 0.05): the synthetic stand-in had none, so
    preflight failed "there is no validation split" on the very box it exists for (a CPU box without the data)."""
    monkeypatch.chdir(tmp_path)
    report = preflight("flow-mnist", workdir=tmp_path, memory=False)
    assert report.ok, format_report(report)
    assert "synthetic mnist" in report.data_note


def test_planted_phase_that_crashes_only_on_images(tmp_path, monkeypatch):
    from sinkflow.methods import flow_matching

    real = flow_matching.velocity_loss

    def loss(model, batch):
        if batch[0].dim() > 2:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        return real(model, batch)

    monkeypatch.setattr(flow_matching, "velocity_loss", loss)
    ok = preflight("moons", shorthands={"method": "fm"}, workdir=tmp_path / "a", memory=False)
    assert ok.ok, format_report(ok)
    bad = preflight("digits", shorthands={"method": "fm"}, workdir=tmp_path / "b", memory=False)
    assert not bad.ok
    (phase, name, detail), = failed(bad)
    assert (phase, name) == ("velocity", "runs") and "mat1 and mat2" in detail and "(1, 8, 8)" in detail
    assert any(c.ok is None and c.phase == "eval" for c in bad.checks)  # later steps skipped, not crashed


def test_planted_shorthand_that_misses_a_phase(tmp_path, monkeypatch):
    monkeypatch.setitem(config.SHORTHANDS, "train_iters", ("train.velocity.iters", "train.nsf.iters"))
    report = preflight("digits", shorthands={"train_iters": 500}, workdir=tmp_path, memory=False)
    assert not report.ok
    bad = failed(report)
    # the flag check names the missed key, and the tiny run refuses to start the phase (it would run 1000 steps)
    assert ("time", "--train-iters reaches phase") in [(p, n) for p, n, _ in bad]
    assert any(p == "time" and n == "shorthands reach phase" and "train.time.iters=1000" in d for p, n, d in bad)
    assert not [b for b in bad if b[0] in ("velocity", "nsf", "pool")]


def test_planted_checkpoint_that_does_not_restore_the_optimizer(tmp_path, monkeypatch):
    from sinkflow.engine.trainer import Trainer

    original = Trainer.load_state_dict

    def forgetful(self, state, where):
        original(self, state, where)
        self.optimizer.state.clear()  # the moments are lost on resume

    monkeypatch.setattr(Trainer, "load_state_dict", forgetful)
    report = preflight("moons", shorthands={"method": "fm"}, workdir=tmp_path, memory=False)
    (phase, name, detail), = failed(report)
    assert (phase, name) == ("velocity", "kill and resume") and "optimizer state not restored" in detail


def test_an_fp16_phase_runs_its_card_path_and_its_resume_checks_the_grad_scaler(tmp_path, monkeypatch):
    """A phase set to fp16 (for the card) keeps fp16 in the tiny CPU run: autocast + GradScaler is the path the card
    runs. The report says so (fp16 on a CPU is slow: the phase's time is explained), and the resume compares what
    fp16 adds, the GradScaler's scale and growth count: a checkpoint that lost it passed "kill and resume"."""
    from sinkflow.engine.trainer import Trainer

    report = preflight("moons", ["train.velocity.precision=fp16"], {"method": "fm"}, workdir=tmp_path / "a",
                       memory=False)
    assert not failed(report), format_report(report)
    (detail,) = [c.detail for c in report.checks if c.name == "kill and resume"]
    assert "generator/GradScaler identical" in detail and "fp16 as train.velocity.precision sets" in detail, detail
    fp32 = preflight("moons", [], {"method": "fm"}, workdir=tmp_path / "b", memory=False)
    (detail,) = [c.detail for c in fp32.checks if c.name == "kill and resume"]
    assert "GradScaler" not in detail and "fp16" not in detail, detail

    original = Trainer.load_state_dict

    def forgetful(self, state, where):
        original(self, state, where)
        self.scaler = torch.amp.GradScaler("cpu")  # the loss scale starts afresh on resume

    monkeypatch.setattr(Trainer, "load_state_dict", forgetful)
    report = preflight("moons", ["train.velocity.precision=fp16"], {"method": "fm"}, workdir=tmp_path / "c",
                       memory=False)
    (phase, name, detail), = failed(report)
    assert (phase, name) == ("velocity", "kill and resume") and "GradScaler not restored" in detail, detail


def _run_folder(path, overrides, finished=(), half_built_pool=False):
    """A run folder as ``sinkflow train`` leaves it, for planning only: its config.yaml, a ``final.pt`` per finished
    phase (preflight reads the names, never the files) and, for a half-built pool, a chunk in ``pool/``."""
    from sinkflow.runtime.run_folder import write_config

    path.mkdir(parents=True)
    write_config(path, config.resolve("moons", [f"experiment.runs_dir={path.parent}", f"experiment.name={path.name}",
                                                "experiment.method=nsgfpp",
                                                *overrides]))
    for phase in finished:
        (path / "checkpoints" / phase).mkdir(parents=True)
        (path / "checkpoints" / phase / "final.pt").write_bytes(b"")
    if half_built_pool:
        (path / "pool").mkdir()
        (path / "pool" / "chunk_000000.npy").write_bytes(b"")
    return path


def test_preflight_of_a_run_folder_plans_the_phases_its_resume_runs(tmp_path, capsys, monkeypatch):
    """`sinkflow preflight RUN --gpu T4`: does the rest of a run started elsewhere fit a smaller card? It plans the
    run's own config.yaml; a finished phase is not run again, so it neither fails the card nor gets a fit, and the
    fit is a resume of RUN. It failed "config resolves" (unknown preset), and its config.yaml, the way out it named,
    failed the card on the finished velocity phase, proposed train.velocity.accum (a finished phase's key, which a
    resume refuses) and printed a `sinkflow train RUN/config.yaml` that train refuses (the folder exists)."""
    from sinkflow.cli import main

    monkeypatch.chdir(tmp_path)
    big = ["model.velocity.hidden=1024", "model.nsf.hidden=1024", "train.velocity.batch_size=524288",
           "train.nsf.batch_size=524288"]
    run = _run_folder(tmp_path / "runs" / "r1", big, finished=("pool", "velocity"))
    assert main(["preflight", str(run), "--gpu", "T4", "--fit"]) == 0  # the fit fixes it
    out = capsys.readouterr().out
    assert "FAIL  all       fits T4" in out and "too large: nsf" in out, out
    assert "PASS  fits T4 with --fit applied: every phase fits" in out, out  # the finished velocity is not re-planned
    assert "velocity                 -  finished in" in out, out  # planned, not a verdict
    (command,) = [ln.split("command:", 1)[1].strip() for ln in out.splitlines() if "command:" in ln]
    assert command.startswith(f"sinkflow train --resume {run} train.nsf.accum="), command
    assert "velocity" not in command, command
    # a key beside RUN would be dropped (the run's config.yaml is planned): one line, before any work
    assert main(["preflight", str(run), "train.nsf.accum=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plans the run's own config.yaml; train.nsf.accum=2 would be ignored" in err[0], err

    # a half-built pool froze pool.*: the pool's fit (a smaller Sinkhorn batch) is what a resume refuses, so it is
    # named as such and no command is given
    monkeypatch.setattr("sinkflow.tools.preflight.run_tiny", lambda *a: None)  # the plan is the point here
    run = _run_folder(tmp_path / "runs" / "r2", ["pool.batch_size=32768"], half_built_pool=True)
    report = preflight(str(run / "config.yaml"), gpu=("T4", 15360 * MiB), workdir=tmp_path / "w", run_dir=run)
    assert report.fit_overrides == [] and "pool.batch_size" in report.fit_reasons[-1], report.fit_reasons
    assert report.fit_reasons[-1].startswith("a resume cannot take this fit: cannot resume"), report.fit_reasons


def test_override_of_a_section_no_phase_reads(tmp_path):
    report = preflight("moons", ["train.nsf.lr=0.01"], workdir=tmp_path, memory=False)
    (phase, name, detail), = failed(report)
    # refused while resolving (config.check_read), naming the method and the one that reads the key
    assert name == "config resolves" and "train.nsf.lr" in detail and "method nsgf" in detail and "nsgfpp" in detail


def measured_train_step_bytes(model: torch.nn.Module, shape: tuple[int, ...], batch: int) -> int:
    """Parameters + the CPU peak of one Adam step (forward, MSE backward, step) at ``batch``, after a first step made
    Adam's moments: what the train-phase estimate models (weights+grads+adam, activations, backward transient,
    batch). Adam runs the Trainer's kernel (``adam_kernel``: fused, which adds no transient copies of the
    gradients)."""
    from sinkflow.engine.trainer import adam_kernel

    opt = torch.optim.Adam(model.parameters(), lr=1e-4, **adam_kernel(torch.device("cpu")))
    x, t, v = torch.randn(batch, *shape), torch.rand(batch), torch.randn(batch, *shape)
    model.train()

    def step():
        try:
            out = model(x, t)
        except TypeError:
            out = model(x)
        target = v if out.shape == v.shape else t
        loss = (out.float() - target).pow(2).mean()
        loss.backward()
        opt.step()
        del out, loss

    step()  # the first step creates Adam's moments; measure the steady state, as the GPU peak over a run is
    opt.zero_grad(set_to_none=True)
    held = memory_plan.weight_bytes(model)
    held += sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    return held + cpu_peak_bytes(step) + x.nbytes + t.nbytes + v.nbytes


def estimate_train_step(model: torch.nn.Module, shape: tuple[int, ...], batch: int) -> memory_plan.PhaseMemory:
    """The planner's training-phase terms for a bare ``model`` at ``batch`` (no EMA, no accumulation)."""
    from sinkflow.models import model_memory_bytes

    pm = memory_plan.PhaseMemory("t", "train")
    pm.terms["weights+grads+adam"] = model_memory_bytes(model, "adam")
    pm.act_fixed, pm.act_per_sample, pm.act_max_per_sample = memory_plan.measure_activations(model, shape)
    pm.batch_item_bytes = 4 * (3 * math.prod(shape) + 1)
    memory_plan.train_terms(pm, batch, 1)
    return pm


def test_memory_estimate_matches_measured_cpu_allocations():
    """Model + optimizer + activations of a training step, and the Sinkhorn pool step, against the torch
    profiler's CPU allocation peak: within 15% wherever the term is large enough to measure (> 8 MiB)."""
    from sinkflow.ot import sinkhorn_peak_bytes
    from sinkflow.ot.velocity import simulate_sinkhorn_flow

    cases = [("mlp", {}, (784,), 64), ("unet", {"channels": 16, "channel_mult": [1, 2]}, (1, 8, 8), 32),
             ("unet", {"channels": 32}, (1, 28, 28), 8), ("time_predictor", {}, (1, 28, 28), 16)]
    for kind, cfg, shape, batch in cases:
        torch.manual_seed(0)
        est = estimate_train_step(build_model(kind, cfg, shape), shape, batch).total
        torch.manual_seed(0)
        meas = measured_train_step_bytes(build_model(kind, cfg, shape), shape, batch)
        assert abs(est / meas - 1) <= 0.15, (kind, shape, est, meas)
    for B, n, D in [(1, 128, 3072), (2, 128, 784), (1, 512, 2)]:
        x, y = torch.randn(B, n, D), torch.randn(B, n, D) + 1
        meas = cpu_peak_bytes(lambda: simulate_sinkhorn_flow(x, y, steps=2, eta=0.1, blur=0.5, batched=True))
        meas += x.nbytes + y.nbytes
        est = sinkhorn_peak_bytes(B, n, D) + 2 * 2 * B * n * D * 4  # + the trajectory, as the pool estimate
        assert abs(est / meas - 1) <= 0.15, (B, n, D, est, meas)


def test_fit_proposes_a_config_that_fits_and_keeps_the_totals():
    cfg = config.resolve("moons", ["pool.batch_size=4096", "pool.batches=10", "train.velocity.batch_size=65536",
                                   "model.velocity.hidden=2048"])
    mems = memory_plan.estimate(cfg)
    card = 2 * memory_plan.GiB  # a tiny card: both the pool and the training step are too large
    assert not all(memory_plan.fits(m, card) for m in mems if m.terms)
    overrides, reasons = memory_plan.propose_fit(cfg, mems, card)
    new = apply_fit(cfg, overrides)
    assert new["pool"]["batches"] * new["pool"]["batch_size"] == 10 * 4096
    assert new["train"]["velocity"]["batch_size"] == 65536 and new["train"]["velocity"]["accum"] > 1
    assert all(memory_plan.fits(m, card) for m in memory_plan.estimate(new) if m.terms), reasons
    assert math.isclose(memory_plan.gpu_bytes("t4")[1], 15360 * 2**20)
    with pytest.raises(Exception):
        memory_plan.gpu_bytes("V100")


def test_the_plan_follows_auto_precision_on_the_card_planned_for():
    """`auto` trains a UNet in fp16 on an Ampere-or-newer card (bf16 tensor cores) and in fp32 on a T4: the planner
    estimates what will run there (a T4 plan with half-precision activations would promise a fit the run then
    loses to an OOM); a bare memory size plans for fp32, the larger."""
    assert memory_plan.card_bf16("H100-80GB") and memory_plan.card_bf16("L4")
    assert not memory_plan.card_bf16("T4") and not memory_plan.card_bf16("16 GiB") and not memory_plan.card_bf16(None)
    cfg = config.resolve("digits", [])  # embedded: a UNet phase with auto precision
    unet = [k for k, m in cfg["model"].items() if m.get("kind") == "unet" and k in cfg["train"]][0]
    assert cfg["train"][unet]["precision"] == "auto"
    on = {m.phase: m for m in memory_plan.estimate(cfg, bf16=True)}
    off = {m.phase: m for m in memory_plan.estimate(cfg, bf16=False)}
    assert "fp16" in on[unet].note and "fp32" in off[unet].note
    assert off[unet].terms["activations"] > on[unet].terms["activations"]


def test_the_plan_counts_every_batch_the_cuda_defaults_hold():
    """On CUDA `auto` draws two batches ahead, a UNet phase's captured step reads a static copy of its batch and the
    learning check holds its probe batch for the whole phase: five batches on the device, not one; with
    prefetch=never and graph=none, two; a phase too short to be checked (< learning.MIN_STEPS steps) one; the time
    predictor, which keeps its own check, holds no probe batch."""
    from sinkflow.engine import learning

    cfg = config.resolve("digits", [])
    unet = [k for k, m in cfg["model"].items() if m.get("kind") == "unet" and k in cfg["train"]][0]
    assert cfg["train"][unet]["iters"] >= learning.MIN_STEPS
    plain = config.apply_overrides(cfg, [f"train.{unet}.prefetch=never", f"train.{unet}.graph=none"])
    short = config.apply_overrides(plain, [f"train.{unet}.iters={learning.MIN_STEPS - 1}"])
    auto = {m.phase: m for m in memory_plan.estimate(cfg, bf16=True)}[unet]
    two = {m.phase: m for m in memory_plan.estimate(plain, bf16=True)}[unet]
    one = {m.phase: m for m in memory_plan.estimate(short, bf16=True)}[unet]
    assert (auto.batch_copies, two.batch_copies, one.batch_copies) == (5, 2, 1) and "5 batches held" in auto.note
    assert auto.terms["batch"] == 5 * one.terms["batch"] > 0
    time = {m.phase: m for m in memory_plan.estimate(config.resolve("digits", ["train.time.prefetch=never",
                                                                                "train.time.graph=none"]))}["time"]
    assert time.batch_copies == 1


def test_the_plan_holds_the_velocity_network_where_the_straight_flow_starts_at_its_states():
    """nsgf.nsf_source=velocity: the straight-flow and predictor phases keep the velocity network on the device
    (it made their paths' starts), so their plan counts its weights; the paper's paths from noise do not."""
    cfg = config.resolve("digits", ["nsgf.nsf_source=velocity", "nsgf.nsf_t_min=0"])
    paper = {m.phase: m for m in memory_plan.estimate(config.resolve("digits", []))}
    states = {m.phase: m for m in memory_plan.estimate(cfg)}
    m = dict(cfg["model"]["velocity"])
    weights = sum(p.numel() * p.element_size() for p in build_model(m.pop("kind"), m, (1, 8, 8)).parameters())
    for phase in ("nsf", "time"):
        assert states[phase].terms["frozen velocity network"] == weights > 0
        assert states[phase].total == paper[phase].total + weights
        assert "frozen velocity network" not in paper[phase].terms
    assert "frozen velocity network" not in states["velocity"].terms


def test_the_per_process_estimate_and_fit_do_not_shrink_with_world():
    """`train.<phase>.batch_size` is per process (every rank trains its own batch_size rows, Trainer._fit_training):
    a run on 4 GPUs needs as much memory per GPU as one on 1 GPU, and --fit gives the same advice. The plan used to
    divide the batch by --world and call a card that runs out of memory a fit."""
    cfg = config.resolve("moons", ["train.velocity.batch_size=65536", "model.velocity.hidden=2048"])
    one, four = ({m.phase: m for m in memory_plan.estimate(cfg, world=w)} for w in (1, 4))
    # ... but for one more copy of the gradients: DDP's buckets, or the flat buffer a captured step all-reduces
    grads = sum(p.numel() * 4 for p in build_model("mlp", {k: v for k, v in cfg["model"]["velocity"].items()
                                                           if k != "kind"}, (2,)).parameters())
    assert four["velocity"].terms.pop("all-reduce buffer") == grads > 0
    assert one["velocity"].terms == four["velocity"].terms and "micro-batch 65536," in four["velocity"].note
    card = 2 * memory_plan.GiB
    fit_one = memory_plan.propose_fit(cfg, list(one.values()), card, world=1)
    fit_four = memory_plan.propose_fit(cfg, list(four.values()), card, world=4)
    assert fit_four[0] == fit_one[0]  # the same overrides; the reason also names the batch over all processes
    assert [r.replace(" per process, 262144 over 4 processes)", ")") for r in fit_four[1]] == fit_one[1]
    assert any(r.startswith("velocity: micro-batch 65536 -> ") for r in fit_four[1]), fit_four


def test_out_of_memory_advice_doubles_accum_and_keeps_the_batch():
    """`accum` splits `batch_size` into micro-batches (Trainer._update): the fix is to double accum alone. The line
    used to say to halve batch_size as well, which halves the batch the run trains on."""
    import re

    from sinkflow.tools.oom import oom_line

    exc = torch.OutOfMemoryError("CUDA out of memory")
    exc.sinkflow_where = {"phase": "velocity", "step": 5, "training": True}
    line = oom_line(exc, "train", None, "moons")
    assert "double train.velocity.accum" in line and "train.velocity.batch_size stays the batch" in line, line
    assert not re.search(r"halve\S* train\.velocity\.batch_size", line), line


@pytest.mark.parametrize("argv, needle", [
    (["--gpu-mem", "nan"], "--gpu-mem must be a positive number of GiB, got nan"),
    (["--gpu-mem", "inf"], "--gpu-mem must be a positive number of GiB, got inf"),
    (["--gpu-mem", "0"], "--gpu-mem must be a positive number of GiB, got 0"),
    (["--gpu-mem", "-3"], "--gpu-mem must be a positive number of GiB, got -3"),
    (["--world", "0"], "--world must be >= 1, got 0"),
    (["--world", "-2"], "--world must be >= 1, got -2"),
    (["--gpu", "T4", "--fit", "--no-memory"], "--gpu / --fit act on the memory estimate, which --no-memory skips"),
    (["--all"], "--all checks every preset, so the preset 'moons' beside it would be ignored"),  # both were ignored
])
def test_bad_preflight_arguments_are_one_line_before_any_work(capsys, monkeypatch, argv, needle):
    """A NaN card size used to end in a traceback, --gpu-mem 0 was ignored in silence, a negative one gave absurd
    advice, and --world 0 ran every phase (~22 s) before failing with ZeroDivisionError: each is now one line and
    exit status 2, before the preflight starts."""
    from sinkflow.cli import main

    def ran(*a, **k):
        raise AssertionError("the preflight ran")

    monkeypatch.setattr("sinkflow.tools.preflight.preflight", ran)
    assert main(["preflight", "moons", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sinkflow: error: ") and needle in err[0], err


# ---- --fit proposes only what works (each of these failed before 2026-11-28) ---------------------

MiB = 2**20


def card_for(limit_bytes: int) -> int:
    """A card whose usable memory (90% of it minus 1 GiB) is ``limit_bytes``."""
    return math.ceil(memory_plan.CONTEXT_BYTES + limit_bytes / memory_plan.FRAGMENTATION) + 1


def test_pool_fit_picks_float16_or_disk_from_the_proposed_pools_bytes():
    """float16 halves x and v, not the float32 t of every entry: a 2D pool of 732 MiB becomes 439.5 MiB, still over
    pool.ram_gb=0.4, so the fit goes to disk (it proposed float16, which `sinkflow train` then refused)."""
    from sinkflow.methods.pool import pool_bytes

    t4 = memory_plan.gpu_bytes("T4")[1]
    for ram, want in [("0.4", "pool.storage=disk"), ("0.5", "pool.dtype=float16")]:
        cfg = config.resolve("moons", ["pool.batches=30000", f"pool.ram_gb={ram}"])
        mems = memory_plan.estimate(cfg)
        assert memory_plan.over_budget(cfg, mems, t4) == ["pool RAM"]
        overrides, reasons = memory_plan.propose_fit(cfg, mems, t4)
        assert overrides == [want], reasons
        new = apply_fit(cfg, overrides)
        assert memory_plan.over_budget(new, memory_plan.estimate(new), t4) == []
        if new["pool"]["storage"] == "memory":
            assert pool_bytes(new["pool"], (2,)) <= float(ram) * 2**30


@pytest.mark.parametrize("disk, want, verdict_after", [
    ("1.0", [], []),  # 732 MiB float32 on disk fits: exact, as before
    ("0.5", ["pool.dtype=float16"], []),  # 439.5 MiB in float16 fits where float32 does not
    ("0.4", [], ["pool disk"]),  # not even float16: said, and the verdict stays "too large"
])
def test_pool_on_disk_is_checked_against_pool_disk_gb(disk, want, verdict_after):
    """A pool sent to disk stayed float32 whatever pool.disk_gb said, and the verdict did not check the disk: preflight
    passed a pool that `sinkflow train` refused ("needs 732 MiB of disk but pool.disk_gb=0.5")."""
    t4 = memory_plan.gpu_bytes("T4")[1]
    cfg = config.resolve("moons", ["pool.batches=30000", "pool.storage=disk", f"pool.disk_gb={disk}"])
    mems = memory_plan.estimate(cfg)
    assert memory_plan.over_budget(cfg, mems, t4) == ([] if disk == "1.0" else ["pool disk"])
    overrides, reasons = memory_plan.propose_fit(cfg, mems, t4)
    assert overrides == want, reasons
    if disk == "0.4":
        assert reasons == ["pool: does not fit pool.disk_gb=0.4 on disk even in float16 (439.5 MiB); use fewer "
                           "pool.batches or a larger pool.disk_gb"]
    new = apply_fit(cfg, overrides)
    assert memory_plan.over_budget(new, memory_plan.estimate(new), t4) == verdict_after


def test_pool_sent_to_disk_by_the_fit_is_float16_only_where_float32_does_not_fit_the_disk():
    t4 = memory_plan.gpu_bytes("T4")[1]
    for disk, want in [("1.0", ["pool.storage=disk"]), ("0.5", ["pool.storage=disk", "pool.dtype=float16"])]:
        cfg = config.resolve("moons", ["pool.batches=30000", "pool.ram_gb=0.4", f"pool.disk_gb={disk}"])
        overrides, reasons = memory_plan.propose_fit(cfg, memory_plan.estimate(cfg), t4)
        assert overrides == want, reasons
        new = apply_fit(cfg, overrides)
        assert memory_plan.over_budget(new, memory_plan.estimate(new), t4) == []


def test_the_verdict_after_fit_checks_the_pool_ram_too(capsys, monkeypatch):
    """`preflight --fit` re-checked only the GPU after applying the fit: a fit that left the pool over pool.ram_gb
    printed an all-ok table and exit 0. The post-fit verdict is the pre-fit one (memory_plan.over_budget)."""
    from sinkflow.cli import main
    from sinkflow.tools.preflight import Report

    over = ["pool.batches=30000", "pool.ram_gb=0.4"]

    def fake(preset, overrides, shorthands, gpu=None, world=1, memory=True, run_dir=None):
        report = Report(preset)
        report.memory = memory_plan.estimate(config.resolve(preset, overrides, shorthands))
        report.add("fits T4", "all", False, "too large: pool RAM")
        report.fit_overrides, report.fit_reasons = ["pool.dtype=float16"], ["pool: float16 (not enough)"]
        return report

    monkeypatch.setattr("sinkflow.tools.preflight.preflight", fake)
    assert main(["preflight", "moons", *over, "--gpu", "T4", "--fit"]) == 1
    assert "FAIL  fits T4 with --fit applied: too large: pool RAM" in capsys.readouterr().out


def test_sample_fit_scales_the_chunk_the_estimate_used():
    """The estimate samples in chunks of min(eval.n, sample.batch_size): with eval.n=50 the fit used to shrink
    sample.batch_size=500 to a value still above 50, which changes nothing. The transient is planted larger (still
    linear in the chunk) so the phase is larger than the workspaces every card must hold."""
    cfg = config.resolve("digits", ["eval.n=50", "eval.class_n=50"])  # digits' classifier draws 3,590 otherwise
    sample = memory_plan.estimate(cfg)[-1]
    assert sample.phase == "sample+eval" and "sample.batch_size=50 " in sample.note
    sample.terms["forward transient"] = 50 * 4 * MiB  # 4 MiB a sample
    assert sample.terms["cuda workspaces"] == memory_plan.WORKSPACE_BYTES  # sampling holds them too
    weights = sample.terms["weights"] + sample.terms["cuda workspaces"]  # what a smaller chunk does not shrink
    per_sample = (sample.total - weights) / 50
    card = card_for(weights + (sample.total - weights) // 2)
    overrides, reasons = memory_plan.propose_fit(cfg, [sample], card)
    (key, value), = (o.split("=") for o in overrides)
    assert key == "sample.batch_size" and int(value) == 25, (overrides, reasons)
    assert weights + int(value) * per_sample <= memory_plan.usable_bytes(card) < weights + 26 * per_sample
    assert "chunks of 50 needs" in reasons[0]


def _train(name, overrides, phase, bf16=False):
    cfg = config.resolve(name, overrides)
    return cfg, {m.phase: m for m in memory_plan.estimate(cfg, bf16=bf16)}[phase]


def test_fit_proposes_no_half_precision_that_cannot_help_or_cannot_run():
    """bf16 was proposed whenever micro-batch 1 did not fit: for weights + Adam state (which it cannot shrink), on a
    T4 (no bf16 tensor cores) and for a flow in invertible mode (which refuses it). Now such a phase is said not to
    fit, naming what dominates."""
    cfg, mlp = _train("moons", ["model.velocity.hidden=2048"], "velocity")
    low = memory_plan._at(mlp, 256, 256)  # micro-batch 1
    for bf16 in (False, True):
        overrides, reasons = memory_plan.propose_fit(cfg, [mlp], card_for(low - MiB), bf16=bf16, card="T4")
        assert overrides == [], overrides
        (line,) = reasons
        assert line.startswith("velocity: does not fit T4 at any micro-batch") and "weights+grads+adam 128.25 MiB" in line
    cfg, flow = _train("flow-digits", ["model.flow.memory=invertible"], "flow", bf16=True)
    b = cfg["train"]["flow"]["batch_size"]
    overrides, reasons = memory_plan.propose_fit(cfg, [flow], card_for(memory_plan._at(flow, b, b) - 2**14), bf16=True)
    assert overrides == [] and "does not fit" in reasons[0], (overrides, reasons)
    assert memory_plan.half_precision(cfg, "flow", "flow", True)[0] is None


def test_fit_proposes_the_half_precision_the_card_and_network_can_take():
    """Where activations are most of a phase at micro-batch 1 (here a planted fixed activation term): bf16 on a card
    with bf16 tensor cores, fp16 for a UNet on one without, nothing for an MLP there."""
    for name, phase, bf16, want in [("digits", "velocity", False, "fp16"), ("digits", "velocity", True, None),
                                    ("moons", "velocity", False, None), ("moons", "velocity", True, "bf16")]:
        cfg, pm = _train(name, [f"train.{phase}.precision=fp32"], phase, bf16=bf16)
        pm.act_fixed = 400 * MiB
        b = cfg["train"][phase]["batch_size"]
        memory_plan.train_terms(pm, b, 1)
        overrides, reasons = memory_plan.propose_fit(cfg, [pm], card_for(memory_plan._at(pm, b, b) - 100 * MiB),
                                                     bf16=bf16)
        got = [o for o in overrides if ".precision=" in o]
        if name == "digits" and bf16:
            want = "bf16"
        assert got == ([f"train.{phase}.precision={want}"] if want else []), (name, bf16, overrides, reasons)


def test_fit_accum_is_the_smallest_divisor_of_an_odd_batch_that_fits():
    """Accum used to double only while it divided the batch: an odd batch got no accumulation at all."""
    cfg, pm = _train("moons", ["model.velocity.hidden=2048", "train.velocity.batch_size=375"], "velocity")
    card = card_for(memory_plan._at(pm, 375, 3))
    assert not memory_plan.fits(pm, card) and memory_plan._at(pm, 375, 1) > memory_plan._at(pm, 375, 3)
    overrides, reasons = memory_plan.propose_fit(cfg, [pm], card)
    assert overrides == ["train.velocity.accum=3"], reasons
    assert reasons == ["velocity: micro-batch 375 -> 125 with accum=3 (same effective batch 375)"]
    new = apply_fit(cfg, overrides)  # validate: accum divides the batch
    assert memory_plan.fits({m.phase: m for m in memory_plan.estimate(new)}["velocity"], card)
    _, reasons = memory_plan.propose_fit(cfg, [pm], card, world=4)  # batch_size is per process under torchrun
    assert reasons == ["velocity: micro-batch 375 -> 125 with accum=3 (same effective batch 375 per process, 1500 "
                       "over 4 processes)"]


def test_fit_on_a_card_smaller_than_the_fixed_terms_says_so():
    """At --gpu-mem 1.05 the 64 MiB of workspaces alone exceed the usable memory: the fit used to shrink every batch
    to its minimum (pool.batch_size=2, accum=256, bf16 for a 2D MLP)."""
    cfg = config.resolve("moons", [])
    label, total = memory_plan.gpu_bytes(gib=1.05)
    overrides, reasons = memory_plan.propose_fit(cfg, memory_plan.estimate(cfg), total, card=label)
    assert overrides == [] and len(reasons) == 1 and "too small for any batch" in reasons[0], reasons


def test_fit_command_quotes_every_argument():
    import shlex

    from sinkflow.tools.preflight import fit_command

    overrides = ["data.target=/tmp/my pts.npy", "model.velocity.dims=[64, 64]", "pool.batches=3"]
    cmd = fit_command("moons", overrides, {"train_iters": 5, "lr": None}, ["pool.batches=6"])
    assert shlex.split(cmd) == ["sinkflow", "train", "moons", "data.target=/tmp/my pts.npy",
                                "model.velocity.dims=[64, 64]", "pool.batches=6", "--train-iters", "5"]


def test_the_sampling_estimate_does_not_depend_on_the_training_autocast(tmp_path, monkeypatch):
    """The mnist sampling transient was half as large when planned for an H100 (143.55 MiB) as for a T4 (287.11):
    it reused activations measured under the training phases' fp16 autocast, while sampling ran fp32. Sampled in
    fp32 (set), the two plans agree; under ``sample.precision: auto`` (fp16 on the H100, fp32 on the T4) the H100's
    is half the T4's, as the sampler runs."""
    from sinkflow import config
    from sinkflow.tools import memory_plan

    monkeypatch.chdir(tmp_path)  # synthetic mnist images of the real shape
    for precision, h100_share in (("fp32", 1), ("auto", 0.5)):
        cfg = config.resolve("mnist", ["eval.n=64", f"sample.precision={precision}"])
        plans = {bf16: next(m for m in memory_plan.estimate(cfg, bf16=bf16) if m.phase == "sample+eval")
                 for bf16 in (False, True)}
        assert plans[True].terms["forward transient"] == h100_share * plans[False].terms["forward transient"] > 0
    trained_half = [m for m in memory_plan.estimate(cfg, bf16=True) if m.kind == "train" and m.precision == "fp16"]
    assert trained_half  # the Ampere plan did train the UNet phases in fp16 (the case the bug was in)


def test_preflight_refuses_what_train_refuses_before_its_folder_exists(tmp_path):
    """preflight passed `moons data.target=pts.npy data.test_rows=50` (eval.n 1,024 > 50 held-out rows), which
    `sinkflow train` refuses at once: it did not run train's own up-front checks (check_run)."""
    from sinkflow.tools.preflight import preflight

    np.save(tmp_path / "pts.npy", np.random.default_rng(0).normal(size=(300, 2)).astype(np.float32))
    report = preflight("moons", [f"data.target={tmp_path / 'pts.npy'}", "data.test_rows=50"], memory=False)
    failed = [c for c in report.checks if c.ok is False]
    assert [c.name for c in failed] == ["phases build"] and "holds out only data.test_rows=50" in failed[0].detail


@pytest.mark.parametrize("case, needle", [("corrupt", "is corrupt or truncated"), ("one image", "only 1 image"),
                                           ("mixed sizes", "have different sizes"), ("empty", "holds no images"),
                                           ("cifar partial", "missing data_batch_3")])
def test_data_that_is_here_but_cannot_serve_the_run_fails_preflight(tmp_path, case, needle):
    """Any data error made preflight (and doctor) swap in synthetic images and pass, 33 of 33, on data `sinkflow
    train` refuses: a corrupt image, one image, mixed sizes, a partial CIFAR-10 copy. Only data not on this machine
    (no such folder, no data set's folder: a CPU box before the GPU run) is replaced."""
    from PIL import Image

    from test_data import make_cifar
    from sinkflow.tools.data import needs_synthetic

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(1 if case == "one image" else 4):
        pixels = np.random.default_rng(i).integers(0, 256, (8, 8 + i * (case == "mixed sizes"), 3), np.uint8)
        Image.fromarray(pixels).save(imgs / f"{i}.png")
    if case == "corrupt":  # its header reads, its pixels are cut short
        (imgs / "2.png").write_bytes((imgs / "2.png").read_bytes()[:150])
    if case == "empty":
        for p in imgs.iterdir():
            p.unlink()
    args = ("folder", [f"data.path={imgs}", f"data.root={tmp_path / 'data'}", "data.image_size=null"])
    if case == "cifar partial":
        make_cifar(tmp_path / "data")
        (tmp_path / "data" / "cifar-10-batches-py" / "data_batch_3").unlink()
        args = ("cifar10", [f"data.root={tmp_path / 'data'}", "data.download=false"])
    if case != "corrupt":  # a corrupt image is found while decoding, the others before
        with pytest.raises(SinkflowError, match=needle):
            needs_synthetic(config.resolve(*args))
    report = preflight(*args, workdir=tmp_path / "w", memory=False)
    (bad,) = [c for c in report.checks if c.ok is False]
    assert bad.name == "data reads" and needle in bad.detail and report.data_note is None
    # not on this machine: synthetic images of the real shape, the reason named
    assert "does not exist" in needs_synthetic(config.resolve("folder", [f"data.path={tmp_path / 'nowhere'}"]))
    assert "CIFAR-10 not found" in needs_synthetic(config.resolve("cifar10", [f"data.root={tmp_path / 'none'}"]))


def test_a_disk_too_small_for_the_pool_is_its_own_check_and_the_rest_still_runs(tmp_path, monkeypatch, capsys):
    """The free disk is the machine's, not the config's: preflight names it ("this machine") and still runs every
    other check (planning on a laptop for a rented GPU); `sinkflow train` refuses it before its folder exists."""
    from collections import namedtuple

    from sinkflow.cli import main
    from sinkflow.methods import pool

    real = config.resolve("moons", [f"experiment.runs_dir={tmp_path / 'runs'}"])
    need = pool.pool_bytes(real["pool"], (2,))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(need, need // 2, need // 2))
    report = preflight("moons", [f"experiment.runs_dir={tmp_path / 'runs'}"], workdir=tmp_path / "work", memory=False)
    failed = [c for c in report.checks if c.ok is False]
    assert [c.name for c in failed] == ["this machine"], format_report(report)
    assert "of disk but the disk has only" in failed[0].detail and "train here would refuse" in failed[0].detail
    assert {"kill and resume", "sample", "evaluate + plots"} <= {c.name for c in report.checks if c.ok}
    assert main(["train", "moons", f"experiment.runs_dir={tmp_path / 'runs'}"]) != 0
    assert "of disk but the disk has only" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("memory", ["standard", "checkpoint", "invertible"])
def test_flow_plan_covers_the_measured_peak_of_a_step_in_every_memory_mode(memory):
    """A flow in checkpoint/invertible mode keeps almost nothing through its forward; its peak is backward re-running
    a segment / a layer with grad. The plan left that out (0.37-0.81x of the H100's measured peak). Here the plan's
    activation terms against torch's MemTracker (live tensors of one real step on CPU, per sample from two batch
    sizes): from 0.9x to 1.6x of it (0.97 / 1.2-1.3 / 0.99-1.07 measured; without the recompute term, invertible was
    0.22x)."""
    tracker = pytest.importorskip("torch.distributed._tools.mem_tracker", reason="torch's MemTracker is torch >= 2.5")
    MemTracker, _MemRefType = tracker.MemTracker, tracker._MemRefType

    from sinkflow.flows.losses import flow_loss
    from sinkflow.models import build_model

    cfg = config.resolve("flow-cifar10", [f"model.flow.memory={memory}", "model.flow.depth_per_level=3",
                                          "model.flow.hidden_channels=32", "model.flow.levels=2",
                                          "data.image_size=16", "train.flow.batch_size=32"])
    shape = (3, 16, 16)
    torch.manual_seed(0)
    mcfg = dict(cfg["model"]["flow"])
    model = build_model(mcfg.pop("kind"), mcfg, shape)
    peaks = []
    for n in (8, 16):
        x = torch.rand(n, *shape)
        flow_loss(model, x)[0].backward()  # gradients allocated: the peak below is the step's own
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            flow_loss(model, x)[0].backward()
        snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        peaks.append(snap[_MemRefType.ACT] + snap[_MemRefType.TEMP])
    measured = (peaks[1] - peaks[0]) / 8 * 32
    terms = next(m for m in memory_plan.estimate(cfg) if m.kind == "train").terms
    planned = terms["activations"] + terms["backward transient"] + terms.get("backward recompute", 0)
    assert 0.9 * measured <= planned <= 1.6 * measured, (memory, planned / measured, terms)


def test_bf16_asked_for_a_card_without_bf16_tensor_cores_is_named():
    """`preflight digits --gpu T4 train.velocity.precision=bf16` planned bf16's halved activations and said nothing
    of a T4 having no bf16 tensor cores (what bf16 is chosen for); bf16 sampling is named the same way; an Ampere-on
    card, fp16 or auto pass silently."""
    from sinkflow.tools.preflight import Report, bf16_check

    named = {"train.velocity.precision=bf16": "train.velocity.precision=bf16: a T4 has no bf16 tensor cores",
             "sample.precision=bf16": "sample.precision=bf16: a T4 has no bf16 tensor cores"}
    for card, overrides, failed in [("T4", ["train.velocity.precision=bf16"], ["precision on T4"]),
                                    ("T4", ["sample.precision=bf16"], ["precision on T4"]),
                                    ("L4", ["train.velocity.precision=bf16", "sample.precision=bf16"], []),
                                    ("T4", ["train.velocity.precision=fp16", "sample.precision=fp16"], []),
                                    ("T4", [], [])]:
        report = Report("digits")
        bf16_check(report, config.resolve("digits", overrides), card)
        assert [c.name for c in report.checks if c.ok is False] == failed, (card, overrides)
        assert all(named[overrides[0]] in c.detail and "use fp16" in c.detail for c in report.checks)


def test_a_preflight_stopped_by_sigterm_removes_its_scratch_run(tmp_path):
    """`timeout 60 sinkflow preflight ...` killed it where it stood and left /tmp/sinkflow-preflight-*: outside
    training a SIGTERM now unwinds as Ctrl+C does, in one line, exit status 143."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1", "SINKFLOW_PROGRESS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "sinkflow", "preflight", "moons", "--no-memory"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(3000):  # up to 60 s for torch to load and the scratch run to be made
            if list(tmp_path.glob("sinkflow-preflight-*")) or proc.poll() is not None:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()
        # at once: the handler is in place before the scratch run is made, and moons' whole preflight takes 2-3 s
        # (a half-second pause here had let a quiet machine's preflight finish first: exit status 0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, (out[-2000:], err[-2000:])  # a failed report: stdout says why
    assert err.strip().splitlines()[-1] == "sinkflow: preflight stopped by signal 15" and "Traceback" not in err
    assert not list(tmp_path.glob("sinkflow-preflight-*"))  # removed on the way out


def test_fid_settings_this_machine_lacks_are_the_machine_checks_failure(tmp_path, monkeypatch):
    """`sinkflow train` refuses, before any work, an eval.inception_weights that is not a file here or FID's packages
    missing; preflight's "this machine" check looked at the free disk alone and passed both, planning a run that
    train then refused."""
    import importlib.machinery
    import sys
    import types

    from sinkflow import data
    from sinkflow.tools.preflight import Report, machine_check

    real = config.resolve("digits", [f"experiment.runs_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}",
                                     f"eval.inception_weights={tmp_path / 'w.pth'}"])
    shape = data.sample_shape(real)
    for missing in ("weights", "packages"):
        if missing == "packages":
            (tmp_path / "w.pth").write_bytes(b"weights")
            monkeypatch.setitem(sys.modules, "torch_fidelity", None)
        report = Report("digits")
        machine_check(report, real, shape)
        [check] = report.checks
        assert check.name == "this machine" and check.ok is False, (missing, check)
        assert ("is not a file" if missing == "weights" else "FID needs") in check.detail, check.detail
    for name in ("torchmetrics", "torch_fidelity"):  # installed, as far as find_spec can tell
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    for weights, said in ((tmp_path / "w.pth", "; FID's weights and packages here"), (None, "")):
        report = Report("digits")
        machine_check(report, {**real, "eval": {**real["eval"], "inception_weights": weights}}, shape)
        assert report.checks[0].ok and report.checks[0].detail.endswith(f"{tmp_path / 'runs'}{said}"), report.checks


def test_kill_and_resume_passes_with_batches_drawn_ahead(tmp_path):
    """``prefetch: always`` draws the next batches while a step runs, so the stopped phase's generator is past them;
    the check compares the resume point (before the first batch not trained on), which the checkpoint holds. It
    compared the generator itself and failed every such preflight with "phase generator not restored"."""
    report = preflight("moons", ["train.velocity.prefetch=always"], {"method": "fm"}, workdir=tmp_path, memory=False)
    assert not failed(report), format_report(report)
    assert any(c.name == "kill and resume" and c.ok for c in report.checks)


def test_a_phase_trained_in_fp32_and_sampled_in_half_plans_its_transient_measured_in_half(tmp_path, monkeypatch):
    """cifar10 on a T4 with sample.precision=fp16 (its tensor cores; the UNets train fp32 there under auto): the sample
    row reused the fp32-measured activations as they were; halving them (an earlier fix) under-planned, since autocast
    leaves the UNet's largest tensor per sample at 0.75x fp32's. Such a phase is measured again under the sampler's
    autocast, the smaller of the two kept (the half measure also counts the weights' half copies: 9x fp32's for
    digits' time predictor), and --fit's sample.batch_size follows."""
    monkeypatch.chdir(tmp_path)
    cfg = config.resolve("cifar10", ["eval.n=64", "sample.precision=fp16"])
    mems = memory_plan.estimate(cfg, bf16=memory_plan.card_bf16("T4"))
    assert {m.precision for m in mems if m.kind == "train"} == {"fp32"}
    shape, bigs = (3, 32, 32), []
    for key in ("velocity", "nsf", "time"):
        m = dict(cfg["model"][key])
        model = build_model(m.pop("kind"), m, shape)
        bigs.append(min(memory_plan.measure_activations(model, shape)[2],
                        memory_plan.measure_activations(model, shape, "fp16")[2]))
    trained = max(m.act_max_per_sample for m in mems if m.kind == "train")
    assert trained / 2 < max(bigs) < trained and mems[-1].terms["forward transient"] == 2 * 64 * max(bigs)


def test_the_sample_row_says_the_precision_the_sampler_runs_in_on_the_planned_card(tmp_path, monkeypatch):
    """Each training row named its precision on the planned card (`micro-batch 128, fp16, ...`); the sample row, whose
    transient halves under sample.precision=auto's fp16 on an A100, did not: it names it as the sampler resolves it
    (`Method.sample_precision`), and a flow (which reads no sample.precision) plain fp32."""
    monkeypatch.chdir(tmp_path)
    for preset, over, card, says in (("mnist", [], "T4", "fp32 (sample.precision=auto)"),
                                     ("mnist", [], "A100-40GB", "fp16 (sample.precision=auto)"),
                                     ("mnist", ["sample.precision=bf16"], "T4", "sample.precision=bf16"),
                                     ("mnist", ["train.velocity.precision=fp32"], "H100-80GB",
                                      "fp32 (sample.precision=auto)"),
                                     ("moons", [], "H200", "fp32 (sample.precision=auto)")):
        cfg = config.resolve(preset, ["eval.n=64", *over])
        bf16 = memory_plan.card_bf16(card)
        sample = memory_plan.estimate(cfg, bf16=bf16)[-1]
        assert f"samples, {says};" in sample.note, (preset, over, card, sample.note)
        assert sample.precision == methods.of(cfg).sample_precision(cfg, "cuda", bf16=bf16)
    flow = config.resolve("flow-digits", ["eval.n=64"])
    assert "samples, fp32;" in memory_plan.estimate(flow, bf16=True)[-1].note


def test_a_proposed_training_precision_says_the_sampler_follows_it(tmp_path, monkeypatch):
    """`--fit` on a card without bf16 tensor cores proposed train.velocity.precision=fp16 for a UNet whose micro-batch 1
    did not fit in fp32, saying only that it halves the activations; sample.precision: auto follows a set training
    precision on a CUDA card, so the samples every metric scores moved from fp32 to fp16 in silence. The reason says
    so, with the key that keeps them; a phase the sampler does not follow (nsf) says nothing of it."""
    monkeypatch.chdir(tmp_path)
    cfg = config.resolve("mnist", ["eval.n=64"])
    mems = memory_plan.estimate(cfg, bf16=False)
    for phase, says in (("velocity", True), ("nsf", False)):
        pm = next(m for m in mems if m.phase == phase)
        b = cfg["train"][phase]["batch_size"]
        card = card_for((memory_plan._at(pm, b, b) + memory_plan._at(pm, b, b, 0.5)) // 2)
        overrides, reasons = memory_plan.propose_fit(cfg, [pm], card, bf16=False, card="card")
        assert f"train.{phase}.precision=fp16" in overrides, (overrides, reasons)
        follows = "the samples would be drawn in fp16, not fp32 (add sample.precision=fp32 to keep them)"
        assert (follows in " ".join(reasons)) == says, reasons
        fixed = apply_fit(cfg, [*overrides, *(["sample.precision=fp32"] if says else [])])
        assert methods.of(fixed).sample_precision(fixed, "cuda", bf16=False) == "fp32"


def test_the_table_header_says_which_card_the_precisions_were_planned_for(capsys, monkeypatch):
    """`sinkflow preflight mnist` (no --gpu) printed every card's column from a plan in fp32 (auto without bf16 tensor
    cores) while its rows said `fp32`: nothing told that the A100/H100 columns' run would train and sample the UNet in
    fp16. The header names the basis: the named card's own precisions, or none named and what that assumes."""
    from sinkflow.cli import main
    from sinkflow.tools.preflight import Report

    def fake(preset, overrides, shorthands, gpu=None, world=1, memory=True, run_dir=None):
        report = Report(preset)
        report.memory = [memory_plan.PhaseMemory("velocity", "train", {"weights": 1}, note="fp32")]
        return report

    monkeypatch.setattr("sinkflow.tools.preflight.preflight", fake)
    for flags, says in (([], "planned for no card: each phase and the sampler in the precision auto takes without bf16 "
                             "tensor cores (fp32 for a UNet)"),
                        (["--gpu", "A100-40GB"],
                         "each phase and the sampler in the precision they take on the A100-40GB"),
                        (["--gpu-mem", "24"], "planned for a card without bf16 tensor cores")):
        main(["preflight", "moons", *flags])
        assert says in capsys.readouterr().out, flags


def test_bf16_sampling_on_a_t4_names_the_sampler_s_own_fix():
    """`preflight digits --gpu T4 sample.precision=bf16` answered "use fp16 (its tensor cores; training scales the
    loss) or fp32 (a training phase's precision=auto is fp32 on this card)": a training key's fix for the sampler's,
    and beside train.velocity.precision=fp16 (the key a T4 user is told) sample.precision=auto is fp16 there, not
    fp32. The sampler's key gets its own: fp16 or auto, with what auto becomes on the card."""
    from sinkflow.tools.preflight import Report, bf16_check

    for overrides, says, not_said in (
            (["sample.precision=bf16"], "for sample.precision, use fp16 (its tensor cores) or auto (fp32 here)",
             "training scales the loss"),
            (["sample.precision=bf16", "train.velocity.precision=fp16"],
             "for sample.precision, use fp16 (its tensor cores) or auto (fp16 here)", "training scales the loss"),
            # auto keeps a set bf16 only on a card with bf16 tensor cores (since 6358662): fp32 on a T4, so auto is
            # a fix there too (it read "or fp32" while auto followed the training phase's bf16)
            (["sample.precision=bf16", "train.velocity.precision=bf16"],
             "training scales the loss) or fp32 (a training phase's precision=auto is fp32 on this card); for "
             "sample.precision, use fp16 (its tensor cores) or auto (fp32 here)", "auto (bf16")):
        report = Report("digits")
        bf16_check(report, config.resolve("digits", overrides), "T4")
        (check,) = report.checks
        assert says in check.detail and not_said not in check.detail, (overrides, check.detail)


def test_the_sample_row_plans_the_largest_draw_the_sampler_makes_in_chunks(tmp_path, monkeypatch):
    """The sample row capped its chunk at eval.n, while the evaluation draws eval.class_n samples for the classifier
    columns (digits: 3,590 against an eval.n of 359) and NSGF++ with nsgf.nsf_source=velocity draws nsgf.nsf_states
    NSGF states, both in chunks of sample.batch_size: digits planned 359 samples a chunk and sampled 500."""
    monkeypatch.chdir(tmp_path)
    for over, chunk in ((["eval.n=64"], 500),  # digits' eval.class_n=3590
                        (["eval.n=64", "eval.class_n=64"], 64),
                        (["eval.n=64", "eval.class_n=64", "nsgf.nsf_source=velocity", "nsgf.nsf_t_min=0"], 500),
                        (["eval.n=64", "eval.class_n=64", "nsgf.nsf_source=velocity", "nsgf.nsf_t_min=0",
                         "nsgf.nsf_states=100"], 100)):
        cfg = config.resolve("digits", over)
        assert f"chunks of sample.batch_size={chunk} samples" in memory_plan.estimate(cfg)[-1].note, over
