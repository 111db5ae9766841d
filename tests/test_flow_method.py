"""Normalizing flows as a runner method: every flow preset end to end on its real shapes (tiny flows).

Train, step checkpoints, a resume past the end of a finished run (the loss and weights continue exactly as
an uninterrupted run's, so ActNorm was not re-initialised), sample (.png, .npy), eval (test bits/dim); the
three memory modes give the same trajectory through the runner; the drift guard's report; pixel levels;
the prior reparameterisation; one-line errors before any work.
"""

import contextlib
import json
import logging
import math
import re

import numpy as np
import pytest
import torch

from sinkflow import config, methods
from sinkflow.cli import main
from sinkflow.data import build_distribution
from sinkflow.flows import ActNorm, build_flow
from sinkflow.methods import normalizing_flow as flow_method
from sinkflow.runtime.run_folder import RunFolder
from test_data import make_cifar, make_mnist

TINY_FLOW = ["model.flow.levels=2", "model.flow.depth_per_level=2", "model.flow.hidden_channels=16"]
# schedule constant: the resume test continues a 4-step run to 6 steps and compares it with a straight 6-step
# run, which only a schedule that does not depend on the total step count allows (flow-digits uses cosine)
TINY = [*TINY_FLOW, "--batch-size", "4", "train.flow.ckpt_every=2", "train.flow.log_every=1",
        "train.flow.warmup=2", "train.flow.schedule=constant", "eval.n=8", "eval.seeds=1", "data.download=false",
        "--device", "cpu"]


@pytest.fixture(autouse=True)
def fresh_distributions():
    methods._distributions.cache_clear()  # data.root is per test
    yield
    methods._distributions.cache_clear()


def setup_data(preset, tmp_path):
    root = tmp_path / "data"
    if preset == "flow-mnist":
        make_mnist(root, n_train=24, n_test=8)
        return [f"data.root={root}"], (1, 28, 28)
    if preset == "flow-cifar10":
        make_cifar(root, per_batch=5, n_test=8)
        return [f"data.root={root}"], (3, 32, 32)
    return [f"data.root={root}"], (1, 8, 8)


def records(run_dir, phase="flow"):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def final_weights(run_dir):
    return torch.load(run_dir / "checkpoints/flow/final.pt", weights_only=True)["model"]


@pytest.mark.parametrize("preset", ["flow-digits", "flow-mnist", "flow-cifar10"])
def test_flow_preset_end_to_end(preset, runs_dir, tmp_path, capsys):
    extra, shape = setup_data(preset, tmp_path)
    assert main(["train", preset, *TINY, *extra, "--train-iters", "4", "--name", "a"]) == 0
    out = capsys.readouterr().out
    run = runs_dir / "a"
    assert "Test bits/dim" in out and (run / "grid.png").is_file()
    assert sorted(p.name for p in (run / "checkpoints/flow").glob("*.pt")) == [
        "final.pt", "step_00000002.pt", "step_00000004.pt"]
    first = losses(run)
    assert sorted(first) == [1, 2, 3, 4] and all(math.isfinite(v) for v in first.values())
    n_bins = 17 if preset == "flow-digits" else 256
    assert 0.5 < first[1] < math.log2(n_bins) + 4  # bits/dim, near uniform at the start
    drift = [r for r in records(run) if "fallen_back" in r]
    assert [r["step"] for r in drift] == [1, 2, 3, 4, 4] and drift[-1]["final"] and drift[-1]["fallen_back"] == 0

    # kill-free resume: the run finished at 4 steps; drop final.pt and continue to 6 from step_4
    (run / "checkpoints/flow/final.pt").unlink()
    assert main(["train", "--resume", str(run), "--train-iters", "6", "--no-report"]) == 0
    resumed = losses(run)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # continued from 4, nothing before it redone
    assert main(["train", preset, *TINY, *extra, "--train-iters", "6", "--name", "b", "--no-report"]) == 0
    straight = losses(runs_dir / "b")
    for step in (5, 6):  # same batches, noise, weights and optimizer: ActNorm was not re-initialised
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=1e-6)
    wa, wb = final_weights(run), final_weights(runs_dir / "b")
    assert all(torch.allclose(wa[k].float(), wb[k].float(), atol=1e-6) for k in wa)
    assert all(bool(v) for k, v in wa.items() if k.endswith("initialized"))

    capsys.readouterr()
    assert main(["sample", str(run), "--n", "16", "--out", str(tmp_path / "s.npy")]) == 0
    x = np.load(tmp_path / "s.npy")
    assert x.shape == (16, *shape) and np.isfinite(x).all() and x.min() >= -1 and x.max() <= 1 and x.std() > 0
    assert main(["sample", str(run), "--n", "16", "--out", str(tmp_path / "grid.png")]) == 0
    assert (tmp_path / "grid.png").stat().st_size > 0 and "wrote 16 samples (one inverse pass at temperature 1, 1 " \
        "network evaluation)" in capsys.readouterr().out
    assert main(["sample", str(run), "--n", "1", "--out", str(tmp_path / "one.npy"), "sample.temperature=0.7"]) == 0
    assert "wrote 1 sample (one inverse pass at temperature 0.7, 1 network evaluation)" in capsys.readouterr().out
    assert main(["sample", str(run), "--n", "4", "--steps", "50", "--out", str(tmp_path / "t.npy")]) == 2
    err = capsys.readouterr().err  # it printed "(50 steps, 1 network evaluations)"
    assert "--steps does not apply to a flow run" in err and not (tmp_path / "t.npy").exists()
    assert main(["eval", str(run)]) == 0
    text = capsys.readouterr().out
    assert "clamped to [-1,1] by the flow's sampler" in text and "not clamped" not in text  # it said "not clamped"
    from sinkflow import open_run
    from sinkflow.errors import SinkflowError

    with pytest.raises(SinkflowError, match=r"steps= does not apply to a flow run"):  # it was ignored in silence
        open_run(run).sample(4, steps=5)
    bpd = float(re.search(r"Test bits/dim on \S+ \(flow\): ([0-9.]+)", text).group(1))
    assert math.isfinite(bpd) and 0 < bpd < math.log2(n_bins) + 4
    last = records(run, "eval")[-1]  # one evaluation, one record: bits/dim beside the samples' scores
    assert last["test_bpd"] == pytest.approx(bpd, abs=1e-4)
    assert last["nfe"] == 1 and ("fd_cnn" in last) == ("FD-CNN" in text) and last["protocol"] == "qmc"  # recorded
    assert open_run(run).scores() == {k: v for k, v in last.items() if k not in ("time", "phase", "step")}


def test_memory_modes_same_trajectory(runs_dir, capsys):
    """standard, checkpoint and invertible train the same flow through the runner: the same losses.

    Tolerances are Adam's, not the modes': its first steps divide each gradient entry by its own magnitude,
    so float32 rounding on near-zero entries moves an update by up to lr. Float32 *standard* itself departs
    from a float64 run by ~1e-3 bits/dim and ~6% of the weight change after 5 steps (measured); the tight
    per-gradient equality of the modes is in tests/test_flows.py. A lost or wrong gradient shows here as a
    weight change off by ~100% of the affected parameters'.
    """
    runs, weights = {}, {}
    for mode in ("standard", "checkpoint", "invertible"):
        args = ["train", "flow-digits", *TINY, "--train-iters", "5", f"model.flow.memory={mode}", "--name", mode,
                "--no-report", "train.flow.ckpt_every=1", "checkpoint.keep=5"]
        assert main(args) == 0
        runs[mode] = losses(runs_dir / mode)
        step1 = torch.load(runs_dir / mode / "checkpoints/flow/step_00000001.pt", weights_only=True)["model"]
        weights[mode] = (flat(step1), flat(final_weights(runs_dir / mode)))
    ref = runs["standard"]
    assert len(ref) == 5 and (weights["standard"][1] - weights["standard"][0]).norm() > 0  # training moves
    w1, w5 = weights["standard"]
    for mode in ("checkpoint", "invertible"):
        assert runs[mode][1] == pytest.approx(ref[1], rel=1e-6)  # same init, same first batch and noise
        for step, value in ref.items():
            assert runs[mode][step] == pytest.approx(value, rel=1e-3), (mode, step)
        assert (weights[mode][1] - w5).norm() < 0.25 * (w5 - w1).norm(), mode  # steps 2..5 moved alike


def flat(state: dict) -> torch.Tensor:
    return torch.cat([v.double().flatten() for k, v in sorted(state.items()) if v.is_floating_point()])


def test_drift_guard_is_reported(runs_dir, caplog):
    """A drift tolerance below float32's rebuild error makes the guard fall back: counted, logged, loss exact."""
    common = ["train", "flow-digits", *TINY, "--train-iters", "3", "--no-report"]
    assert main([*common, "model.flow.memory=invertible", "model.flow.drift_tol=1e-12", "--name", "tight"]) == 0
    assert main([*common, "--name", "std"]) == 0
    final = [r for r in records(runs_dir / "tight") if r.get("final")][0]
    assert final["fallen_back"] > 0 and final["drift_events"] == final["fallen_back"]
    assert "fell back to storing their input" in caplog.text and "levels.0.layers" in caplog.text
    ref = losses(runs_dir / "std")
    tight = losses(runs_dir / "tight")  # gradients stay right through the fallbacks (tolerance: Adam's, above)
    assert tight[1] == pytest.approx(ref[1], rel=1e-6)
    assert all(tight[s] == pytest.approx(v, rel=1e-3) for s, v in ref.items())
    keep = {k: v for k, v in final_weights(runs_dir / "tight").items() if k.endswith("keep_input")}
    assert sum(int(v.sum()) for v in keep.values()) == final["fallen_back"]  # the flags are in the checkpoint


@pytest.mark.parametrize("mode", ["standard", "checkpoint"])
def test_the_drift_guard_line_is_said_only_where_the_guard_runs(mode, runs_dir, caplog):
    """The guard checks invertible mode's rebuilt inputs alone: standard and checkpoint ended saying "flow drift
    guard: 0 layer(s) fell back ... (max rebuild error 0, memory standard)" of a guard that never ran."""
    caplog.set_level(logging.INFO)
    assert main(["train", "flow-digits", *TINY, "--train-iters", "1", "--no-report", f"model.flow.memory={mode}",
                 "--name", mode]) == 0
    assert "drift guard" not in caplog.text, caplog.text
    assert [r for r in records(runs_dir / mode) if r.get("final")][0]["fallen_back"] == 0  # the record is kept


def test_a_resumed_flow_reports_the_drift_guard_counts_of_the_whole_run(runs_dir):
    """The guard's counts lived in memory: a run resumed from its step-2 checkpoint ended saying 0 drift events (its
    layers had fallen back before the checkpoint) where the uninterrupted run said one per layer."""
    import shutil

    common = ["train", "flow-digits", *TINY, "--train-iters", "4", "model.flow.memory=invertible",
              "model.flow.drift_tol=1e-12", "--no-report"]
    assert main([*common, "--name", "whole"]) == 0
    shutil.copytree(runs_dir / "whole", runs_dir / "resumed")
    for name in ("final.pt", "step_00000004.pt"):
        (runs_dir / "resumed" / "checkpoints" / "flow" / name).unlink()
    assert main(["train", "--resume", str(runs_dir / "resumed"), "--no-report"]) == 0
    whole, resumed = ([r for r in records(runs_dir / run) if r.get("final")][-1] for run in ("whole", "resumed"))
    assert whole["drift_events"] > 0
    assert {k: resumed[k] for k in ("drift_events", "max_drift", "fallen_back")} == \
        {k: whole[k] for k in ("drift_events", "max_drift", "fallen_back")}


def test_actnorm_initialised_on_first_batch(runs_dir):
    """After setup (before any step) every ActNorm is initialised from the first training batch, and the
    batch the loop then draws is that same batch: the first ActNorm normalises it per channel."""
    cfg = config.resolve("flow-digits", TINY_FLOW + ["train.flow.batch_size=32"], {"device": "cpu"})
    run = RunFolder.create(cfg)
    from sinkflow.engine.trainer import Trainer

    phase = Trainer(run, methods.get("flow").phases(cfg, *methods.distributions(cfg))[0])
    phase.setup()
    phase.task.on_setup(phase)  # the flow step's own hook: ActNorm initialised on the first batch
    norms = [m for m in phase.model.modules() if isinstance(m, ActNorm)]
    assert norms and all(bool(m.initialized) for m in norms)
    batch = phase.draw_batch(32)
    level0 = phase.model.levels[0].layers
    with torch.no_grad():
        x = flow_method.preprocess(batch, 17)
        if phase.model.pre is not None:  # flow-digits' logit preprocessing comes before the first level
            x, _ = phase.model.pre(x)
        h, _ = level0[0](x)  # squeeze
        y, _ = level0[1](h)  # the first ActNorm
    assert torch.allclose(y.mean(dim=(0, 2, 3)), torch.zeros(4), atol=1e-4)
    assert torch.allclose(y.std(dim=(0, 2, 3), unbiased=False), torch.ones(4), atol=1e-3)


def test_pixel_levels_are_exact(tmp_path):
    from sinkflow.data.images import to_unit_range

    k = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
    assert torch.equal(flow_method.pixel_levels(to_unit_range(k), 256), k)  # the data layer's k*2/255 - 1, undone
    digits = build_distribution("digits", data_cfg={"root": str(tmp_path)})
    x = digits.test_set(359)
    levels = flow_method.dequantize(flow_method.pixel_levels(x, 17), None, 17).floor()
    assert set(levels.unique().tolist()) == set(range(17))  # sklearn's native 0..16, every one present
    native = torch.from_numpy(np.rint(np.asarray(digits.test_images, np.float64) * 16 / 255))
    assert torch.equal(levels.double(), native)


@pytest.mark.parametrize("n_bins", [17, 256, 32])
def test_samples_are_decoded_onto_the_datas_pixel_grid(tmp_path, n_bins):
    """A sample's model-space value lies in the bin of one level; sampling returned it unquantised (a white digit
    pixel anywhere in 0.88..1, the mean pixel shifted). Decoding the data's own dequantised values gives the data
    back exactly (17-level digits, 8-bit images), or the 8-bit bin's centre under a bit reduction (32 levels)."""
    from sinkflow.data.images import to_unit_range
    from sinkflow.flows import postprocess, preprocess

    if n_bins == 17:
        x = build_distribution("digits", data_cfg={"root": str(tmp_path)}).test_set(359)
    else:
        x = to_unit_range(torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).repeat(4, 1, 1, 1))
    g = torch.Generator().manual_seed(0)
    model_space = preprocess(flow_method.dequantize(flow_method.pixel_levels(x, n_bins), g, n_bins), n_bins)
    back = postprocess(model_space, n_bins) * 2 - 1
    if n_bins == 32:
        k8 = torch.round((x + 1) * 127.5)
        want = ((k8 // 8) * 8 + 3.5) / 255 * 2 - 1
        assert torch.allclose(back, want, atol=1e-6) and (back - x).abs().max() <= 3.5 / 255 * 2 + 1e-6
    else:
        assert torch.allclose(back, x.to(back.dtype), atol=1e-6)
    assert torch.equal(postprocess(torch.tensor([float("nan"), float("inf"), -float("inf")]), n_bins),
                       postprocess(torch.tensor([0.0, 0.5, -0.5]), n_bins))


def test_decode_is_the_prior_reparameterisation():
    """decode(eps) inverts the flow's encoding written as standardised noise; temperature 0 = prior means."""
    torch.manual_seed(0)
    model = build_flow({"levels": 2, "depth_per_level": 2, "hidden_channels": 16}, (1, 8, 8)).double()
    x = torch.rand(6, 1, 8, 8, dtype=torch.float64) - 0.5
    with torch.no_grad():
        model.log_prob(x)  # ActNorm init
        for p in model.parameters():  # move the zero-initialised priors off zero so the test sees them
            p.add_(0.05 * torch.randn_like(p))
        zs, _ = model(x)
        eps = [(zs[-1] - model.top.mean) * torch.exp(-model.top.log_std)]
        h = zs[-1]
        for i in reversed(range(len(model.levels))):  # decode's order: top, then last split to first
            if i < len(model.splits):
                mean, log_std = model.splits[i]._prior(h)  # conditioned on the kept half
                eps.append((zs[i] - mean) * torch.exp(-log_std))
                h = torch.cat([h, zs[i]], 1)
            h = model.levels[i].inverse(h)
        noise = torch.cat([e.flatten(1) for e in eps], 1).view(6, 1, 8, 8)
        assert torch.allclose(flow_method.decode(model, noise, 1.0), x, atol=1e-9)
        assert torch.allclose(flow_method.decode(model, noise, 0.0), model.sample(6, temperature=0.0), atol=1e-9)


def one_line(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("sinkflow: error: ")
    for needle in needles:
        assert needle in err[-1], err[-1]


@pytest.mark.parametrize("args,needles", [
    (["model.flow.memory=invertible", "train.flow.precision=bf16"], ["invertible", "precision=fp32"]),
    (["model.flow.levels=4"], ["divisible by 16", "data.image_size=16"]),
    (["model.flow.n_bins=300"], ["n_bins"]),
    (["model.flow.memory=sideways"], ["model.flow.memory", "must be one of standard, checkpoint, invertible"]),
    (["data.target=moons"], ["models images", "an image target"]),  # refused while resolving
    (["sample.temperature=-1.0"], ["temperature"]),
])
def test_bad_flow_config_fails_before_work(args, needles, runs_dir, capsys):
    assert main(["train", "flow-digits", *TINY, *args]) == 2
    one_line(capsys, *needles)
    assert not runs_dir.exists()


@pytest.mark.parametrize("command", ["config", "train"])
def test_a_flow_on_a_2d_preset_is_refused_when_the_config_resolves(command, runs_dir, capsys):
    """``sinkflow config moons --method flow`` printed a config that ``train`` then refused: the refusal was the
    flow's data check, which needs torch and the data. The config layer knows the built-in 2D names."""
    assert main([command, "moons", "--method", "flow"]) == 2
    one_line(capsys, "experiment.method=flow models images", "data.target=moons gives 2-D points", "an image target")
    assert not runs_dir.exists()


def test_a_level_count_that_rounds_the_data_away_is_warned_about(caplog):
    """flow-digits' n_bins=17 (sklearn digits' native levels) kept on a folder of 8-bit images fitted and scored a
    density over images rounded to 17 levels in silence; the flow now warns before its phase runs. 17 on the digits
    themselves, 256 on 8-bit images and 32 (a divisor of 256: Glow's deliberate bit reduction) stay quiet."""
    import logging

    from sinkflow.data.images import ImageDistribution

    rng = np.random.default_rng(0)
    eight_bit = rng.integers(0, 256, size=(40, 1, 8, 8), dtype=np.uint8)
    digits_like = np.round(rng.integers(0, 17, size=(40, 1, 8, 8)) * 255 / 16).astype(np.uint8)
    cases = [(eight_bit, 17, 1), (digits_like, 17, 0), (eight_bit, 256, 0), (eight_bit, 32, 0)]
    for images, n_bins, expected in cases:
        target = ImageDistribution("x", images, images[:8], None, None)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sinkflow"):
            flow_method.warn_levels(target, n_bins, "folder")
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == expected, (n_bins, warned)
    cfg = config.resolve("flow-digits", ["data.target=folder", "data.path=x"], unread="ignore")
    with caplog.at_level(logging.WARNING, logger="sinkflow"):
        caplog.clear()
        methods.of(cfg).phases(cfg, None, ImageDistribution("folder", eight_bit, eight_bit[:8], None, None))
    assert ["model.flow.n_bins=17 but data.target=folder has 256 pixel levels in its first 40 images" in r.getMessage()
            for r in caplog.records] == [True]


@pytest.mark.parametrize("overrides, needle", [
    (["model.flow.levels=4"], "images are 8x8; set model.flow.levels=3, or data.image_size=16 (resizes"),
    (["data.image_size=10"], "images are 10x10; set model.flow.levels=1, or data.image_size="),
    (["data.image_size=9"], "images are 9x9; set data.image_size=8 (resizes"),
    (["model.flow.squeeze=false"], "level 0 has 1 channel(s); coupling needs >= 2; set model.flow.squeeze=true"),
    # a later level's channels halved away: the squeeze would ask for sides divisible by 2**levels, whose hint led
    # back here; fewer levels fit
    (["model.flow.squeeze=false", "data.channels=3", "model.flow.levels=3"],
     "level 2 has 1 channel(s); coupling needs >= 2; use 2 level(s)")])
def test_image_sides_a_flow_cannot_halve_name_the_image_size_key(runs_dir, capsys, overrides, needle):
    """A 15x15 folder under a 3-level flow said 'use fewer levels or a size divisible by 8': fewer levels cannot fix
    an odd side, and the data key that can was not named. Where fewer levels do fit, they come first and name the
    count: resizing the 17-level digits to 16x16 makes 8-bit images the preset's n_bins=17 no longer describes. A
    1-channel image without the squeeze is fixed by the squeeze, not by fewer levels."""
    capsys.readouterr()
    assert main(["train", "flow-digits", *overrides, "--train-iters", "1", "--device", "cpu", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert needle in err and ("divisible by" in err or "squeeze" in err or "level(s)" in err), err
    assert not runs_dir.exists()


def test_overflowed_samples_are_said_in_a_real_run_and_muted_in_the_tools_scratch_runs(monkeypatch, caplog):
    """A 3-step scratch run's samples overflow (preflight flow-cifar10 said all 16 did, then passed): the warning is
    one that a run did not learn, which the tools' scratch runs mute (``quiet``) and a real sampling says."""
    import logging

    from sinkflow.runtime.callbacks import quiet

    cfg = config.resolve("flow-digits", TINY_FLOW)
    model = build_flow({k: v for k, v in cfg["model"]["flow"].items() if k not in ("kind", "n_bins")}, (1, 8, 8))

    def overflowing(model, x0, temperature):
        out = torch.zeros(len(x0), 1, 8, 8)
        out[0] = float("inf")
        return out

    monkeypatch.setattr(flow_method, "decode", overflowing)
    for muted in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sinkflow"), (quiet() if muted else contextlib.nullcontext()):
            _, info = methods.get("flow").sample_nets({"flow": model}, cfg, torch.randn(4, 1, 8, 8))
        said = [r.getMessage() for r in caplog.records if "overflowed in the inverse" in r.getMessage()]
        assert info["nonfinite"] == 1 and len(said) == (0 if muted else 1), (muted, said)


def test_chunked_sampling_counts_the_overflowed_samples_of_every_chunk(monkeypatch):
    """``sample_chunks`` samples in chunks of ``sample.batch_size``: ``info["nonfinite"]`` is a count of samples, the
    sum over the chunks (it read the first chunk's alone: 1 of 5 where every chunk had one)."""
    import types

    from sinkflow.eval import points

    def sample(run, x0, steps, record):
        x = torch.zeros_like(x0)  # clamped pixels: finite, as the flow's sampler returns them
        return x, {"nfe": 1, "path": [], "nonfinite": 1}

    method = types.SimpleNamespace(sample=sample, sample_precision=lambda cfg, device: "fp32")
    monkeypatch.setattr(points.methods, "of", lambda cfg: method)
    run = types.SimpleNamespace(cfg={"sample": {"batch_size": 2}}, device=torch.device("cpu"))
    x, info = points.sample_chunks(run, torch.randn(5, 1, 8, 8), None)
    assert x.shape == (5, 1, 8, 8) and info["nonfinite"] == 3 and info["nfe"] == 1, info
