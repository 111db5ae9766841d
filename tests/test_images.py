"""NSGF++ and the image presets end to end on exactly their real shapes, with tiny networks and counts.

Every image preset: pool, three trainings, checkpoints, a resume in the middle of every phase (which must
reproduce the uninterrupted weights and pool bit for bit), sample (.png grid, .npy), eval. Plus the NFE
instrumentation and one-line errors for bad image input.
"""

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sinkflow
from sinkflow import data, methods
from sinkflow.errors import SinkflowError
from sinkflow.cli import main
from sinkflow.runtime.run_folder import RunFolder
from test_data import make_cifar, make_folder, make_mnist

TINY_UNET = ["model.velocity.channels=8", "model.nsf.channels=8", "model.velocity.res_blocks=1",
             "model.nsf.res_blocks=1", "model.time.channels=[4, 4, 4, 4]"]
TINY = ["pool.batches=3", "pool.batch_size=8", "pool.chunk=1", "pool.in_flight=1", "--train-iters", "4", "train.velocity.ckpt_every=3",
        "train.nsf.ckpt_every=3", "train.time.ckpt_every=3", "--batch-size", "4", "sample.nsf_steps=3",
        "eval.n=8", "eval.seeds=1", "data.download=false", "--device", "cpu", *TINY_UNET]
PHASES = ("velocity", "nsf", "time")
# FM / OT-CFM read no pool, NSF or time-predictor key: setting one is an error (config.check_read)
TINY_FM = [o for o in TINY if not o.startswith(("pool.", "model.nsf.", "model.time.", "train.nsf.", "train.time.",
                                                "sample.nsf_"))]


@pytest.fixture(autouse=True)
def fresh_distributions():
    methods._distributions.cache_clear()  # data.root is per test; never reuse another test's arrays
    yield
    methods._distributions.cache_clear()


def setup_data(preset, tmp_path):
    """Real-format files for the preset under tmp_path/data; returns (overrides, expected sample shape)."""
    root = tmp_path / "data"
    args = [f"data.root={root}"]
    if preset == "mnist":
        make_mnist(root, n_train=24, n_test=6)
        return args, (1, 28, 28)
    if preset == "cifar10":
        make_cifar(root, per_batch=5, n_test=6)  # paper head width 64 does not divide 8 channels
        return args + ["model.velocity.num_head_channels=4", "model.nsf.num_head_channels=4"], (3, 32, 32)
    if preset == "folder":
        folder = make_folder(tmp_path / "imgs", n=12, size=(23, 31))
        return args + [f"data.path={folder}", "data.image_size=20"], (3, 20, 20)
    return args + ["eval.class_n=32"], (1, 8, 8)  # the preset's 3,590 classifier samples: 10 s of sampling here


def weights(run, phase):
    return torch.load(run / "checkpoints" / phase / "final.pt", weights_only=True)["model"]


@pytest.mark.parametrize("preset", ["digits", "mnist", "cifar10", "folder"])
def test_preset_end_to_end(preset, runs_dir, tmp_path, capsys, caplog):
    extra, shape = setup_data(preset, tmp_path)
    storage = ["pool.storage=disk", "pool.dtype=float16"]  # the image pool's real storage path
    with caplog.at_level(logging.WARNING, logger="sinkflow.learning"):
        assert main(["train", preset, *TINY, *extra, *storage, "--name", "r"]) == 0
    # 4 steps cannot teach the time predictor: the phase end measures it on a fresh draw and says so
    (t_rec,) = [json.loads(line) for line in (runs_dir / "r" / "metrics.jsonl").open() if '"t_mse"' in line]
    assert t_rec["phase"] == "time" and t_rec["t_mse"] > 0.5 * t_rec["t_mse_constant"]
    assert "phase-transition predictor has not learned" in caplog.text
    out = capsys.readouterr().out
    run = runs_dir / "r"
    k = 10 if preset == "digits" else 5  # digits samples 10 NSGF steps over its 5-step pool (sample.nsgf_steps)
    assert f"NFE = {k} velocity + 1 time + 3 nsf" in out and "FID skipped" in out
    # where the predictor starts the straight flow, printed and recorded (a seed-dependent t_hat moves FD)
    m = re.search(r"; t_hat (\d\.\d\d) \((\d\.\d\d)-(\d\.\d\d)\)", out)
    assert m and 0 <= float(m[2]) <= float(m[1]) <= float(m[3]) <= 1
    (ev,) = [json.loads(line) for line in (runs_dir / "r" / "metrics.jsonl").open() if '"eval"' in line]
    assert ev["t_hat_mean_3"] == pytest.approx(float(m[1]), abs=0.006)
    if preset in ("digits", "mnist"):  # digit sets: FD-CNN beside W2 / TV / confidence, with its floor
        assert "FD-CNN (not Inception FID)" in out and "floor (real training digits, same n)" in out
    split = json.loads((runs_dir / "r" / "data_split.json").read_text())  # what trained, recorded in the run
    n_test = {"digits": 359, "folder": 1}.get(preset, 6)  # folder: the last 10% of 12 images, at least one
    assert split["n_train"] > 0 and split["n_test"] == n_test
    assert preset != "mnist" or split["layout"] == "official"
    assert (run / "grid.png").is_file() and (run / "trajectory_strip.png").is_file()
    pool_x = np.load(run / "pool/x.npy", mmap_mode="r")
    assert pool_x.dtype == np.float16 and pool_x.shape == (3 * 5 * 8, *shape)
    for phase in PHASES:
        assert [p.name for p in sorted((run / "checkpoints" / phase).glob("step_*.pt"))] == ["step_00000003.pt"]

    # interrupt every phase in its middle: the pool's last chunk undone, each training back at step 3 of 4
    before = {p: weights(run, p) for p in PHASES}
    pool_before = np.array(pool_x)
    del pool_x
    progress = json.loads((run / "pool/progress.json").read_text())
    (run / "pool/progress.json").write_text(json.dumps({**progress, "chunks": [0, 1]}))
    x = np.load(run / "pool/x.npy", mmap_mode="r+")
    x[2 * 40:] = 0  # what a kill before chunk 2 was flushed would leave
    x.flush()
    del x
    for phase in ("pool", *PHASES):
        (run / "checkpoints" / phase / "final.pt").unlink()
    with caplog.at_level(logging.INFO, logger="sinkflow"):
        assert main(["train", "--resume", str(run), "--no-report"]) == 0
    assert "velocity: resuming from step 3 of 4 (step_00000003.pt)" in caplog.text  # status may show a later step
    assert np.array_equal(np.load(run / "pool/x.npy"), pool_before)
    for phase in PHASES:
        after = weights(run, phase)
        assert all(torch.equal(before[phase][k], after[k]) for k in after), phase

    assert main(["sample", str(run), "--n", "6", "--out", str(tmp_path / "g.png")]) == 0
    assert f"(3 straight-flow steps, {k + 4} network evaluations)" in capsys.readouterr().out  # what --steps counts
    assert main(["sample", str(run), "--n", "6", "--steps", "1", "--out", str(tmp_path / "g1.png")]) == 0
    assert f"(1 straight-flow step, {k + 2} network evaluations)" in capsys.readouterr().out  # not "1 ... steps"
    assert Image.open(tmp_path / "g.png").size[0] > 0
    # half-precision sampling (sample.precision): every network of the sampler under autocast, the images float32,
    # finite and of the data's shape, close to the fp32 draw of the same seed
    draws = {}
    for precision in ("fp32", "bf16", "fp16"):
        out = tmp_path / f"{precision}.npy"
        assert main(["sample", str(run), "--n", "6", f"sample.precision={precision}", "--out", str(out)]) == 0
        draws[precision] = np.load(out, allow_pickle=False)
    for half in ("bf16", "fp16"):
        assert draws[half].shape == (6, *shape) and draws[half].dtype == np.float32
        assert np.isfinite(draws[half]).all() and np.abs(draws[half] - draws["fp32"]).mean() < 0.05
    assert main(["sample", str(run), "--n", "6", "--steps", "2", "--out", str(tmp_path / "s.npy")]) == 0
    s = np.load(tmp_path / "s.npy")
    assert s.shape == (6, *shape) and np.isfinite(s).all()
    # a folder of one PNG per image (what FID tools read): the same draw's pixels, rounded as the grid rounds them
    assert main(["sample", str(run), "--n", "6", "--steps", "2", "--out", str(tmp_path / "pngs")]) == 0
    files = sorted((tmp_path / "pngs").iterdir())
    assert [f.name for f in files] == [f"{i:06d}.png" for i in range(6)] and not list(tmp_path.glob(".pngs*"))
    pixels = [np.asarray(Image.open(f)) for f in files]
    assert Image.open(files[0]).mode == ("L" if shape[0] == 1 else "RGB")
    expected = np.round((np.clip(s, -1, 1) + 1) / 2 * 255).astype(np.uint8)  # (N, C, H, W)
    for got, want in zip(pixels, expected):
        got = got[None] if got.ndim == 2 else got.transpose(2, 0, 1)
        assert got.shape == shape and np.abs(got.astype(int) - want).max() <= 1
    assert main(["sample", str(run), "--n", "6", "--out", str(tmp_path / "pngs")]) == 2  # never into a used folder
    assert "already holds files" in capsys.readouterr().err
    assert all(np.array_equal(np.asarray(Image.open(f)), p) for f, p in zip(files, pixels))
    assert main(["eval", str(run), "--seeds", "1", "--n", str(min(4, n_test))]) == 0
    out = capsys.readouterr().out
    assert "W2" in out and "the networks sampled in" not in out  # auto on this CPU: fp32, said by nothing
    # a half precision is said after the protocol (auto is fp16 on a CUDA card: the table from a GPU and a CPU of
    # the same run read alike), as its record says it
    assert main(["eval", str(run), "--seeds", "1", "--n", str(min(4, n_test)), "sample.precision=bf16"]) == 0
    assert "; the networks sampled in sample.precision=bf16" in capsys.readouterr().out
    assert main(["eval", str(run), "--seeds", "1", "--n", str(n_test + 1)]) == 2  # not a smaller sample in silence
    assert f"--n {n_test + 1} images, but the held-out split of" in capsys.readouterr().err
    from sinkflow.eval.images import held_out  # FID of one image, before its weights are read (none exist here)

    cfg = RunFolder.open(run).cfg
    with pytest.raises(SinkflowError, match="^FID of 1 image: a Fréchet distance .* needs at least 2"):
        held_out({**cfg, "eval": {**cfg["eval"], "inception_weights": str(tmp_path / "no-such.pt")}}, n=1)
    if preset == "digits":  # scikit-learn's digits are always here
        return
    # a run copied without its data set (trained on a Kaggle GPU, sampled on a laptop): the same samples bit for bit,
    # from the shape data_split.json records (or, in a record from before it held one, the config implies); nothing
    # is downloaded, and scoring still needs the data
    for gone in (tmp_path / "data", tmp_path / "imgs"):
        if gone.exists():
            gone.rename(gone.with_name(gone.name + "-elsewhere"))
    methods._distributions.cache_clear()
    assert split["shape"] == list(shape)
    for record in ("with its shape", "without"):
        assert main(["sample", str(run), "--n", "6", "--steps", "2", "--out", str(tmp_path / "away.npy")]) == 0
        assert np.array_equal(np.load(tmp_path / "away.npy"), s), record
        assert torch.equal(sinkflow.open_run(run).sample(6, steps=2), torch.from_numpy(s)), record
        (tmp_path / "away.npy").unlink()
        (run / "data_split.json").write_text(json.dumps({k: v for k, v in split.items() if k != "shape"}))
    assert not (tmp_path / "data").exists()
    assert main(["eval", str(run), "--seeds", "1", "--n", "4"]) == 2
    capsys.readouterr()


# what `auto` resolves to on an Ampere+ CUDA card: fp16 UNets and every training phase one captured step (on a CPU
# the step graph's path runs eagerly; the time predictor stays fp32)
CUDA_DEFAULT_PATH = ["train.velocity.precision=fp16", "train.nsf.precision=fp16", "train.velocity.graph=step",
                     "train.nsf.graph=step", "train.time.graph=step"]


@pytest.mark.parametrize("preset", ["mnist", "cifar10"])
def test_nsgfpp_on_the_cuda_default_path_at_the_image_shapes(preset, runs_dir, tmp_path, capsys):
    """NSGF++'s three phases in float16 with loss scaling through the whole-step path, (N, 1, 28, 28) and
    (N, 3, 32, 32): trained, checkpointed (the scale with them), sampled to finite images."""
    extra, shape = setup_data(preset, tmp_path)
    assert main(["train", preset, *TINY, *extra, *CUDA_DEFAULT_PATH, "--name", "h", "--no-report"]) == 0
    run = runs_dir / "h"
    for phase in PHASES:
        state = torch.load(run / "checkpoints" / phase / "final.pt", weights_only=True)
        assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()), phase
        assert bool(state["scaler"]) == (phase != "time"), phase  # fp16's GradScaler state is saved
    capsys.readouterr()
    assert main(["sample", str(run), "--n", "4", "--out", str(tmp_path / "s.npy")]) == 0
    samples = np.load(tmp_path / "s.npy")
    assert samples.shape == (4, *shape) and np.isfinite(samples).all()


@pytest.mark.parametrize("method", ["fm", "otcfm"])
def test_baselines_use_the_image_unet(method, runs_dir, tmp_path, capsys):
    extra, shape = setup_data("digits", tmp_path)
    assert main(["train", "digits", "--method", method, *TINY_FM, *extra, "sample.steps=4", "eval.steps=[4]",
                 "--name", method]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["4", "4"] for line in out.splitlines()), out  # steps 4, counted NFE 4
    assert "t_hat" not in out  # a one-network sampler has no predictor to report
    run = RunFolder.open(runs_dir / method)
    model = run.model("velocity")
    assert type(model).__name__ == "UNet"
    x, info = methods.get(method).sample(run, torch.randn(3, *shape), 4, record=True)
    assert x.shape == (3, *shape) and info["nfe"] == 4 and len(info["path"]) == 5
    assert (runs_dir / method / "grid.png").is_file()


def test_eval_on_the_validation_split_chooses_without_the_test_split(runs_dir, tmp_path, capsys):
    """`sinkflow eval RUN --split val sample.key=value`: a sampling setting scored against the validation digits
    (data.val_fraction), which no training step read, and recorded as such; the test split is never drawn. A run
    without a validation split is refused in one line, before any work."""
    extra, _ = setup_data("digits", tmp_path)
    base = ["train", "digits", "--method", "fm", *TINY_FM, *extra, "sample.steps=2", "eval.steps=[2]", "--no-report"]
    assert main([*base, "data.val_fraction=0.1", "--name", "v"]) == 0
    assert main([*base, "--name", "nov"]) == 0
    capsys.readouterr()
    run = RunFolder.open(runs_dir / "v")
    target = data.distributions(run.cfg)[1]
    n_val = len(target.val_index)
    assert main(["eval", str(runs_dir / "v"), "--split", "val", "--n", "8", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert f"validation split (8 of {n_val} images" in out
    assert main(["eval", str(runs_dir / "v"), "--n", "8", "--seeds", "1"]) == 0
    assert "held-out split" in capsys.readouterr().out
    assert main(["eval", str(runs_dir / "v"), "--split", "val", "--n", "8", "--seeds", "1", "sample.time_warp=0.5"]) == 0
    evals = [json.loads(x) for x in (runs_dir / "v" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("phase") == "eval"]
    val, test, warped = evals[-3:]
    assert val["split"] == "val" and "split" not in test  # a validation score is never taken for the run's test score
    assert val["fd_cnn_2"] != test["fd_cnn_2"] and val["w2_2"] != test["w2_2"]  # other reference images
    assert warped["split"] == "val" and warped["sample"] == {"time_warp": 0.5} and warped["w2_2"] != val["w2_2"]
    test_draws = []
    real = type(target).test_set
    with pytest.MonkeyPatch.context() as mp:  # the validation evaluation draws no test image
        mp.setattr(type(target), "test_set", lambda self, n=None: test_draws.append(n) or real(self, n))
        assert main(["eval", str(runs_dir / "v"), "--split", "val", "--n", "8", "--seeds", "1"]) == 0
    assert test_draws == []
    capsys.readouterr()
    lines = len((runs_dir / "nov" / "metrics.jsonl").read_text().splitlines())
    assert main(["eval", str(runs_dir / "nov"), "--split", "val"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained without a validation split (data.val_fraction=0)" in err[0], err
    assert len((runs_dir / "nov" / "metrics.jsonl").read_text().splitlines()) == lines  # nothing scored
    assert main(["eval", str(runs_dir / "v"), "--split", "val", "--n", str(n_val + 1)]) == 2
    assert f"the validation split of digits holds {n_val}" in capsys.readouterr().err
    lines = len((runs_dir / "v" / "metrics.jsonl").read_text().splitlines())
    assert main(["eval", str(runs_dir / "v"), "--n", "1", "--seeds", "1"]) == 2  # was numpy's LinAlgError in FD-CNN
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--n 1: digits is scored by FD-CNN" in err[0] and "use --n 2 or more" in err[0]
    api_run = sinkflow.open_run(runs_dir / "v")  # the API's evaluate refuses as the command does (it cut n in silence)
    with pytest.raises(SinkflowError, match="^n=1: digits is scored by FD-CNN.*use n=2 or more"):
        api_run.evaluate(n=1, seeds=1)
    with pytest.raises(SinkflowError, match=f"^n={n_val + 1} images, but the validation split of digits holds {n_val}; "
                                            f"use n={n_val} or less$"):
        api_run.evaluate(n=n_val + 1, seeds=1, split="val")
    n_test = len(target.test_images)
    with pytest.raises(SinkflowError, match=f"^n={n_test + 1} images, but the held-out split of digits holds {n_test}"):
        api_run.evaluate(n=n_test + 1, seeds=1)
    assert len((runs_dir / "v" / "metrics.jsonl").read_text().splitlines()) == lines  # nothing scored


def test_class_columns_use_eval_class_n_samples(runs_dir, tmp_path, monkeypatch):
    """eval.class_n: the classifier's histogram and confidence read class_n generated images per seed, W2
    still compares eval.n with eval.n held-out images (TV's sampling noise shrinks as 1/sqrt(class_n))."""
    import sinkflow.eval.images as images
    import sinkflow.ot

    extra, _ = setup_data("digits", tmp_path)
    assert main(["train", "digits", "--method", "fm", *TINY_FM, *extra, "sample.steps=2", "--no-report",
                 "--name", "c"]) == 0
    run = RunFolder.open(runs_dir / "c", ["eval.class_n=40"])
    seen = {"w2": [], "clf": []}
    real_w2, real_stats = sinkflow.ot.w2, images.class_stats
    monkeypatch.setattr(sinkflow.ot, "w2", lambda x, y: seen["w2"].append((len(x), len(y))) or real_w2(x, y))
    monkeypatch.setattr(images, "class_stats", lambda clf, x: seen["clf"].append(len(x)) or real_stats(clf, x))
    result = images.image_metrics(run, seeds=2, steps_list=[2])
    assert seen["w2"] == [(8, 8), (8, 8)]
    assert seen["clf"] == [8, 40, 40]  # the held-out reference once, then class_n generated per seed
    assert result["protocol"]["class_n"] == 40 and "40 generated" in result["protocol"]["classifier"]
    assert 0.0 <= result["rows"][0]["tv"] <= 1.0
    seen["clf"].clear()  # `sinkflow eval --n` is every metric's sample count: not the run's class_n as well
    assert main(["eval", str(runs_dir / "c"), "--seeds", "1", "--n", "6"]) == 0  # the run: digits' class_n 3,590
    assert seen["clf"] == [6, 6]
    seen["clf"].clear()  # Run.evaluate(n=6) the same (it scored the classifier columns on 3,590 a seed)
    sinkflow.open_run(runs_dir / "c").evaluate(seeds=1, n=6)
    assert seen["clf"] == [6, 6]
    record = [json.loads(line) for line in (runs_dir / "c" / "metrics.jsonl").read_text().splitlines()][-1]
    assert (record["phase"], record["n"], record["seeds"]) == ("eval", 6, 1)  # the setting beside the scores
    assert any(k.startswith("fd_cnn_") for k in record)
    spreads = {k.rpartition("_")[0] for k in record if "_std_" in k}  # each score's spread over seeds beside it
    assert spreads == {"w2_std", "tv_std", "confidence_std", "fd_cnn_std"} and "class_n" not in record  # n: both
    # one evaluation, one record: every step count's scores (a record per row: Run.scores held the last row's only)
    two = RunFolder.open(runs_dir / "c", ["eval.steps=[1, 2]", "eval.class_n=null"])
    images.evaluate_images(two, seeds=1, n=6)
    two.logger.close()
    got = sinkflow.open_run(runs_dir / "c").scores()
    assert all(f"fd_cnn_{k}" in got and f"w2_{k}" in got for k in (1, 2)) and got["n"] == 6, got
    images.evaluate_images(run, seeds=2, n=8)  # class_n 40: the record says so, and each score's spread
    run.logger.close()
    record = [json.loads(line) for line in (runs_dir / "c" / "metrics.jsonl").read_text().splitlines()][-1]
    assert (record["n"], record["class_n"], record["seeds"]) == (8, 40, 2)
    assert all(v > 0 for k, v in record.items() if k.startswith("w2_std_")), record
    # the FD-CNN floor uses as many real training digits as there are, at most class_n: the label says which
    p = result["protocol"]
    assert p["fd_cnn_floor_n"] == min(40, len(data.distributions(run.cfg)[1].images))
    fewer = {**result, "protocol": {**p, "fd_cnn_floor_n": 30}}
    assert "floor (real training digits, 30: all there are)" in images.format_metrics(fewer)
    assert "floor (real training digits, same n)" in images.format_metrics({**result, "protocol": {**p, "fd_cnn_floor_n": 40}})
    assert images.format_metrics(result).startswith(f"Image metrics on digits ({result['method']}):")
    on_folder = images.format_metrics({**result, "target": "folder"})  # the digits preset on a folder: the data scored
    assert on_folder.startswith(f"Image metrics on folder (preset digits) ({result['method']}):")


def test_nfe_is_counted_per_network(runs_dir, tmp_path):
    extra, shape = setup_data("digits", tmp_path)
    assert main(["train", "digits", *TINY, *extra, "pool.steps=3", "sample.nsgf_steps=null", "--no-report",
                 "--name", "n"]) == 0
    run = RunFolder.open(runs_dir / "n")
    x0 = torch.randn(5, *shape)
    for nsf_steps in (1, 7):
        x, info = methods.get("nsgfpp").sample(run, x0, nsf_steps, record=True)
        assert info["nfe"] == 3 + 1 + nsf_steps
        assert (info["nfe_velocity"], info["nfe_time"], info["nfe_nsf"]) == (3, 1, nsf_steps)
        assert x.shape == (5, *shape) and info["t_hat"].shape == (5,)
        assert len(info["path"]) == 1 + 3 + nsf_steps
    # per-sample t_hat: the NSF integrates each sample over its own [t_hat_i, 1]
    from sinkflow.methods.ode import euler

    nsf, t_hat = run.model("nsf"), info["t_hat"]
    xt = info["path"][3]
    one = torch.stack([euler(nsf, xt[i:i + 1], t_hat[i:i + 1], 1.0, 7)[0][0] for i in range(5)])
    assert torch.allclose(one, x, atol=1e-5)
    # an NSF trained on [nsf_t_min, 1) is never asked about earlier times: t_hat is clamped into its range
    assert float(t_hat.min()) < 0.75
    run.cfg["nsgf"]["nsf_t_min"] = 0.75
    _, info = methods.get("nsgfpp").sample(run, x0, 2)
    assert float(info["t_hat"].min()) >= 0.75
    # sample.t_shift moves every sample's start by the same amount, before the clamp into the NSF's range
    run.cfg["nsgf"]["nsf_t_min"] = 0.0
    run.cfg["sample"]["t_shift"] = -0.2
    x_shift, shifted = methods.get("nsgfpp").sample(run, x0, 7)
    raw = run.model("time")(xt).float()
    assert torch.allclose(shifted["t_hat"], (raw - 0.2).clamp(0, 1), atol=1e-6)
    assert not torch.allclose(x_shift, x) and "from t_hat -0.2" in methods.get("nsgfpp").describe(run.cfg)
    run.cfg["sample"]["t_shift"] = 1.0  # every start clamped to 1: the straight flow does not move the states
    x_end, _ = methods.get("nsgfpp").sample(run, x0, 7)
    assert torch.allclose(x_end, xt, atol=1e-6)


def test_nsgf_steps_at_sampling(runs_dir, tmp_path):
    """sample.nsgf_steps: k uniform NSGF steps over the network's time span (NFE k + 1 + nsf_steps), the
    pool's own grid when null or T, and a one-line refusal when the field saw only the grid times."""
    from sinkflow.errors import SinkflowError
    from sinkflow.methods import nsgfpp

    extra, shape = setup_data("digits", tmp_path)
    assert main(["train", "digits", *TINY, *extra, "pool.steps=3", "nsgf.segment=0.5", "sample.nsgf_steps=null",
                 "--no-report", "--name", "k"]) == 0
    run = RunFolder.open(runs_dir / "k")
    x0 = torch.randn(4, *shape)
    base, info = methods.get("nsgfpp").sample(run, x0, 2, record=True)
    assert info["nfe_velocity"] == 3
    t_end = nsgfpp.nsgf_grid(run.cfg)[0][-1]
    run.cfg["sample"]["nsgf_steps"] = 2
    times, steps = nsgfpp.nsgf_grid(run.cfg)
    assert times == pytest.approx([0.0, t_end / 2, t_end]) and steps == pytest.approx([t_end / 2] * 2)
    x, info = methods.get("nsgfpp").sample(run, x0, 2, record=True)
    assert (info["nfe_velocity"], info["nfe_time"], info["nfe_nsf"], info["nfe"]) == (2, 1, 2, 5)
    assert x.shape == base.shape and len(info["path"]) == 1 + 2 + 2
    v = run.model("velocity")
    first = x0 + steps[0] * v(x0, torch.zeros(4))
    assert torch.allclose(info["path"][1], first, atol=1e-6)  # the first step spans half of the NSGF time
    run.cfg["sample"]["nsgf_steps"] = 6  # more steps than the pool's T: each pool segment in two halves
    times, _ = nsgfpp.nsgf_grid(run.cfg)
    assert times[::2] == pytest.approx(nsgfpp.nsgf.network_grid(run.cfg)[0].tolist())
    assert methods.get("nsgfpp").sample(run, x0, 2)[1]["nfe_velocity"] == 6
    run.cfg["sample"]["nsgf_steps"] = 3  # = pool.steps: the pool's own grid, the same samples as null
    assert torch.equal(methods.get("nsgfpp").sample(run, x0, 2)[0], base)
    run.cfg["nsgf"]["segment"] = 0.0
    run.cfg["sample"]["nsgf_steps"] = 2
    with pytest.raises(SinkflowError, match="nsgf.segment=0"):
        methods.get("nsgfpp").sample(run, x0, 2)
    run.cfg["sample"]["nsgf_steps"] = 0
    with pytest.raises(SinkflowError, match="not a positive integer"):
        nsgfpp.check_nsgf_steps(run.cfg)


# ------------------------------------------------------------------------------------------------ bad input

def one_line(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


def bad(capsys, *args):
    assert main(["train", *args, "--train-iters", "1", "--device", "cpu", "--no-report"]) == 2


def test_runs_inside_the_image_folder_are_refused_before_training(tmp_path, monkeypatch, capsys):
    """`sinkflow train folder data.path=.` in the folder of images put runs/ inside it: the run's grid.png became an
    image of the set, and its eval was refused ("images ... have different sizes", or "its data changed")."""
    folder = make_folder(tmp_path / "imgs", n=10, size=(8, 8))
    monkeypatch.chdir(folder)
    bad(capsys, "folder", "data.path=.", "--method", "fm")
    one_line(capsys, "experiment.runs_dir=runs is inside data.path=.: the run's plots would be read as images",
             "set experiment.runs_dir to a folder outside data.path")
    assert not (folder / "runs").exists() and not (folder / "data").exists()
    bad(capsys, "folder", f"data.path={tmp_path}", f"experiment.runs_dir={folder / 'r'}", "--method", "fm")
    one_line(capsys, "is inside data.path")


def test_fid_of_a_folder_holding_out_one_image_is_refused_before_training(runs_dir, tmp_path, capsys):
    """A folder of 12 images holds out one: with eval.inception_weights set, every phase trained and the report then
    refused "FID of 1 image" (held_out's check)."""
    folder = make_folder(tmp_path / "imgs", n=12, size=(8, 8))
    (tmp_path / "w.pth").write_bytes(b"weights")
    bad(capsys, "folder", f"data.path={folder}", f"eval.inception_weights={tmp_path / 'w.pth'}", "--method", "fm")
    one_line(capsys, "FID of 1 image (eval.n=1024, 1 held-out): a Fréchet distance", "use eval.n=2 or more")
    assert not runs_dir.exists()


def test_empty_folder(runs_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    bad(capsys, "folder", f"data.path={tmp_path / 'empty'}", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "holds no images")


def test_folder_without_path(runs_dir, capsys):
    bad(capsys, "folder")
    one_line(capsys, "data.path is not set")


def test_non_image_file_named_png(runs_dir, tmp_path, capsys):
    folder = make_folder(tmp_path / "imgs", n=4)
    (folder / "broken.png").write_bytes(b"this is not a png")
    bad(capsys, "folder", f"data.path={folder}", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "broken.png", "not an image")


def test_truncated_image(runs_dir, tmp_path, capsys):
    folder = make_folder(tmp_path / "imgs", n=4, size=(20, 20))
    data = (folder / "img01.png").read_bytes()
    (folder / "img01.png").write_bytes(data[: len(data) // 2])
    bad(capsys, "folder", f"data.path={folder}", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "img01.png")


def test_only_non_image_files(runs_dir, tmp_path, capsys):
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("hello")
    bad(capsys, "folder", f"data.path={tmp_path / 'txt'}", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "holds no images (1 other files)")


def test_mixed_sizes_without_image_size(runs_dir, tmp_path, capsys):
    folder = make_folder(tmp_path / "imgs", n=4, size=(20, 20))
    Image.fromarray(np.zeros((12, 16, 3), np.uint8)).save(folder / "odd.png")
    bad(capsys, "folder", f"data.path={folder}", "data.image_size=null", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "different sizes", "data.image_size")


@pytest.mark.parametrize("preset,needle", [("mnist", "MNIST not found"), ("cifar10", "CIFAR-10 not found")])
def test_missing_dataset_offline(preset, needle, runs_dir, tmp_path, capsys):
    bad(capsys, preset, "data.download=false", f"data.root={tmp_path / 'data'}")
    one_line(capsys, needle, "data.download")
    assert not runs_dir.exists()


def test_missing_mnist_names_the_t10k_only_layout_too(runs_dir, tmp_path, capsys, monkeypatch):
    """The README trains the mnist preset on the two t10k files alone; the missing-files fix named the four files
    of the official layout only, offline (data.download=false) and when the download failed."""
    import torchvision.datasets

    bad(capsys, "mnist", "data.download=false", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "MNIST not found", "or the two t10k-* files alone (a fixed 8,000 / 2,000 split of their digits)")

    def offline(root, **kwargs):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    bad(capsys, "mnist", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "MNIST download into", "or the two t10k-* files alone", "run once on a machine with internet")
    assert not runs_dir.exists()


def test_a_failed_download_does_not_advise_turning_the_download_on(runs_dir, tmp_path, capsys, monkeypatch):
    """data.download is true by default: when the download itself fails (offline), the fix said "or set
    data.download=true", which it already was."""
    import torchvision.datasets

    def offline(root, **kwargs):  # as torchvision: its folders first, then the download fails
        (Path(root) / "MNIST" / "raw").mkdir(parents=True, exist_ok=True)
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    bad(capsys, "mnist", f"data.root={tmp_path / 'data'}")
    line = one_line(capsys, "MNIST download into", "failed (RuntimeError", "run once on a machine with internet")
    assert "set data.download=true" not in line
    assert not runs_dir.exists()
    assert not (tmp_path / "data" / "MNIST").exists()  # the empty folders the failed download made are gone


def test_pool_that_cannot_fit(runs_dir, tmp_path, capsys):
    bad(capsys, "digits", "pool.storage=memory", "pool.ram_gb=0.001", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "trajectory pool needs", "pool.storage=disk")
    assert not (runs_dir / "config.yaml").exists() and not any(runs_dir.glob("*/config.yaml"))


def test_too_many_nsgf_steps(runs_dir, tmp_path, capsys):
    bad(capsys, "digits", "pool.steps=6", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "pool.steps=6", "--method nsgf")


class _Planted:
    """Unpickling this writes a marker file: the attack a pickled cache would allow."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_classifier_cache_is_arrays_never_unpickled(tmp_path):
    import pickle

    from sinkflow import data
    from sinkflow.eval.images import digit_classifier

    target = data.build_distribution("digits", data_cfg={"root": str(tmp_path)})
    clf = digit_classifier(target, str(tmp_path))
    (cache,) = (tmp_path / "cache").glob("classifier-digits-*")
    assert cache.suffix == ".npz"
    with np.load(cache, allow_pickle=False) as z:
        assert set(z.files) == {"coef", "intercept", "classes"}
    x = torch.from_numpy(np.asarray(target.test_images[:50], dtype=np.float32) * (2 / 255) - 1).reshape(50, -1)
    again = digit_classifier(target, str(tmp_path))  # from the cache: the same predictions
    np.testing.assert_allclose(again.predict_proba(x.numpy()), clf.predict_proba(x.numpy()), rtol=1e-6)
    assert (again.predict(x.numpy()) == np.asarray(target.test_labels[:50])).mean() > 0.8

    marker = tmp_path / "pwned"
    cache.write_bytes(pickle.dumps(_Planted(marker)))  # a planted pickle under the cache's name
    refit = digit_classifier(target, str(tmp_path))
    assert not marker.exists()
    np.testing.assert_allclose(refit.predict_proba(x.numpy()), clf.predict_proba(x.numpy()), rtol=1e-5)


def test_classifier_cache_is_not_reused_for_other_images_of_the_same_size(tmp_path):
    """The classifier's cache was keyed on the data's name, shape and image count: other digits of the same size in
    the same data.root (a data set replaced, a label fixed) were scored by the classifier fitted on the old ones."""
    import copy

    from sinkflow import data
    from sinkflow.eval.images import digit_classifier

    target = data.build_distribution("digits", data_cfg={"root": str(tmp_path)})
    digit_classifier(target, str(tmp_path))
    other = copy.copy(target)
    other.labels = (np.asarray(target.labels) + 1) % 10  # the same images, every label moved
    x = np.asarray(target.test_images[:50], dtype=np.float32).reshape(50, -1) * (2 / 255) - 1
    refit = digit_classifier(other, str(tmp_path))
    assert (refit.predict(x) == (np.asarray(target.test_labels[:50]) + 1) % 10).mean() > 0.8
    assert len(list((tmp_path / "cache").glob("classifier-digits-*"))) == 2


@pytest.mark.slow
def test_fd_cnn_on_the_real_digits(tmp_path):
    """On the real t10k split: the classifier is accurate on the held-out digits, and FD-CNN tells real digits
    (the floor) from noise and from blurred digits by orders of magnitude."""
    from helpers import link_t10k, mnist_t10k_dir

    from sinkflow import data
    from sinkflow.eval import fd_cnn

    if mnist_t10k_dir() is None:
        pytest.skip("the real MNIST t10k files are not here (set SINKFLOW_MNIST_DIR or add ../shared/data/mnist-t10k)")
    target = data.build_distribution("mnist", data_cfg={"root": str(link_t10k(tmp_path)), "download": False})
    net, acc = fd_cnn.train_cnn(target, tmp_path)
    assert acc > 0.95
    held_out = fd_cnn.features(net, target.test_images)
    floor = fd_cnn.fd(fd_cnn.features(net, target.images[:500]), held_out)
    noise = fd_cnn.fd(fd_cnn.features(net, torch.rand(500, 1, 28, 28) * 2 - 1), held_out)
    real = torch.from_numpy(np.asarray(target.images[:500], np.float32)) / 127.5 - 1
    blurred = fd_cnn.fd(fd_cnn.features(net, torch.nn.functional.avg_pool2d(real, 5, 1, 2)), held_out)
    assert floor < blurred / 3 and blurred < noise


def test_a_folder_run_keeps_its_data_from_another_directory_and_refuses_a_changed_folder(tmp_path, monkeypatch,
                                                                                           capsys):
    """A run on `data.path=imgs` (relative) records the folder's absolute path, so eval, sample and a resume work
    from any directory (they found no `imgs` there and refused every override that could point at it); images added
    to the folder since are one line before a resume trains or an evaluation scores on them (the added images became
    the test split and the scores changed without a word)."""
    monkeypatch.chdir(tmp_path)
    make_folder(tmp_path / "imgs", n=10, size=(8, 8))
    assert main(["train", "folder", "--method", "fm", *TINY_FM, "data.path=imgs",
                 "data.root=data", "--name", "f", "--no-report"]) == 0
    run = tmp_path / "runs" / "f"
    cfg = RunFolder.open(run).cfg["data"]
    assert cfg["path"] == str(tmp_path / "imgs") and cfg["root"] == str(tmp_path / "data")
    split = json.loads((run / "data_split.json").read_text())
    assert split["path"] == str(tmp_path / "imgs") and len(split["test_files_sha256"]) == 64

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    methods._distributions.cache_clear()
    capsys.readouterr()
    assert main(["eval", str(run), "--n", "1", "--seeds", "1"]) == 0, capsys.readouterr().err
    assert main(["sample", str(run), "--n", "2", "--out", "s.npy"]) == 0
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    assert main(["train", "--resume", str(run), "data.path=../imgs", "--no-report"]) == 0  # the same folder
    capsys.readouterr()

    from helpers import bytes_snapshot
    from sinkflow.data import sources

    cache, decodes = bytes_snapshot(tmp_path / "data"), sum(sources.DECODES.values())
    for i in range(2):  # two more images: they sort last, and the split changes
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "imgs" / f"zz{i}.png")
    methods._distributions.cache_clear()
    assert main(["eval", str(run), "--n", "1", "--seeds", "1"]) == 2
    one_line(capsys, "cannot evaluate", "data changed", "files_sha256", str(tmp_path / "imgs"))
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    assert main(["train", "--resume", str(run), "--no-report"]) == 2
    one_line(capsys, "cannot resume", "data changed", "files_sha256")
    # refused before the changed folder was decoded: the cache of the run's images is as it was
    assert sum(sources.DECODES.values()) == decodes and bytes_snapshot(tmp_path / "data") == cache


def test_a_run_whose_image_folder_moved_names_its_new_place_once(tmp_path, monkeypatch, capsys):
    """data.path is recorded absolute: after the folder moved, eval names the resume that points the run at it, the
    resume checks the files against data_split.json, and eval reads the folder there."""
    import shutil

    monkeypatch.chdir(tmp_path)
    make_folder(tmp_path / "imgs", n=10, size=(8, 8))
    assert main(["train", "folder", "--method", "fm", *TINY_FM, "data.path=imgs", "data.root=data", "--name", "f",
                 "--no-report"]) == 0
    run = tmp_path / "runs" / "f"
    shutil.move(tmp_path / "imgs", tmp_path / "pictures")
    methods._distributions.cache_clear()
    capsys.readouterr()
    assert main(["eval", str(run), "--n", "1", "--seeds", "1"]) == 2
    one_line(capsys, f"image folder {tmp_path / 'imgs'} does not exist",
             "`sinkflow train --resume RUN data.path=NEW_PATH --no-report`")
    assert main(["train", "--resume", str(run), "data.path=pictures", "--no-report"]) == 0
    assert RunFolder.open(run).cfg["data"]["path"] == str(tmp_path / "pictures")
    assert main(["eval", str(run), "--n", "1", "--seeds", "1"]) == 0, capsys.readouterr().err


def test_a_failed_png_folder_write_leaves_no_folder(tmp_path, monkeypatch):
    """`sample --out DIR/` writes into a hidden sibling renamed into place at the end: a write that fails half-way
    (a full disk) leaves neither DIR nor the sibling; a finished one is DIR with every image."""
    from sinkflow.eval.images import save_image_folder

    x = torch.rand(5, 3, 4, 4) * 2 - 1
    real_save, calls = Image.Image.save, []

    def failing_save(self, fp, *a, **k):
        calls.append(fp)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_save(self, fp, *a, **k)

    monkeypatch.setattr(Image.Image, "save", failing_save)
    with pytest.raises(OSError, match="No space"):
        save_image_folder(x, tmp_path / "pngs")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(Image.Image, "save", real_save)
    (tmp_path / "pngs").mkdir()  # an empty folder is taken
    save_image_folder(x, tmp_path / "pngs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pngs"] and len(list((tmp_path / "pngs").iterdir())) == 5


@pytest.mark.parametrize("suffix, fmt", [(".png", "PNG"), (".jpg", "JPEG"), (".tif", "TIFF"), (".webp", "WEBP")])
def test_a_grid_is_written_in_the_format_its_name_says(tmp_path, suffix, fmt):
    """save_grid writes through a temp file (atomically), so it names PIL's format itself: the suffix is not PIL's
    name for .jpg or .tif (KeyError 'JPG' since the grid was first written atomically; a path had always taken it)."""
    from sinkflow.eval.images import save_grid

    out = save_grid(torch.rand(4, 1, 8, 8) * 2 - 1, tmp_path / f"g{suffix}")
    with Image.open(out) as img:
        assert img.format == fmt and img.size[0] > 0


def test_a_disk_too_full_for_the_image_cache_is_one_line_not_a_bus_error(runs_dir, tmp_path, capsys, monkeypatch):
    """The decoded cache is a memory-mapped .npy created sparse: a disk that filled while the images were decoded
    into it killed the process with SIGBUS (no message). Its blocks are reserved when it is created, as the pool's
    are; ENOSPC then is the usual line, and no temp file or half cache is left."""
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    folder = make_folder(tmp_path / "imgs", n=4)
    bad(capsys, "folder", f"data.path={folder}", f"data.root={tmp_path / 'data'}")
    one_line(capsys, "cannot write the image cache", "No space left on device", "data.root")
    assert not [p.name for p in (tmp_path / "data" / "cache").iterdir()]
    assert not runs_dir.exists()


def test_an_image_replaced_by_one_of_the_same_size_is_a_data_change(tmp_path, monkeypatch, capsys):
    """The record holds the files' names and sizes: an image replaced by another of the same byte size (an edited
    BMP, a re-exported PNG) passed it, while its new time made the cache decode the new pixels, and a resume or an
    evaluation went on with other images without a word. The record now holds the decoded pixels' hash too."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.bmp")
    assert main(["train", "folder", "--method", "fm", *TINY_FM, f"data.path={folder}", "data.root=data",
                 "--name", "f", "--no-report"]) == 0
    run = tmp_path / "runs" / "f"
    split = json.loads((run / "data_split.json").read_text())
    assert len(split["train_pixels_sha256"]) == len(split["test_pixels_sha256"]) == 64
    size = (folder / "3.bmp").stat().st_size
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / "3.bmp")  # another image
    assert (folder / "3.bmp").stat().st_size == size
    methods._distributions.cache_clear()
    capsys.readouterr()
    assert main(["eval", str(run), "--n", "1", "--seeds", "1"]) == 2
    one_line(capsys, "cannot evaluate", "data changed", "train_pixels_sha256")
    (run / "checkpoints" / "velocity" / "final.pt").unlink()
    assert main(["train", "--resume", str(run), "--no-report"]) == 2
    one_line(capsys, "cannot resume", "data changed", "train_pixels_sha256")


def test_nsgfpp_counts_each_call_once_when_one_network_plays_two_parts():
    """``sample_nsgfpp`` on networks you hold counted with one hook per part: the velocity network passed again as the
    straight flow counted each of its calls twice (11 network evaluations for 2 + 1 + 3)."""
    from sinkflow.methods.nsgfpp import sample_nsgfpp

    class Field(torch.nn.Module):
        def forward(self, x, t):
            return -x

    class Predictor(torch.nn.Module):
        def forward(self, x):
            return torch.full((len(x),), 0.5)

    field = Field()
    _, info = sample_nsgfpp(field, Predictor(), field, torch.randn(4, 2), [0.0, 0.5, 1.0], [0.5, 0.5], 3)
    assert (info["nfe"], info["nfe_velocity"], info["nfe_time"], info["nfe_nsf"]) == (6, 2, 1, 3)


def test_the_grid_and_strip_are_titled_with_the_data_they_show(tmp_path, monkeypatch):
    """A `digits` run trained on data.target=mnist titled its trajectory strip "digits" over MNIST digits (the
    metrics above it said "mnist (preset digits)"); the figure now names the data, and the preset beside it."""
    import types

    from sinkflow import config
    from sinkflow.eval import images

    titles = []
    path = [torch.zeros(2, 1, 28, 28)] * 3
    monkeypatch.setattr(images, "generate", lambda run, n, steps, seed, record: (path[-1], {"nfe": 9, "path": path}))
    monkeypatch.setattr(images, "save_grid", lambda x, out: out)
    monkeypatch.setattr(images, "trajectory_strip", lambda p, out, k, t, title, **kw: titles.append(title) or out)
    for target, title in (("mnist", "mnist (preset digits) (nsgfpp, NFE 9)"), ("digits", "digits (nsgfpp, NFE 9)")):
        cfg = config.resolve("digits", [f"data.target={target}"], {})
        images.plots(types.SimpleNamespace(cfg=cfg, dir=tmp_path))
        assert titles.pop() == title


def test_scores_on_the_split_a_run_trained_on_are_not_called_held_out(tmp_path, monkeypatch):
    """data.split=test trains on the test images, which the evaluation scores against too: the report said
    "cifar10 held-out split" over them (a warning at the top of the log the only sign). It now says whose they are."""
    import types

    from sinkflow import config
    from sinkflow.eval import images

    make_cifar(tmp_path / "data", per_batch=5, n_test=6)
    monkeypatch.setattr(images, "generate", lambda run, n, steps, seed: (torch.zeros(n, 3, 32, 32), {"nfe": 1}))
    for split, words in (("test", "cifar10 test split, the images this run trained on (data.split=test)"),
                         ("train", "cifar10 held-out split")):
        methods._distributions.cache_clear()
        cfg = config.resolve("cifar10", [f"data.root={tmp_path / 'data'}", "data.download=false", "eval.n=4",
                                         f"data.split={split}"], {})
        result = images.image_metrics(types.SimpleNamespace(cfg=cfg), seeds=1)
        assert result["protocol"]["reference"] == f"{words} (4 of 6 images, fixed subset)"
        assert f"4 generated vs {words}" in images.format_metrics(result)


def test_scores_on_the_validation_split_do_not_call_its_images_held_out(tmp_path, monkeypatch):
    """`sinkflow eval --split val`: the classifier line said "vs 8 held-out real; real held-out confidence" (and
    FD-CNN "vs all N held-out real") over validation digits, which the classifier and the FD-CNN were fitted to with
    the rest of the training split: their confidence is not a held-out one."""
    import types

    from sinkflow import config
    from sinkflow.eval import images

    monkeypatch.setattr(images, "generate", lambda run, n, steps, seed: (torch.zeros(n, 1, 8, 8), {"nfe": 1}))
    methods._distributions.cache_clear()
    cfg = config.resolve("digits", [f"data.root={tmp_path}", "data.val_fraction=0.1", "eval.n=8", "eval.class_n=8"],
                         {"method": "fm"})
    result = images.image_metrics(types.SimpleNamespace(cfg=cfg), seeds=1, split="val")
    text = images.format_metrics(result)
    n_val = len(data.distributions(cfg)[1].val_index)
    assert "8 generated vs 8 validation real; the classifier was fitted to the training split" in text, text
    assert "real validation confidence" in text and f"all {n_val} validation real" in text, text
    assert "held-out real" not in text and "held-out confidence" not in text, text
    test = images.format_metrics(images.image_metrics(types.SimpleNamespace(cfg=cfg), seeds=1))
    assert "8 generated vs 8 held-out real" in test and "real held-out confidence" in test, test


def test_the_strip_titles_each_state_where_the_warped_grid_put_it(tmp_path, monkeypatch):
    """An OT-CFM / FM run sampling on a warped Euler grid (sample.time_warp=0.5, what `sinkflow tune` chooses) had
    its trajectory strip's columns titled t = i/K, the uniform grid's: state 1 of 10 is at 1 - 0.9^0.5 = 0.05."""
    import types

    from sinkflow import config
    from sinkflow.eval import images, plots

    path = [torch.zeros(2, 1, 8, 8)] * 11
    monkeypatch.setattr(images, "generate", lambda run, n, steps, seed, record: (path[-1], {"nfe": 10, "path": path}))
    monkeypatch.setattr(images, "save_grid", lambda x, out: out)
    seen = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, out, **kw: seen.append(
        [ax.get_title() for ax in fig.axes[:8]]) or plots.plt.close(fig) or out)
    cfg = config.resolve("digits", ["sample.time_warp=0.5"], {"method": "otcfm"})
    images.plots(types.SimpleNamespace(cfg=cfg, dir=tmp_path))
    assert seen == [["t=0.00", "t=0.05", "t=0.16", "t=0.23", "t=0.37", "t=0.45", "t=0.68", "t=1.00"]]



def test_a_digits_run_whose_data_root_cannot_be_made_here_samples_and_eval_names_the_resume(runs_dir, tmp_path,
                                                                                               capsys):
    """A run's data.root is absolute, a folder of the machine it trained on (`/workspace/data` on a rented GPU). Copied
    to a laptop, which cannot create it, `sinkflow sample` of a digits run (the set ships with scikit-learn, so it is
    "here") failed writing its decoded cache there, where sampling needs the data's shape alone: it samples, the same
    samples as with the cache; `eval`, which needs the pixels, names the command that points data.root elsewhere."""
    extra, _ = setup_data("digits", tmp_path)
    assert main(["train", "digits", "--method", "fm", *TINY_FM, *extra, "--name", "d", "--no-report"]) == 0
    run = runs_dir / "d"
    assert main(["sample", str(run), "--n", "3", "--out", str(tmp_path / "here.npy")]) == 0
    root = tmp_path / "data"
    root.rename(tmp_path / "moved")
    root.write_text("")  # a file where the folder was: mkdir fails here as it does for a root this user cannot make
    data._distributions.cache_clear()  # a new process on the other machine: nothing of the data built yet
    capsys.readouterr()
    assert main(["sample", str(run), "--n", "3", "--out", str(tmp_path / "away.npy")]) == 0, capsys.readouterr().err
    assert np.array_equal(np.load(tmp_path / "here.npy"), np.load(tmp_path / "away.npy"))
    assert main(["eval", str(run), "--seeds", "1", "--n", "4"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the image cache" in err and "sinkflow train --resume RUN data.root=NEW --no-report" in err


def test_an_inception_weights_path_not_on_this_machine_is_refused_before_the_classifiers(tmp_path, monkeypatch):
    """eval.inception_weights is recorded absolute, a file of the machine the run trained on: `sinkflow eval` of the
    copied run trained the FD-CNN (seconds to minutes) before it refused the path, with a fix ("point it at a local
    file") that `eval`, which takes sample.* keys only, could not apply. Refused first, naming the resume that
    sets it."""
    from sinkflow import config
    from sinkflow.eval import images as eval_images

    extra, _ = setup_data("digits", tmp_path)
    cfg = config.resolve("digits", [*extra, f"eval.inception_weights={tmp_path / 'gpu-box' / 'pt_inception.pth'}"])
    monkeypatch.setattr(eval_images, "digit_classifier", lambda *a: pytest.fail("a classifier before the refusal"))
    with pytest.raises(SinkflowError, match="is not a file") as exc:
        eval_images.held_out(cfg, "test", 8)
    assert "sinkflow train --resume RUN eval.inception_weights=PATH --no-report" in exc.value.fix


def test_a_data_root_whose_parent_this_user_cannot_make_is_a_cache_not_writable(tmp_path, monkeypatch):
    """`/workspace/data` on a laptop: mkdir of the cache folder climbs to `/workspace`, whose EACCES names that
    folder, not the cache's; only an error naming the cache folder or a file in it was the unwritable cache, so this,
    the case the stand-in was made for, came out as a bare PermissionError, not `CacheNotWritable` (which sampling
    stands the data in for, and eval names the resume for). Planted: os.mkdir refuses the ancestor, as for non-root."""
    import errno
    import os

    from sinkflow import config
    from sinkflow.data.images import CacheNotWritable, build_image_distribution

    gpu_box = tmp_path / "workspace"
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if os.fspath(path) == os.fspath(gpu_box):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    cfg = config.resolve("digits", [f"data.root={gpu_box / 'data'}"])
    with pytest.raises(CacheNotWritable, match="cannot write the image cache") as exc:
        build_image_distribution("digits", cfg["data"])
    assert "data.root=NEW" in exc.value.fix and not gpu_box.exists()
