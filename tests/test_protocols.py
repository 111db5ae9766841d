"""The two 2D evaluation protocols (issue 26): eval.protocol=iid draws i.i.d. (not QMC, not stratified), and a point
file's held-out rows (data.test_rows) are the test points and are never drawn for training."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch

from sinkflow import config, data
from sinkflow.cli import main
from sinkflow.data import EightGaussians, Normal, build_distribution, iid_twin, qmc_twin
from sinkflow.data.toy2d import EIGHT_CENTRES
from sinkflow.errors import SinkflowError
from sinkflow.eval.points import protocol_pair
from helpers import TINY_2D


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_an_iid_normal_draw_is_iid_not_qmc():
    """The mean of n i.i.d. N(0, 1) points varies by 1/sqrt(n) between draws; a scrambled-Sobol draw's by far less."""
    iid, qmc = iid_twin(Normal((2,), qmc=True)), qmc_twin(Normal((2,)))
    assert not iid.qmc and qmc.qmc
    n = 1024
    iid_means = [float(iid.sample(n, gen(s))[:, 0].mean()) for s in range(40)]
    qmc_means = [float(qmc.sample(n, gen(s))[:, 0].mean()) for s in range(40)]
    assert 0.6 / n**0.5 < statistics.stdev(iid_means) < 1.5 / n**0.5
    assert statistics.stdev(qmc_means) < 0.2 / n**0.5


def _mode_imbalance(x: torch.Tensor, radius: float) -> float:
    labels = torch.cdist(x.double(), radius * EIGHT_CENTRES).argmin(1)
    counts = torch.bincount(labels, minlength=8).double()
    return float((counts - len(x) / 8).abs().sum())


def test_an_iid_8gaussians_draw_has_multinomial_mode_counts():
    """The stratified sampler puts n/8 points in each mode; its i.i.d. twin has multinomial counts (sum of
    |n_k - n/8| about 68 at n = 1024), as a user's own sampling would."""
    strat = EightGaussians()
    iid = iid_twin(strat)
    assert not iid.stratified and not iid.qmc and strat.stratified
    n = 1024
    assert max(_mode_imbalance(strat.sample(n, gen(s)), strat.radius) for s in range(10)) <= 8
    imb = statistics.fmean(_mode_imbalance(iid.sample(n, gen(s)), iid.radius) for s in range(10))
    assert 35 < imb < 110, imb


@pytest.mark.parametrize("spec", ["moons", "scurve", "checkerboard"])
def test_iid_twins_of_the_stratified_samplers_are_unstratified(spec):
    d = build_distribution(spec)
    twin = iid_twin(d)
    assert d.stratified and not twin.stratified and type(twin) is type(d)


def test_sampling_draws_an_8gaussians_source_iid_as_it_says():
    """`sinkflow sample` / `Run.sample` said "an i.i.d. source draw" and drew the stratified sampler's exactly n/8
    points per centre; the iid protocol's source (what a user's sampling gives) differed from the sample's."""
    from sinkflow.data import sampling_source

    cfg = config.resolve("8gaussians-moons")
    src = sampling_source(cfg)
    assert not src.stratified and not src.qmc and sampling_source(cfg, qmc=True).qmc
    imb = statistics.fmean(_mode_imbalance(src.sample(1024, gen(s)), src.radius) for s in range(10))
    assert 35 < imb < 110, imb
    assert torch.equal(src.sample(64, gen(0)), protocol_pair(cfg, "iid")[0].sample(64, gen(0)))


def test_protocol_pair_follows_eval_protocol():
    cfg = config.resolve("8gaussians")
    src, tgt = protocol_pair(cfg)  # the default: qmc
    assert cfg["eval"]["protocol"] == "qmc" and src.qmc and tgt.stratified
    src, tgt = protocol_pair(config.resolve("8gaussians", ["eval.protocol=iid"]))
    assert isinstance(src, Normal) and not src.qmc and not tgt.stratified


def _marked_file(path, rows=200, held=64):
    """Training rows near the origin, then ``held`` rows far away at x = 1000 + i: any draw of one is visible."""
    pts = np.random.default_rng(0).normal(size=(rows, 2))
    pts[rows - held:] = np.stack([1000.0 + np.arange(held), np.zeros(held)], 1)
    np.save(path, pts.astype(np.float32))
    return pts.astype(np.float32)


def test_held_out_rows_are_the_test_set_and_never_sampled(tmp_path):
    pts = _marked_file(tmp_path / "p.npy")
    d = build_distribution(str(tmp_path / "p.npy"), data_cfg={"test_rows": 64})
    assert float(d.sample(100_000, gen(0))[:, 0].max()) < 100  # no training draw is a held-out row
    assert torch.equal(d.test_set(64), torch.from_numpy(pts[-64:]))  # all of them, whatever the seed
    sub = d.test_set(32, seed=3)
    assert len({tuple(r) for r in sub.tolist()}) == 32 and float(sub[:, 0].min()) >= 1000
    with pytest.raises(SinkflowError, match="holds out only data.test_rows=64"):
        d.test_set(65)
    whole = build_distribution(str(tmp_path / "p.npy"), data_cfg={})  # test_rows=0: nothing held out
    assert float(whole.sample(100_000, gen(0))[:, 0].max()) >= 1000
    with pytest.raises(SinkflowError, match="too many"):
        build_distribution(str(tmp_path / "p.npy"), data_cfg={"test_rows": 190})
    # a source file is drawn from whole: test_rows is the target's
    src, tgt = data.distributions(config.resolve("moons", [f"data.source={tmp_path / 'p.npy'}",
                                                           f"data.target={tmp_path / 'p.npy'}", "data.test_rows=64"]))
    assert len(src.points) == 200 and len(tgt.points) == 136


@pytest.mark.parametrize("method", ["nsgf", "otcfm"])
def test_runs_never_train_on_the_held_out_rows(method, runs_dir, tmp_path):
    """End to end: every training draw (the NSGF pool's target batches, OT-CFM's pairs) misses the held-out rows."""
    _marked_file(tmp_path / "p.npy")
    tiny = [a for a in TINY_2D if method == "nsgf" or not a.startswith("pool.")]  # OT-CFM reads no pool key
    args = ["train", "moons", "--method", method, *tiny, f"data.target={tmp_path / 'p.npy'}",
            "data.test_rows=64", "eval.protocol=iid", "--no-report"]
    assert main([*args, "--name", "held"]) == 0
    run = runs_dir / "held"
    if method == "nsgf":  # the pool's Sinkhorn diameter spans every source and target point its batches drew
        assert json.loads((run / "pool" / "progress.json").read_text())["diameter"] < 100
        assert main([a for a in args if a != "data.test_rows=64"] + ["--name", "all", "eval.n=64"]) == 0
        assert json.loads((runs_dir / "all" / "pool" / "progress.json").read_text())["diameter"] > 900
    else:  # OT-CFM's training batches: x_t + (1 - t) v is the target endpoint
        from sinkflow import methods

        cfg = config.resolve("moons", [
            "experiment.method=otcfm", f"data.target={tmp_path / 'p.npy'}", "data.test_rows=64"])
        source, target = data.distributions(cfg)
        step = methods.of(cfg).phases(cfg, source, target)[0]
        x, t, v = step.batch(gen(0), 4096, "cpu")
        assert float((x + (1 - t.view(-1, 1)) * v)[:, 0].max()) < 100


def test_eval_n_above_the_held_out_rows_is_refused_before_work(runs_dir, tmp_path, capsys):
    _marked_file(tmp_path / "p.npy")
    code = main(["train", "moons", *TINY_2D, f"data.target={tmp_path / 'p.npy'}", "data.test_rows=32",
                 "--name", "refused"])
    assert code == 2
    err = capsys.readouterr().err
    assert "eval.n=64" in err and "data.test_rows" in err and len(err.strip().splitlines()) == 1
    assert not (runs_dir / "refused").exists()


def test_eval_protocol_iid_is_named_in_the_report(runs_dir, tmp_path, capsys, monkeypatch):
    """... and the figures are titled with the user's data, not the preset's ("moons" over the user's points)."""
    from sinkflow.eval import plots

    titles, real = [], plots.scatter_samples
    monkeypatch.setattr(plots, "scatter_samples", lambda x, y, path, title: titles.append(title) or real(x, y, path, title))
    _marked_file(tmp_path / "p.npy", held=64)
    assert main(["train", "moons", *TINY_2D, f"data.target={tmp_path / 'p.npy'}", "data.test_rows=64",
                 "eval.protocol=iid", "--name", "r"]) == 0
    out = capsys.readouterr().out
    assert "eval.protocol=iid" in out and f"normal -> {tmp_path / 'p.npy'} (nsgf)" in out
    assert titles == ["normal -> p.npy (nsgf, 100 network evaluations)"]


def test_the_report_figures_are_drawn_by_the_runs_own_sampler(tiny_run, tmp_path, monkeypatch):
    """samples.png and trajectories.png were drawn at 100 steps whatever the run sampled with: an NSGF++ run of 3
    straight-flow steps (scored so in the table above) had figures of 105 network evaluations. They are drawn as
    `sinkflow sample` draws: here the run's sample.steps=7."""
    import shutil

    from sinkflow.eval import plots, points
    from sinkflow.runtime.run_folder import RunFolder

    titles = []
    monkeypatch.setattr(plots, "scatter_samples", lambda x, y, path, title: titles.append((title, len(x))) or path)
    monkeypatch.setattr(plots, "trajectories", lambda p, path, title: titles.append((title, p.shape[0])) or path)
    folder = shutil.copytree(tiny_run, tmp_path / "r")
    run = RunFolder.open(folder).variant(sample={"steps": 7})
    points.plots(run, n=32)
    assert titles == [("moons (nsgf, 7 network evaluations)", 32), ("moons (nsgf, 7 network evaluations)", 8)]


def test_one_dimensional_paths_are_drawn_against_the_sampling_step_not_a_made_up_time(tmp_path, monkeypatch):
    """trajectories.png of (N, 1) points spaced every state evenly on an axis labelled "flow time" from 0 to 1,
    which a warped grid (sample.time_warp), NSGF's flow time (sum of eta) and NSGF++'s NSGF steps then straight
    flow from t_hat are not: the axis is the sampling step, 0 (source) to K (generated)."""
    from sinkflow.eval import plots

    seen = {}
    monkeypatch.setattr(plots, "_save", lambda fig, ax, title, path, **kw: seen.update(
        label=ax.get_xlabel(), ends=[c.get_offsets()[0, 0] for c in ax.collections]) or plots.plt.close(fig) or path)
    plots.trajectories(torch.randn(6, 4, 1), tmp_path / "t.png")
    assert seen == {"label": "sampling step", "ends": [0.0, 5.0]}


def test_a_quick_eval_names_and_records_its_sample_count_and_seeds(tiny_run, tmp_path, capsys):
    """`sinkflow eval --n 64 --seeds 1` printed the run's header and "+- 0.000", and recorded its scores under the
    keys and step of the run's own evaluation: `status` then showed the quick look as the run's scores."""
    import shutil

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    assert main(["eval", str(run), "--n", "48", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "48 samples per seed, one seed (no spread):" in out and "+-" not in out, out
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert (record["phase"], record["n"], record["seeds"], record["protocol"]) == ("eval", 48, 1, "qmc")
    assert main(["status", str(run)]) == 0
    assert "n 48, seeds 1, protocol qmc" in capsys.readouterr().out
    assert main(["eval", str(run)]) == 0
    assert "64 samples per seed, mean +- std over 2 seeds:" in capsys.readouterr().out  # the run's eval.n, eval.seeds


@pytest.mark.parametrize("extra", [[], ["data.source={src}"]], ids=["built-in target", "source file"])
def test_test_rows_without_a_target_point_file_is_refused(runs_dir, tmp_path, capsys, extra):
    """`data.test_rows=50` on a built-in target, or with only the source a file, trained with nothing held out and
    config.yaml saying 50 (the source is never held out: it is drawn, not scored against)."""
    np.save(tmp_path / "src.npy", np.random.default_rng(0).normal(size=(300, 2)).astype(np.float32))
    argv = [a.format(src=tmp_path / "src.npy") for a in extra]
    assert main(["train", "moons", *TINY_2D, *argv, "data.test_rows=50", "--name", "t"]) == 2
    err = capsys.readouterr().err
    assert "'data.test_rows' is not read by this run" in err and "a point file as data.target" in err, err
    assert not (runs_dir / "t").exists()


def test_sampling_with_qmc_draws_a_source_without_a_twin_iid_and_says_so(runs_dir, capsys):
    """`sample --qmc` (and Run.sample(qmc=True)) on a source without a scrambled-Sobol twin drew the stratified pool
    sampler, neither QMC nor i.i.d., and said "from a QMC source draw"; it draws i.i.d. and says QMC was not there."""
    from helpers import run_main

    from sinkflow.data import sampling_source

    cfg = config.resolve("moons", ["data.source=scurve"], {"method": "fm"})
    src = sampling_source(cfg, qmc=True)
    assert not src.stratified and torch.equal(src.sample(64, gen(0)), sampling_source(cfg).sample(64, gen(0)))
    assert run_main(capsys, "train", "moons", "--method", "fm", "data.source=scurve", "--train-iters", "1",
                    "--device", "cpu", "--no-report", "--name", "s")[0] == 0
    capsys.readouterr()
    assert main(["sample", str(runs_dir / "s"), "--n", "4", "--steps", "1", "--qmc", "--out", "s.npy"]) == 0
    out = capsys.readouterr().out
    assert ("from an i.i.d. source draw (QMC asked for, but source scurve has no scrambled-Sobol twin) "
                        "to s.npy") in out, out


def test_the_w2_table_names_a_stratified_source_without_a_twin_as_drawn():
    """Under eval.protocol=qmc a source without a scrambled-Sobol twin is drawn as itself (``protocol_pair``): the
    stratified sampler for data.source=scurve, which the table's header called "i.i.d. source draws"."""
    from sinkflow.eval.points import draws

    cfg = config.resolve("moons", ["data.source=scurve"], {"method": "fm"})
    assert protocol_pair(cfg)[0].stratified
    assert draws(cfg).startswith("stratified source draws (no QMC twin) vs ")
    assert draws(cfg, "iid").startswith("i.i.d. source draws vs ") and not protocol_pair(cfg, "iid")[0].stratified


def test_sample_never_writes_over_the_runs_point_file(runs_dir, tmp_path, capsys):
    """`sample RUN --out points.npy` on a run trained on data.target=points.npy replaced the training set with the
    samples (the next evaluation scored them against themselves); a path beside it is written as asked."""
    _marked_file(tmp_path / "p.npy")
    before = (tmp_path / "p.npy").read_bytes()
    assert main(["train", "moons", "--method", "fm", f"data.target={tmp_path / 'p.npy'}", "data.test_rows=16",
                 "eval.n=16", "--train-iters", "1", "--device", "cpu", "--no-report", "--name", "r"]) == 0
    capsys.readouterr()
    assert main(["sample", str(runs_dir / "r"), "--n", "4", "--steps", "1", "--out", str(tmp_path / "p.npy")]) == 2
    err = capsys.readouterr().err
    assert "is in the run's own data (data.target), which samples would replace" in err and len(err.splitlines()) == 1
    assert (tmp_path / "p.npy").read_bytes() == before
    assert main(["sample", str(runs_dir / "r"), "--n", "4", "--steps", "1", "--out", str(tmp_path / "q.npy")]) == 0


def test_sample_never_writes_into_the_runs_image_folder(tmp_path):
    """An image folder (data.path) is read recursively: `--out DATA/gen/` put the samples into the data set."""
    from pathlib import Path

    from sinkflow.cli.sample import data_entry

    cfg = {"data": {"source": "normal", "target": "folder", "path": str(tmp_path / "imgs")}}
    assert data_entry(cfg, tmp_path / "imgs" / "gen") == "data.path"
    assert data_entry(cfg, tmp_path / "imgs2" / "gen") is None
    assert data_entry({"data": {"source": "normal", "target": "mnist", "path": None}}, Path("s.npy")) is None
