"""Every 2D preset end to end with tiny counts: train, checkpoint, resume, sample, eval."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sinkflow import config
from sinkflow.cli import main
from helpers import tiny_2d

PRESETS_2D = [p for p in config.preset_names() if config.load_preset(p)["experiment"]["method"] == "nsgf"]


def train(name, *extra, method="nsgf"):
    return main(["train", *extra, *tiny_2d(method), "--name", name])


def test_no_preset_named_trains_the_default_preset(runs_dir, capsys):
    """`make demo` runs `sinkflow train` with no preset: the default preset, its name written into config.yaml."""
    tiny = [a for a in tiny_2d("nsgf") if not a.startswith("--name")]
    assert main(["train", *tiny, "--name", "d", "--no-report"]) == 0
    from sinkflow.runtime.run_folder import read_config

    assert read_config(runs_dir / "d")["experiment"]["preset"] == "8gaussians-moons"


@pytest.mark.parametrize("preset", PRESETS_2D)
def test_preset_end_to_end(preset, runs_dir, capsys):
    assert train("r", preset) == 0
    out = capsys.readouterr().out
    run = runs_dir / "r"
    assert "W2" in out and "eval.protocol=qmc" in out
    assert "paper" not in out  # the paper has W2 at 10 and 100 steps only: no column at 2 / 4
    for f in ("config.yaml", "meta.json", "metrics.jsonl", "samples.png", "trajectories.png", "status.json",
              "checkpoints/pool/final.pt", "checkpoints/velocity/final.pt", "pool/x.npy"):
        assert (run / f).is_file(), f
    assert list((run / "tb").rglob("events.out.tfevents.*"))
    meta = json.loads((run / "meta.json").read_text())
    assert meta["seed"] == 0 and "torch" in meta["versions"]
    pool_x = np.load(run / "pool" / "x.npy")
    assert pool_x.shape == (2 * 4 * 32, 2) and np.isfinite(pool_x).all() and np.abs(pool_x).sum() > 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["phase"] == "velocity"]
    assert steps == [2, 4, 6]
    # resume of a finished run: every phase is skipped, nothing is retrained
    final = (run / "checkpoints/velocity/final.pt").stat().st_mtime_ns
    assert main(["train", "--resume", str(run), "--no-report"]) == 0
    assert (run / "checkpoints/velocity/final.pt").stat().st_mtime_ns == final
    # sample to .npy and .png, eval
    assert main(["sample", str(run), "--n", "50", "--steps", "3", "--out", str(runs_dir / "s.npy")]) == 0
    s = np.load(runs_dir / "s.npy")
    assert s.shape == (50, 2) and np.isfinite(s).all()
    assert main(["sample", str(run), "--n", "50", "--out", str(runs_dir / "s.png")]) == 0
    assert (runs_dir / "s.png").stat().st_size > 1000
    capsys.readouterr()
    assert main(["eval", str(run), "--seeds", "2", "--n", "64"]) == 0
    out = capsys.readouterr().out
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])  # each W2 with its spread over seeds
    steps, spread = re.search(r"^ +(\d+) +\d+ +[0-9.]+ \+- ([0-9.]+)", out, re.M).groups()
    assert (record["phase"], record["n"], record["seeds"]) == ("eval", 64, 2)
    assert record[f"w2_std_{steps}"] == pytest.approx(float(spread), abs=1e-3) and record[f"w2_std_{steps}"] > 0
    assert all(record[f"nfe_{s}"] == s for s in (2, 4))  # NSGF: one network evaluation a step


def test_a_2d_nsgfpp_record_names_each_rows_nfe(runs_dir, capsys):
    """A 2-D evaluation record held W2 per step count and no NFE: NSGF++'s step counts are its straight flow's, so
    `w2_4` did not say it took 5 NSGF + 1 predictor + 4 straight-flow evaluations, which the printed table and
    every image record say."""
    assert train("pp", "moons", "--method", "nsgfpp", "train.nsf.iters=6", "train.time.iters=6", method="nsgfpp") == 0
    out = capsys.readouterr().out
    record = json.loads((runs_dir / "pp" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["phase"] == "eval"
    rows = re.findall(r"^ +(\d+) +(\d+) +[0-9.]+", out, re.M)
    assert rows and all(record[f"nfe_{steps}"] == int(nfe) > int(steps) for steps, nfe in rows)


@pytest.mark.parametrize("method", ["fm", "otcfm"])
def test_baselines_in_the_same_runner(method, runs_dir):
    assert train("b", "moons", "--method", method, method=method) == 0
    run = runs_dir / "b"
    assert (run / "checkpoints/velocity/final.pt").is_file()
    assert not (run / "pool").exists()  # flow matching is simulation-free


def test_sampling_counts_network_evaluations(runs_dir):
    from sinkflow.eval.points import generate
    from sinkflow.runtime.run_folder import RunFolder

    assert train("n", "moons", "--no-report") == 0
    x, info = generate(RunFolder.open(runs_dir / "n"), 16, 7, seed=0)
    assert info["nfe"] == 7 and x.shape == (16, 2)


def test_user_points_as_target(runs_dir, tmp_path):
    pts = torch.randn(500, 2).numpy() * 0.5 + 3
    np.save(tmp_path / "points.npy", pts)
    assert train("u", "moons", f"data.target={tmp_path / 'points.npy'}", "--no-report") == 0


def test_resume_refuses_shape_change(runs_dir, capsys):
    assert train("c", "moons", "--no-report") == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(runs_dir / "c"), "model.velocity.hidden=128"]) == 2
    assert "cannot resume" in capsys.readouterr().err


def test_existing_run_folder_is_not_overwritten(runs_dir, capsys):
    assert train("d", "moons", "--no-report") == 0
    before = (runs_dir / "d" / "config.yaml").read_text()
    assert train("d", "moons", "--no-report") == 2
    assert "already exists" in capsys.readouterr().err
    assert (runs_dir / "d" / "config.yaml").read_text() == before


def test_runs_started_in_the_same_second_get_folders_of_their_own(runs_dir, monkeypatch):
    """An automatic name (<preset>-<method>-<time>) counts seconds: a loop of short runs (a notebook's seed sweep)
    stopped at its second run with "run folder ... already exists; resume it", a folder the user never named."""
    import sinkflow
    from sinkflow.runtime import run_folder

    monkeypatch.setattr(run_folder.time, "strftime", lambda fmt, *a: "20261130-120000" if "%H" in fmt else "x")
    runs = [sinkflow.train("moons", method="otcfm", device="cpu", runs_dir=runs_dir, train_iters=1, seed=s).dir.name
            for s in range(3)]
    assert runs == ["moons-otcfm-20261130-120000", "moons-otcfm-20261130-120000-2", "moons-otcfm-20261130-120000-3"]


def test_run_folder_from_an_older_sinkflow_gets_new_keys_defaulted(runs_dir):
    import yaml

    assert train("old", "moons", "--no-report") == 0
    path = runs_dir / "old" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    del cfg["sample"]["batch_size"]  # a key added after this run was made
    path.write_text(yaml.safe_dump(cfg))
    assert main(["sample", str(runs_dir / "old"), "--n", "8", "--out", str(runs_dir / "o.npy")]) == 0
    assert np.load(runs_dir / "o.npy").shape == (8, 2)


def test_sample_takes_sample_overrides_without_changing_the_run(runs_dir, capsys):
    assert train("so", "moons", "--no-report") == 0
    before = (runs_dir / "so" / "config.yaml").read_text()
    assert main(["sample", str(runs_dir / "so"), "sample.batch_size=3", "--n", "7", "--out",
                 str(runs_dir / "a.npy")]) == 0
    assert np.load(runs_dir / "a.npy").shape == (7, 2)
    assert (runs_dir / "so" / "config.yaml").read_text() == before
    capsys.readouterr()
    assert main(["sample", str(runs_dir / "so"), "pool.eta=0.1", "--out", str(runs_dir / "b.npy")]) == 2
    assert "only takes sample.* overrides" in capsys.readouterr().err


def test_eval_takes_sample_overrides_and_its_record_names_them(runs_dir, capsys):
    """`sinkflow eval RUN sample.time_warp=0.5` scores another sampler of the same run (a knob chosen on validation)
    without changing config.yaml; its printed output and its metrics.jsonl record say what it sampled with, the plain
    one says nothing."""
    import json

    assert train("ev", "moons", "--no-report") == 0
    run = runs_dir / "ev"
    before = (run / "config.yaml").read_text()
    evals = lambda: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                     if json.loads(line).get("phase") == "eval"]
    assert main(["eval", str(run), "--n", "64", "--seeds", "1"]) == 0
    assert "sampled with" not in capsys.readouterr().out
    assert main(["eval", str(run), "sample.time_warp=0.5", "--n", "64", "--seeds", "1"]) == 0
    # the printed table said nothing of the override (its record did): now its first line (audit HH)
    assert capsys.readouterr().out.startswith("sampled with sample.time_warp=0.5 for this evaluation (recorded with "
                                              "its scores; the run's config.yaml keeps its own)\n")
    plain, warped = evals()[-2:]
    assert "sample" not in plain and warped["sample"] == {"time_warp": 0.5}
    w2 = [k for k in plain if k.startswith("w2_") and "_std" not in k]
    assert w2 and all(plain[k] != warped[k] for k in w2)  # another Euler grid, other samples
    assert (run / "config.yaml").read_text() == before
    capsys.readouterr()
    assert main(["eval", str(run), "eval.n=8"]) == 2  # not a sampling key: one line, nothing scored
    err = capsys.readouterr().err
    assert "`sinkflow eval` only takes sample.* overrides" in err and "use --n 8 for this call" in err
    assert main(["eval", str(run), "train.velocity.lr=0.1"]) == 2 and len(evals()) == 2  # no flag: the resume
    assert f"change other keys with `sinkflow train --resume {run} ...`" in capsys.readouterr().err
    assert main(["eval", str(run), "--split", "val"]) == 2  # fresh test draws: no validation split to choose on
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moons is not an image set, so it has no validation split" in err[0] and len(evals()) == 2


@pytest.mark.parametrize("iters,warned_key,quiet_key,line", [
    # a warm-up as long as the run ends still warming up: the cosine never decays
    (4, "train.velocity.warmup=5", "train.velocity.warmup=3", "train.velocity.warmup=5 >= train.velocity.iters=4: the "
     "rate is still warming up at the last step (cosine never decays); lower train.velocity.warmup"),
    # without its warm-up, EMA 0.9 over 30 steps keeps 0.9^29 = 4.7 % of the first step's weights; the largest decay
    # that keeps under 1 % is 0.01^(1/29) = 0.85317, to 4 decimals down; 0.8 keeps 0.15 %
    (30, "train.velocity.ema=0.9", "train.velocity.ema=0.8", "train.velocity.ema=0.9 over train.velocity.iters=30 "
     "keeps 4.7 % of the first step's weights in the averaged model the sampler uses; set "
     "train.velocity.ema_warmup=true or train.velocity.ema=0.8531 or lower, or train longer"),
])
def test_a_setting_the_run_is_too_short_for_is_warned_about(runs_dir, caplog, iters, warned_key, quiet_key, line):
    """Said before the first step, once; the same setting that fits the run is not warned about."""
    args = ["train", "moons", "--method", "fm", "--train-iters", str(iters), "--batch-size", "8", "--device", "cpu",
            "--no-report", "train.velocity.ema_warmup=false"]
    with caplog.at_level("WARNING"):
        assert main([*args, warned_key, "--name", "warned"]) == 0
        assert main([*args, quiet_key, "--name", "quiet"]) == 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [line]


def test_pool_seed_fixes_the_pool_across_experiment_seeds(runs_dir):
    """pool.seed draws the pool; experiment.seed still seeds the network: two runs of different experiment seeds on
    one pool.seed hold the same pool and train different networks, and a pool.seed of null is experiment.seed's."""
    assert train("a", "moons", "experiment.seed=1", "--no-report") == 0
    assert train("b", "moons", "experiment.seed=2", "pool.seed=1", "--no-report") == 0
    assert train("c", "moons", "experiment.seed=2", "--no-report") == 0
    a, b, c = (np.load(runs_dir / r / "pool" / "x.npy", allow_pickle=False) for r in "abc")
    assert np.array_equal(a, b) and not np.array_equal(b, c)
    wa, wb = (torch.load(runs_dir / r / "checkpoints/velocity/final.pt", weights_only=True)["model"] for r in "ab")
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


def test_an_automatic_name_another_process_takes_first_is_not_refused(runs_dir, monkeypatch):
    """Jobs of an array started in the same second: each found the automatic name free, the second to create it
    was refused with "run folder ... already exists; resume it", a folder its user never named. The name is claimed
    by creating its folder, so the loser takes the next one."""
    import sinkflow
    from sinkflow.runtime import run_folder

    base = "moons-otcfm-20261130-120000"
    monkeypatch.setattr(run_folder.time, "strftime", lambda fmt, *a: "20261130-120000" if "%H" in fmt else "x")
    (runs_dir / base).mkdir(parents=True)
    (runs_dir / base / "config.yaml").write_text("experiment: {}\n")  # the other job's run, made while this one looked
    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: False if p.name == base else exists(p))  # it looked before
    run = sinkflow.train("moons", method="otcfm", device="cpu", runs_dir=runs_dir, train_iters=1)
    assert run.dir.name == f"{base}-2" and (runs_dir / base / "config.yaml").read_text() == "experiment: {}\n"
