"""`sinkflow tune RUN`: a trained image run's sampler chosen on its validation images (sinkflow/tools/tune.py)."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import error_line
from sinkflow import config, data
from sinkflow.cli import main
from sinkflow.runtime.run_folder import RunFolder
from sinkflow.tools import tune
from test_images import TINY, TINY_FM, fresh_distributions, setup_data  # noqa: F401  (the fixture is autouse)

ROW = re.compile(r"^ +(-?[\d.]+(?: +-?[\d.]+)*) +([\d.]+)(  <- best|  \(the run's own\))?(?:  \(the samples of .*\))?$")


def rows(out: str) -> list[tuple[list[float], float, str]]:
    """(settings, score, mark) of each candidate line `sinkflow tune` printed."""
    got = []
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            *settings, = map(float, m.group(1).split())
            got.append((settings, float(m.group(2)), (m.group(3) or "").strip()))
    return got


def test_nsgfpp_samplers_are_scored_on_validation_and_the_best_is_what_eval_scores(runs_dir, tmp_path, capsys):
    """Every k x t̂ shift at the budget is scored against the validation split (the test split is never drawn), the
    lowest is named with the commands that use it, the scores go to RUN/tune.json and config.yaml is untouched; the
    chosen settings scored by `sinkflow eval --split val` give the same number (the candidates are really applied)."""
    extra, _ = setup_data("digits", tmp_path)
    assert main(["train", "digits", *TINY, *extra, "data.val_fraction=0.1", "--name", "v", "--no-report"]) == 0
    run = runs_dir / "v"
    before = (run / "config.yaml").read_bytes()
    capsys.readouterr()
    target = data.distributions(RunFolder.open(run).cfg)[1]
    drawn = []
    real = type(target).test_set
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(target), "test_set", lambda self, n=None: drawn.append(n) or real(self, n))
        rc = main(["tune", str(run), "--nfe", "6", "--n", "16"])
    out = capsys.readouterr().out
    assert rc == 0 and drawn == []
    got = rows(out)
    splits = {(int(k), int(nsf)) for (k, nsf, _), _, _ in got}
    assert splits == {(k, 6 - 1 - k) for k in tune.nsgf_splits(6)} and len(got) == 3 * len(tune.T_SHIFTS)
    assert {s for (_, _, s), _, _ in got} == set(tune.T_SHIFTS)
    for line in out.splitlines():  # a row marked as another's samples scored as that one did
        if "(the samples of" in line:
            m = ROW.match(line)
            mine = dict(zip(("nsgf_steps", "nsf_steps", "t_shift"), map(float, m.group(1).split())))
            named = {**mine, **{k: float(v) for k, v in (kv.split("=") for kv in
                                                         line.split("(the samples of ")[1].rstrip(")").split())}}
            assert named != mine, line
            twin = [v for settings, v, _ in got if settings == list(named.values())]
            assert twin == [float(m.group(2))], line
    best = [g for g in got if g[2] == "<- best"]
    assert len(best) == 1 and best[0][1] == min(v for _, v, _ in got)
    (k, nsf, shift), value, _ = best[0]
    choice = f"sample.nsgf_steps={int(k)} sample.nsf_steps={int(nsf)} sample.t_shift={shift:g}"
    assert f"best at 6 NFE: {choice}: FD-CNN {value:.2f} on validation" in out
    assert f"sinkflow eval {run} {choice}" in out
    assert (run / "config.yaml").read_bytes() == before
    record = json.loads((run / "tune.json").read_text())["6"]
    assert (record["metric"], record["split"], record["n"]) == ("fd_cnn", "val", 16)
    assert record["best"] == {"nsgf_steps": int(k), "nsf_steps": int(nsf), "t_shift": shift}
    assert main(["eval", str(run), "--split", "val", "--n", "16", "--seeds", "1", *choice.split()]) == 0
    scored = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert scored["split"] == "val" and scored[f"fd_cnn_{int(nsf)}"] == pytest.approx(value, abs=0.005)


@pytest.mark.parametrize("preset", ["digits", "mnist"])
def test_a_baseline_tries_its_grid_warps_and_its_own_sampler_is_marked(preset, runs_dir, tmp_path, capsys):
    """FM at the run's own budget (sample.steps), at (N, 1, 8, 8) and (N, 1, 28, 28): the four Euler-grid warps, the
    run's own (uniform) among them and marked as such unless it is the best; a second budget is added to tune.json
    beside the first."""
    extra, _ = setup_data(preset, tmp_path)
    assert main(["train", preset, "--method", "fm", *TINY_FM, *extra, "sample.steps=3", "data.val_fraction=0.2",
                 "--name", "f", "--no-report"]) == 0
    capsys.readouterr()
    held = len(data.distributions(RunFolder.open(runs_dir / "f").cfg)[1].val_index)
    n = str(min(16, held))
    rc, out = main(["tune", str(runs_dir / "f"), "--n", n]), capsys.readouterr().out
    assert rc == 0 and "samplers at 3 NFE" in out
    got = rows(out)
    assert sorted(w for (_, w), _, _ in got) == sorted(tune.WARPS) and all(s == 3 for (s, _), _, _ in got)
    uniform = next(g for g in got if g[0][1] == 1.0)
    assert uniform[2] in ("<- best", "(the run's own)")
    assert main(["tune", str(runs_dir / "f"), "--nfe", "2", "2", "--n", n, "--seeds", "2"]) == 0
    out = capsys.readouterr().out  # two seeds: each score with its spread, kept in tune.json; a budget named twice
    assert out.count("samplers at 2 NFE") == 1  # is scored once
    assert len(re.findall(r"^ +[\d. ]+ +[\d.]+ ± [\d.]+", out, re.M)) == len(tune.WARPS)
    record = json.loads((runs_dir / "f" / "tune.json").read_text())
    assert set(record) == {"3", "2"} and all(len(r["fd_cnn_per_seed"]) == 2 for r in record["2"]["scores"])
    (runs_dir / "f" / "tune.json").write_text("{not json")  # a damaged record is left as it is, with a warning
    assert main(["tune", str(runs_dir / "f"), "--nfe", "2", "--n", n]) == 0
    assert "could not record the scores" in capsys.readouterr().err
    assert (runs_dir / "f" / "tune.json").read_text() == "{not json"
    from sinkflow.cli.tune import keep

    for damage in ("[]", "null"):  # JSON, but not a record: the same warning (a TypeError's traceback)
        (runs_dir / "f" / "tune.json").write_text(damage)
        keep(runs_dir / "f" / "tune.json", "2", {"best": {}})
        assert "could not record the scores" in capsys.readouterr().err
        assert (runs_dir / "f" / "tune.json").read_text() == damage
    (runs_dir / "f" / "tune.json").unlink()  # a budget's scores replaced by a later tune's: said, with what they were
    keep(runs_dir / "f" / "tune.json", "2", {"n": 1000, "seeds": 3})
    assert capsys.readouterr().out.strip() == f"wrote {runs_dir / 'f' / 'tune.json'}"
    keep(runs_dir / "f" / "tune.json", "2", {"n": 16, "seeds": 1})
    assert "(replacing an earlier tune's scores at 2 NFE: 1000 samples x 3 seed(s))" in capsys.readouterr().out


def test_what_tune_cannot_choose_is_one_line_before_any_work(runs_dir, tmp_path, capsys, tiny_run):
    extra, _ = setup_data("digits", tmp_path)
    assert main(["train", "digits", "--method", "fm", *TINY_FM, *extra, "sample.steps=2", "--name", "nov",
                 "--no-report"]) == 0
    capsys.readouterr()
    rc, err = main(["tune", str(runs_dir / "nov")]), capsys.readouterr().err
    assert "trained without a validation split (data.val_fraction=0)" in error_line(rc, err, "sinkflow tune")
    rc, err = main(["tune", str(tiny_run)]), capsys.readouterr().err
    assert "moons is not an image set, so it has no validation split" in error_line(rc, err, "sinkflow tune")
    assert not (runs_dir / "nov" / "tune.json").exists()
    assert main(["train", "digits", "--method", "fm", *TINY_FM, *extra, "sample.steps=2", "data.val_fraction=0.1",
                 "--name", "v", "--no-report"]) == 0
    capsys.readouterr()
    for flags, needle in ((["--nfe", "0"], "use --nfe 1 or more"), (["--n", "1"], "a Fréchet distance needs 2"),
                          (["--seeds", "0"], "--seeds 0 must be a whole number >= 1")):
        rc, err = main(["tune", str(runs_dir / "v"), *flags]), capsys.readouterr().err
        error_line(rc, err, needle)
    assert not (runs_dir / "v" / "tune.json").exists()


def test_tune_on_a_run_of_points_names_eval_with_a_sampler_not_a_flag_it_was_not_given(tiny_run, tmp_path, capsys):
    # the fix said "sinkflow eval RUN, without --split val", eval's fix, to a tune command that has no --split;
    # the key it names is one the run's method reads (NSGF++ on points reads no sample.time_warp)
    rc, err = main(["tune", str(tiny_run)]), capsys.readouterr().err
    line = error_line(rc, err, "moons is not an image set", "sinkflow eval RUN sample.time_warp=0.5")
    assert "--split" not in line
    assert main(["train", "moons", "--method", "nsgfpp", "pool.batches=2", "pool.batch_size=32", "pool.chunk=1",
                 "--train-iters", "2", "--device", "cpu", f"experiment.runs_dir={tmp_path}", "--name", "pp",
                 "--no-report"]) == 0
    capsys.readouterr()
    rc, err = main(["tune", str(tmp_path / "pp")]), capsys.readouterr().err
    error_line(rc, err, "moons is not an image set", "sinkflow eval RUN sample.t_shift=-0.1")


def test_candidates_follow_what_the_run_was_trained_for():
    """k beyond the pool's T only for a field trained on its segments; a budget with no straight-flow step, a method
    without these knobs and data without a scorer are refused with the fix."""
    from sinkflow.errors import SinkflowError

    digits = config.resolve("digits", [], {"device": "cpu"})  # nsgf.segment 0.5
    assert {c["nsgf_steps"] for c in tune.candidates(digits, 13)} == {3, 6, 11}
    grid_only = config.resolve("mnist", [], {"device": "cpu"})  # nsgf.segment 0: sampled on the pool's grid
    assert {(c["nsgf_steps"], c["nsf_steps"]) for c in tune.candidates(grid_only, 13)} == {(5, 7)}
    with pytest.raises(SinkflowError, match="use --nfe 7 or more"):
        tune.candidates(grid_only, 6)
    with pytest.raises(SinkflowError, match="use --nfe 3 or more"):
        tune.candidates(digits, 2)
    flow = config.resolve("flow-digits", [], {"device": "cpu"})
    assert tune.candidates(flow, 1) == [{"temperature": t} for t in tune.TEMPERATURES]
    assert tune.current(flow) == (1, {"temperature": 1.0})
    with pytest.raises(SinkflowError, match="leave --nfe out"):
        tune.candidates(flow, 10)
    with pytest.raises(SinkflowError, match="this run's method is nsgf"):
        tune.candidates(config.resolve("moons", [], {"device": "cpu"}), 10)
    assert tune.current(digits) == (13, {"nsgf_steps": 10, "nsf_steps": 2, "t_shift": 0.0})
    cifar = config.resolve("cifar10", [], {"device": "cpu"})
    with pytest.raises(SinkflowError, match="eval.inception_weights"):
        tune.metric_of(cifar, SimpleNamespace(name="cifar10", labels=None))
    assert tune.metric_of({**cifar, "eval": {**cifar["eval"], "inception_weights": "pt_inception.pth"}},
                          SimpleNamespace(name="cifar10", labels=None)) == "fid"
    with_val = config.resolve("digits", ["data.val_fraction=0.1"], {"device": "cpu"})
    assert "sinkflow tune runs/x (at its own 13 network evaluations" in tune.hint(with_val).format(run="runs/x")
    assert tune.hint(digits) is None and tune.hint(config.resolve("moons", [], {"device": "cpu"})) is None
    cifar_val = config.resolve("cifar10", ["data.val_fraction=0.1"], {"device": "cpu"})  # no FD-CNN, no FID weights:
    assert tune.hint(cifar_val) is None  # tune would refuse it, so the report does not suggest it
    assert "sinkflow tune" in tune.hint({**cifar_val, "eval": {**cifar_val["eval"], "inception_weights": "w.pth"}})
    # ties: fewer NSGF steps, then the smaller shift, then the grid nearer uniform
    assert tune.choose([({"nsgf_steps": 6, "t_shift": 0.0}, 1.0), ({"nsgf_steps": 3, "t_shift": -0.2}, 1.0),
                        ({"nsgf_steps": 3, "t_shift": -0.1}, 1.0)])[0] == {"nsgf_steps": 3, "t_shift": -0.1}
    assert tune.choose([({"time_warp": 0.5}, 2.0), ({"time_warp": 0.75}, 2.0)])[0] == {"time_warp": 0.75}
    assert tune.choose([({"temperature": 0.7}, 2.0), ({"temperature": 0.8}, 2.0)])[0] == {"temperature": 0.8}
    assert tune.hint(flow) == "its sampling temperature, chosen on the validation split: sinkflow tune {run}"


def test_a_win_within_the_noise_keeps_the_runs_own_sampler():
    """`sinkflow tune` on a barely trained FM run named time_warp=0.5 best by 0.0008 FD-CNN over the run's own
    uniform grid (129.4630 against 129.4638): a margin no seed would repeat. Every candidate samples with the same
    seeds, so the two compare seed by seed: a lowest mean within twice the standard error of the paired differences
    keeps the run's own; beyond it, or with one seed (no noise measured), the lowest is named."""
    own = {"time_warp": 1.0}
    noisy = [({"time_warp": 0.5}, 10.0, [9.0, 11.5, 9.5]), (own, 10.3, [10.5, 10.0, 10.4])]  # one seed reverses it
    assert tune.recommend(noisy, own) == (own, 10.3, True)
    # the same means, each seed's images better by about as much: a win, although each spread is wide
    paired = [({"time_warp": 0.5}, 10.0, [8.0, 12.0, 10.0]), (own, 10.3, [8.28, 12.31, 10.31])]
    assert tune.recommend(paired, own) == ({"time_warp": 0.5}, 10.0, False)
    one_seed = [({"time_warp": 0.5}, 10.0, [10.0]), (own, 10.0008, [10.0008])]
    assert tune.recommend(one_seed, own) == ({"time_warp": 0.5}, 10.0, False)
    assert tune.recommend(noisy, None) == ({"time_warp": 0.5}, 10.0, False)  # another budget: no own sampler
    assert tune.recommend([noisy[1], noisy[0]], own)[0] == own


def test_candidates_that_sample_alike_are_marked_with_the_one_they_repeat():
    """NSGF++'s t̂ shifts clamped at nsgf.nsf_t_min draw the same samples: their rows scored alike seed by seed, and
    the table read as if the shift did not matter. A row whose every seed's score equals an earlier row's names it;
    equal means from different seeds' scores are not the same samples."""
    a, b, c, d = ({"nsgf_steps": 1, "t_shift": s} for s in (0.0, -0.1, -0.2, -0.3))
    scored = [(a, 20.0, [19.0, 21.0]), (b, 20.0, [19.0, 21.0]), (c, 20.0, [21.0, 19.0]), (d, 20.0, [19.0, 21.0])]
    assert tune.repeats(scored) == {1: a, 3: a}
    assert tune.repeats(scored[2:3]) == {}


def test_a_flow_tries_its_sampling_temperatures(runs_dir, tmp_path, capsys):
    """A normalizing flow (one pass, no NFE): each prior temperature scored on the validation digits."""
    from test_flow_eval import TINY as TINY_FLOW

    assert main(["train", "flow-digits", *TINY_FLOW, f"data.root={tmp_path / 'data'}", "--train-iters", "2",
                 "--name", "g", "--no-report"]) == 0
    capsys.readouterr()
    rc, out = main(["tune", str(runs_dir / "g"), "--n", "16"]), capsys.readouterr().out
    assert rc == 0 and "flow samplers at one pass" in out
    got = rows(out)
    assert sorted(t for (t,), _, _ in got) == sorted(tune.TEMPERATURES)
    assert json.loads((runs_dir / "g" / "tune.json").read_text())["1"]["best"]["temperature"] in tune.TEMPERATURES


@pytest.mark.parametrize("mode", ["1", "lines"])
def test_tune_in_a_log_file_says_its_progress_in_lines_not_a_bar(runs_dir, tmp_path, capsys, monkeypatch, mode):
    """Where the console is not a terminal (the default, 1, in a log file) or with SINKFLOW_PROGRESS=lines, tune
    says its progress as a phase does: plain lines, every SINKFLOW_PROGRESS_EVERY seconds and at the end. It drew
    tqdm's bar there, one line of carriage-return redraws that a log shows nothing of until the budget ends."""
    from test_flow_eval import TINY as TINY_FLOW

    assert main(["train", "flow-digits", *TINY_FLOW, f"data.root={tmp_path / 'data'}", "--train-iters", "2",
                 "--name", "g", "--no-report"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("SINKFLOW_PROGRESS", mode)
    monkeypatch.setenv("SINKFLOW_PROGRESS_EVERY", "0")
    rc, err = main(["tune", str(runs_dir / "g"), "--n", "16"]), capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tune ")]
    assert rc == 0 and "\r" not in err and "|" not in err, err
    assert len(lines) == len(tune.candidates(config.resolve("flow-digits"), 1)), err
    assert lines[-1].startswith(f"tune 1 NFE: {len(lines)}/{len(lines)} samplers (100.0%), "), err
    assert "samplers/s, elapsed " in lines[-1] and "ETA 00:00" in lines[-1], err


def test_cifar_runs_are_tuned_by_fid_at_their_shape(runs_dir, tmp_path, capsys, monkeypatch):
    """(N, 3, 32, 32) has no digit classifier: with eval.inception_weights the candidates are scored by FID
    (torchmetrics; a tiny network of Inception's interface stands in for the weights this machine lacks). The real
    images' features are extracted once for all candidates, and each score is the one-off FID of its samples."""
    pytest.importorskip("torchmetrics")
    import sinkflow.eval.images as images
    from sinkflow.engine import experiment
    from test_fd_cnn import TinyExtractor

    built, scored, original, net = [], [], images.InceptionFID, TinyExtractor()

    class Recorded(images.InceptionFID):
        def __init__(self, real, weights, extractor=None):
            built.append((tuple(real.shape), weights))
            self.real = real
            super().__init__(real, None, extractor=extractor or net)

        def __call__(self, generated):
            got = super().__call__(generated)
            scored.append((tuple(generated.shape), got, alone(generated, self.real)))
            return got

    def alone(generated, real):  # the one-off FID, outside the record
        return original(real, None, net)(generated)

    monkeypatch.setattr(images, "InceptionFID", Recorded)
    extra, _ = setup_data("cifar10", tmp_path)
    extra = [o for o in extra if not o.startswith("model.nsf.")]  # FM has no NSF network
    weights = runs_dir.parent / "pt_inception.pth"  # a file must be there (checked before training); never read
    monkeypatch.setattr(experiment, "FID_PACKAGES", ("torchmetrics",))  # nor is torch-fidelity: the stand-in runs
    weights.write_bytes(b"stand-in")
    assert main(["train", "cifar10", "--method", "fm", *TINY_FM, *extra, "sample.steps=2", "data.val_fraction=0.2",
                 f"eval.inception_weights={weights}", "--name", "c", "--no-report"]) == 0
    capsys.readouterr()
    held = len(data.distributions(RunFolder.open(runs_dir / "c").cfg)[1].val_index)
    rc, out = main(["tune", str(runs_dir / "c"), "--n", str(held)]), capsys.readouterr().out
    assert rc == 0 and "FID of" in out and len(rows(out)) == len(tune.WARPS)
    assert built == [((held, 3, 32, 32), str(weights))]  # one reference for every candidate
    assert len(scored) == len(tune.WARPS) and all(shape == (held, 3, 32, 32) for shape, _, _ in scored)
    assert all(got == pytest.approx(alone, rel=1e-6) for _, got, alone in scored)
    assert json.loads((runs_dir / "c" / "tune.json").read_text())["2"]["metric"] == "fid"


def test_train_ends_an_image_run_with_the_tune_line_when_it_has_a_validation_split(runs_dir, tmp_path, capsys):
    """`sinkflow train`'s report (not --no-report) names `sinkflow tune RUN` last for an image run with
    data.val_fraction, and says nothing of it without one (tune would refuse it)."""
    extra, _ = setup_data("digits", tmp_path)
    small = ["eval.n=16", "eval.class_n=null", "eval.seeds=1", "sample.steps=2"]
    assert main(["train", "digits", "--method", "fm", *TINY_FM, *extra, *small, "data.val_fraction=0.2",
                 "--name", "with"]) == 0
    out = capsys.readouterr().out
    line = tune.hint(RunFolder.open(runs_dir / "with").cfg).format(run=Path("runs") / "with")  # as the run names it
    assert out.rstrip().splitlines()[-1] == line and "sinkflow tune runs/with (at its own 2 network" in line
    assert main(["train", "digits", "--method", "fm", *TINY_FM, *extra, *small, "--name", "without"]) == 0
    assert "sinkflow tune" not in capsys.readouterr().out


def test_an_unfinished_run_is_refused_before_the_classifier_and_reference_are_built(runs_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    """A run whose phase has not finished (stopped, killed, a final.pt deleted): `tune` built the validation
    reference and trained the FD-CNN classifier (minutes on MNIST; Inception features on CIFAR-10), and `eval`
    trained both classifiers, before their first sample met "has not finished". Both refuse it first now."""
    from sinkflow.eval import images

    extra, _ = setup_data("digits", tmp_path)
    assert main(["train", "digits", "--method", "fm", *TINY_FM, *extra, "sample.steps=2", "data.val_fraction=0.1",
                 "--name", "u", "--no-report"]) == 0
    run = runs_dir / "u"
    (run / "checkpoints" / "velocity" / "final.pt").unlink()  # step_00000003.pt is left: a resume finishes it

    def work(*args, **kwargs):
        raise AssertionError("work before the refusal")

    for name in ("digit_classifier", "held_out", "image_metrics"):
        monkeypatch.setattr(images, name, work)
    monkeypatch.setattr("sinkflow.eval.fd_cnn.train_cnn", work)
    for argv in (["tune", str(run)], ["eval", str(run)], ["eval", str(run), "--split", "val"]):
        capsys.readouterr()
        rc, err = main(argv), capsys.readouterr().err
        assert f"phase 'velocity' of {run} has not finished; finish it with `sinkflow train --resume" in \
            error_line(rc, err, "has not finished"), (argv, err)
    assert not (run / "tune.json").exists()


def test_a_best_with_nothing_of_the_runs_own_to_compare_says_how_far_the_next_is(runs_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    """At a budget the run's own sampler does not spend, the lowest of the candidates was printed as the best with no
    word on the noise: from one seed (a 10-step digits run at --nfe 6: 214.68 against the next's 214.69), or ahead
    of the next by less than twice the standard error of their paired seed differences. Each now says so; a margin
    beyond the paired noise, or the run's own compared as before, prints no such line."""
    extra, _ = setup_data("digits", tmp_path)
    assert main(["train", "digits", "--method", "fm", *TINY_FM, *extra, "sample.steps=2", "data.val_fraction=0.1",
                 "--name", "v", "--no-report"]) == 0
    run = runs_dir / "v"
    fake = {}
    monkeypatch.setattr(tune, "tune", lambda run_, total, n, seeds, metric: fake[seeds])
    warps = [{"steps": 5, "time_warp": w} for w in tune.WARPS]
    fake[1] = [(warps[0], 10.0, [10.0]), (warps[1], 10.01, [10.01]), (warps[2], 12.0, [12.0]),
               (warps[3], 13.0, [13.0])]
    fake[3] = [(warps[0], 10.0, [9.0, 11.5, 9.5]), (warps[1], 10.3, [10.5, 10.0, 10.4]), (warps[2], 12.0, [12.0] * 3),
               (warps[3], 13.0, [13.0] * 3)]
    capsys.readouterr()
    assert main(["tune", str(run), "--nfe", "5", "--n", "8"]) == 0
    out = capsys.readouterr().out
    assert ("one seed measures no noise: `--seeds 3` shows whether the margin of 0.01 over the next "
            "(sample.steps=5 sample.time_warp=0.5: 10.01) is more than the sampling noise") in out, out
    assert main(["tune", str(run), "--nfe", "5", "--n", "8", "--seeds", "3"]) == 0
    out = capsys.readouterr().out
    assert ("the next (sample.steps=5 sample.time_warp=0.5: 10.30) is behind by less than twice the standard error "
            "of their seed-by-seed differences") in out, out
    fake[3][1] = (warps[1], 10.3, [9.3, 11.8, 9.8])  # each seed 0.3 behind: a margin beyond the paired noise
    assert main(["tune", str(run), "--nfe", "5", "--n", "8", "--seeds", "3"]) == 0
    out = capsys.readouterr().out
    assert "the next (" not in out and "best at 5 NFE: sample.steps=5 sample.time_warp=0.35" in out, out
