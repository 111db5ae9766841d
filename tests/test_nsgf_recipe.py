"""The NSGF recipe's options: LR schedule, harmonic step sizes, segment training and the sampler's grid."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sinkflow import config
from sinkflow.cli import main
from sinkflow.errors import SinkflowError
from sinkflow.methods import nsgf
from sinkflow.ot import eta_schedule, simulate_sinkhorn_flow
from sinkflow.engine.trainer import lr_factor
from helpers import TINY_2D, tiny_2d


def test_cosine_schedule_warms_up_then_decays_to_zero():
    f = lr_factor("cosine", warmup=10, iters=110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.5) and f(110) == pytest.approx(0.0)
    assert all(f(s) >= f(s + 1) for s in range(10, 110))
    assert lr_factor("constant", 0, 100)(99) == 1.0
    with pytest.raises(SinkflowError, match="train.velocity.schedule"):
        lr_factor("linear", 0, 100)


def test_training_logs_the_cosine_learning_rate(runs_dir):
    assert main(["train", "moons", *TINY_2D, "--name", "lr", "--no-report", "train.velocity.log_every=1",
                 "--lr", "0.01"]) == 0
    rows = [json.loads(line) for line in (runs_dir / "lr" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if r["phase"] == "velocity"]
    # the lr after step s: 0.01 * (1 + cos(pi s / 6)) / 2, reaching 0 at the last step
    assert lrs == pytest.approx([0.005 * (1 + math.cos(math.pi * s / 6)) for s in range(1, 7)], abs=1e-9)


def test_harmonic_steps_cover_equal_shares_and_land():
    etas = eta_schedule(1.0, 10, schedule="harmonic")
    assert etas[-1] == 1.0 and etas[0] == pytest.approx(0.1)
    left = 1.0
    for eta in etas:  # with v = y - x, step k moves eta_k of what remains = 1/T of the original displacement
        assert eta * left == pytest.approx(0.1)
        left *= 1 - eta
    assert left == pytest.approx(0.0)
    assert eta_schedule(0.5, 3, growth=2.0) == pytest.approx([0.5 * math.exp(2 * (k - 3) / 3) for k in range(3)])
    with pytest.raises(SinkflowError):
        eta_schedule(1.0, 3, schedule="cubic")


def test_harmonic_sinkhorn_flow_lands_on_a_small_target_batch():
    gen = torch.Generator().manual_seed(0)
    x0, y = torch.randn(64, 2, generator=gen), torch.randn(64, 2, generator=gen) + 4
    xs, vs = simulate_sinkhorn_flow(x0, y, steps=8, eta=1.0, schedule="harmonic", blur=0.05, scaling=0.95)
    final = xs[-1] + vs[-1]  # eta_{T-1} = 1
    nearest = torch.cdist(final, y).min(1).values
    assert nearest.median() < 0.1  # each particle ends on (an entropic average next to) a target point
    assert torch.cdist(x0, y).min(1).values.median() > 2


def test_exact_landing_ends_on_a_permutation_of_the_target_batch():
    """pool.landing=exact: the steps before the last are the Sinkhorn flow's, the last moves each particle onto its
    exact-OT partner, so the end points are the target batch itself (an entropic landing is blurred)."""
    gen = torch.Generator().manual_seed(0)
    x0, y = torch.randn(3, 48, 2, generator=gen), torch.randn(3, 48, 2, generator=gen) * 0.3 + 2
    kw = dict(steps=4, eta=1.0, schedule="harmonic", blur=0.2, scaling=0.8, batched=True, solver="converged", tol=0.01)
    xs, vs = simulate_sinkhorn_flow(x0, y, landing="exact", **kw)
    xs_s, vs_s = simulate_sinkhorn_flow(x0, y, **kw)
    assert torch.equal(xs, xs_s) and torch.equal(vs[:-1], vs_s[:-1])
    for b in range(3):
        end, blurred = xs[-1, b] + vs[-1, b], xs_s[-1, b] + vs_s[-1, b]
        d = (end[:, None] - y[b][None]).norm(dim=-1)  # not cdist: its matmul form is off by ~1e-3 near 0
        assert d.min(1).values.max() < 1e-5 and len(set(d.argmin(1).tolist())) == 48  # every target point once
        assert (blurred[:, None] - y[b][None]).norm(dim=-1).min(1).values.median() > 1e-3
    with pytest.raises(SinkflowError, match="as many particles"):
        simulate_sinkhorn_flow(x0[0], y[0, :40], landing="exact", steps=2, eta=1.0, schedule="harmonic", blur=0.2)


def test_exact_landing_trains_end_to_end_and_needs_the_harmonic_schedule(runs_dir, capsys):
    assert main(["train", "moons", *TINY_2D, "--name", "exact", "--no-report", "pool.landing=exact"]) == 0
    x, v = (np.load(runs_dir / "exact" / "pool" / f"{k}.npy", allow_pickle=False) for k in ("x", "v"))
    assert x.shape == v.shape == (2 * 4 * 32, 2) and np.isfinite(v).all()
    assert main(["train", "moons", *TINY_2D, "--name", "bad", "pool.landing=exact", "pool.schedule=constant"]) == 2
    err = capsys.readouterr().err
    assert "pool.landing=exact" in err and "Traceback" not in err and not (runs_dir / "bad").exists()


def _fake_run(tmp_path, time, segment, storage="memory"):
    """A finished pool of 2 trajectories x T=4 steps x n=3 particles (x, v, t as the pool phase writes them)."""
    cfg = config.resolve("moons", [f"nsgf.time={time}", f"nsgf.segment={segment}", "pool.steps=4",
                                   "pool.batch_size=3", "pool.batches=2", "pool.eta=1.0", "pool.schedule=harmonic",
                                   f"pool.storage={storage}"])
    T, n = 4, 3
    etas, times = nsgf.step_sizes(cfg["pool"]), nsgf.flow_times(cfg["pool"])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * T * n, 2, generator=gen)
    v = torch.randn(2 * T * n, 2, generator=gen)
    k = (torch.arange(2 * T * n) % (T * n)) // n
    folder = tmp_path / "pool"
    folder.mkdir()
    for name, a in (("x", x), ("v", v), ("t", times[k])):
        np.save(folder / f"{name}.npy", a.numpy().astype(np.float32))
    return SimpleNamespace(dir=tmp_path, cfg=cfg), x, v, k, etas


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_segment_points_lie_on_their_euler_segment_at_the_right_time(tmp_path, storage):
    run, x, v, k, etas = _fake_run(tmp_path, "fraction", 1.0, storage)
    xb, tb, vb = nsgf.pool_batches(run)(torch.Generator().manual_seed(0), 500, "cpu")
    T = 4
    for xi, ti, vi in zip(xb, tb, vb):
        # which entry: the target is T * eta_k * v_k for exactly one pool row
        rows = [j for j in range(len(x)) if torch.allclose(vi, T * etas[k[j]] * v[j], atol=1e-5)]
        assert len(rows) == 1
        j = rows[0]
        u = float(ti) * T - int(k[j])  # network time (k + u) / T
        assert 0.0 <= u < 1.0 + 1e-6
        assert torch.allclose(xi, x[j] + u * etas[k[j]] * v[j], atol=1e-5)
    assert (tb * T - torch.floor(tb * T + 1e-6)).abs().max() > 0.1  # times really between grid points


def test_grid_points_and_flow_time(tmp_path):
    run, x, v, k, etas = _fake_run(tmp_path, "flow", 0.0)
    xb, tb, vb = nsgf.pool_batches(run)(torch.Generator().manual_seed(0), 200, "cpu")
    times = nsgf.flow_times(run.cfg["pool"])
    for xi, ti, vi in zip(xb, tb, vb):
        j = int(torch.cdist(xi[None], x).argmin())
        assert torch.allclose(xi, x[j]) and torch.allclose(vi, v[j]) and float(ti) == pytest.approx(float(times[k[j]]))


def test_segment_probability_is_respected(tmp_path):
    run, x, *_ = _fake_run(tmp_path, "fraction", 0.5)
    xb, tb, _ = nsgf.pool_batches(run)(torch.Generator().manual_seed(0), 2000, "cpu")
    on_grid = (tb * 4 - torch.round(tb * 4)).abs() < 1e-6
    assert 0.4 < on_grid.float().mean() < 0.6


def test_fraction_time_samples_on_the_pool_grid(runs_dir):
    assert main(["train", "moons", *TINY_2D, "--name", "g", "--no-report", "nsgf.time=fraction",
                 "pool.schedule=harmonic", "pool.eta=1.0"]) == 0
    from sinkflow.eval.points import generate
    from sinkflow.runtime.run_folder import RunFolder

    run = RunFolder.open(runs_dir / "g")
    seen = []
    hook = run.model("velocity").register_forward_hook(lambda m, args, out: seen.append(float(args[1][0])))
    _, info = generate(run, 8, 4, seed=0)  # pool.steps=4 in TINY_2D: 4 steps are its own grid
    hook.remove()
    assert info["nfe"] == 4 and seen == pytest.approx([0.0, 0.25, 0.5, 0.75])
    grid_t, grid_h = nsgf.network_grid(run.cfg)
    assert grid_t.tolist() == pytest.approx([0, 0.25, 0.5, 0.75, 1.0]) and grid_h.tolist() == pytest.approx([0.25] * 4)


def test_time_bins_give_each_euler_step_its_pool_segment(runs_dir):
    """model.velocity.time_bins=T: at 10 and 100 uniform sampling steps over a 5-step pool every velocity call
    gets the one-hot of the pool segment its Euler step lies in (float times like 0.6 - 1e-8 included)."""
    from sinkflow.eval.points import generate
    from sinkflow.models.mlp import time_bin_features
    from sinkflow.runtime.run_folder import RunFolder

    assert main(["train", "moons", *TINY_2D, "--name", "b", "--no-report", "pool.steps=5",
                 "model.velocity.time_bins=5", "eval.steps=[5]"]) == 0
    run = RunFolder.open(runs_dir / "b")
    for steps in (10, 100):
        seen = []
        hook = run.model("velocity").register_forward_hook(lambda m, args, out: seen.append(args[1]))
        generate(run, 4, steps, seed=0)
        hook.remove()
        bins = [int(time_bin_features(t, 5).argmax(-1)[0]) for t in seen]
        assert bins == [j * 5 // steps for j in range(steps)]
    edges = torch.tensor([0.2 - 1e-7, 0.2, 0.6 - 1e-8, 0.9999, 1.0])
    assert time_bin_features(edges, 5).argmax(-1).tolist() == [1, 1, 3, 4, 4]


def test_bad_nsgf_keys_are_one_line_errors(runs_dir, capsys):
    for bad, key in (("nsgf.time=seconds", "nsgf.time"), ("nsgf.segment=1.5", "nsgf.segment"),
                     ("pool.schedule=cubic", "schedule"), ("model.velocity.time_bins=3", "time_bins")):
        assert main(["train", "moons", *TINY_2D, "--name", "bad", bad]) == 2
        err = capsys.readouterr().err
        assert key in err and "Traceback" not in err
        assert not (runs_dir / "bad").exists()


def test_qmc_pool_draws_its_source_batches_by_sobol(runs_dir):
    """pool.qmc=true (the 2D presets' choice) on data.source=normal builds exactly the pool of
    data.source=normal-qmc (scrambled Sobol source batches), which is not the i.i.d. pool."""
    assert config.resolve("moons")["pool"]["qmc"] is True
    pools = {}
    for name, extra in (("iid", ["pool.qmc=false"]), ("qmc", ["pool.qmc=true"]),
                        ("twin", ["data.source=normal-qmc", "pool.qmc=false"])):
        assert main(["train", "moons", *TINY_2D, "--name", name, "--no-report", *extra]) == 0
        pools[name] = np.load(runs_dir / name / "pool" / "x.npy", allow_pickle=False)
    np.testing.assert_array_equal(pools["qmc"], pools["twin"])
    assert not np.array_equal(pools["qmc"], pools["iid"])
    from sinkflow import data

    twin = data.qmc_twin(data.build_distribution("8gaussians"))
    assert twin.name == "8gaussians-qmc" and data.qmc_twin(twin) is twin
    moons = data.build_distribution("moons")
    assert data.qmc_twin(moons) is moons  # no twin: the source itself


def test_nsf_pairs_chooses_the_straight_flows_coupling():
    """nsgf.nsf_pairs: NSGF++'s NSF phase pairs independently (paper, the default) or by minibatch OT, and the time
    predictor pairs as the NSF does (it was independent whatever the NSF's pairs: calibrated on another X_t)."""
    from sinkflow import data, methods

    for pairs, ot in (("independent", False), ("ot", True)):
        cfg = config.resolve("digits", [f"nsgf.nsf_pairs={pairs}"])
        source, target = data.distributions(cfg)
        phases = {p.name: p for p in methods.of(cfg).phases(cfg, source, target)}
        nsf = phases["nsf"]
        assert nsf.ot_pairs is ot and phases["time"].ot_pairs is ot
        drawn = phases["time"].draw(torch.Generator().manual_seed(0), 64, "cpu")  # the same draw: the same X_t
        torch.testing.assert_close(phases["time"].prepare(drawn, "cpu")[0], nsf.prepare(drawn, "cpu")[0])
        xt, t, v = nsf.batch(torch.Generator().manual_seed(0), 64, "cpu")
        x0 = xt - t.view(-1, 1, 1, 1) * v  # the straight path's ends
        x1 = x0 + v
        cost = lambda perm: float(((x1[perm] - x0) ** 2).sum())  # noqa: E731
        others = [cost(torch.randperm(64, generator=torch.Generator().manual_seed(s))) for s in range(20)]
        if ot:  # the OT plan's pairing costs less than every other pairing of the same points
            assert cost(torch.arange(64)) < min(others)
    assert config.resolve("digits")["nsgf"]["nsf_pairs"] == "independent"


def test_nsf_t_min_trains_the_straight_flow_where_it_is_sampled():
    """nsgf.nsf_t_min: the NSF phase draws t ~ U[t_min, 1) (0 = the paper's whole path), and sampling clamps
    the predictor's t_hat into that range."""
    from sinkflow import data, methods

    for t_min in (0.0, 0.6):
        cfg = config.resolve("digits", [f"nsgf.nsf_t_min={t_min}"])
        source, target = data.distributions(cfg)
        phases = {p.name: p for p in methods.of(cfg).phases(cfg, source, target)}
        nsf = phases["nsf"]
        xt, t, v = nsf.batch(torch.Generator().manual_seed(0), 512, "cpu")
        assert float(t.min()) >= t_min and float(t.max()) < 1.0
        _, t_time = phases["time"].batch(torch.Generator().manual_seed(0), 512, "cpu")
        assert float(t_time.min()) < 0.01  # the predictor keeps the paper's U(0, 1) whatever t_min (docs/nsgfpp.md)
        assert float(t.min()) < t_min + 0.01  # the whole range is used, not just its top
        x0 = xt - t.view(-1, 1, 1, 1) * v
        assert float(x0.abs().max()) > 2.5  # the path still starts at the Gaussian source
    assert config.resolve("mnist")["nsgf"]["nsf_t_min"] == 0.0  # the paper's presets keep its whole path
    assert config.resolve("digits")["nsgf"]["nsf_t_min"] == 0.5  # measured in docs/nsgfpp.md
    with pytest.raises(SinkflowError, match="nsf_t_min"):
        config.resolve("digits", ["nsgf.nsf_t_min=1.0"])


def test_time_warp_grid_keeps_its_ends_and_moves_the_long_step_to_the_end():
    from sinkflow.methods.ode import euler, warped_fractions

    assert warped_fractions(4) == pytest.approx([0, 0.25, 0.5, 0.75, 1])
    grid = warped_fractions(6, 0.5)
    steps = np.diff(grid)
    assert grid[0] == 0 and grid[-1] == pytest.approx(1) and (steps > 0).all()
    assert steps[0] < 1 / 6 < steps[-1] and (np.diff(steps) > 0).all()  # short early steps, one long jump last
    assert (np.diff(np.diff(warped_fractions(6, 2.0))) < 0).all()
    # a field constant in x: Euler is exact on any grid, so every warp integrates the same displacement
    calls = []

    def field(x, t):
        calls.append(t.clone())
        return torch.ones_like(x) * 2

    x0, t0 = torch.zeros(3, 2), torch.tensor([0.0, 0.5, 0.8])  # per-sample spans, as NSGF++'s NSF has
    for warp in (0.5, 1.0, 2.0):
        calls.clear()
        x, _ = euler(field, x0, t0, 1.0, 6, warp=warp)
        assert len(calls) == 6 and torch.allclose(x[:, 0], 2 * (1 - t0))
        assert torch.allclose(calls[1], t0 + (1 - t0) * warped_fractions(6, warp)[1])
    with pytest.raises(SinkflowError, match="warp"):
        warped_fractions(4, 0.0)


def test_sample_time_warp_reaches_the_euler_samplers(runs_dir, capsys):
    """FM / OT-CFM / NSGF read sample.time_warp at sampling (same NFE, other times); a bad value is one line."""
    from sinkflow.eval.points import generate
    from sinkflow.runtime.run_folder import RunFolder

    for method in ("otcfm", "nsgf"):  # the moons preset's NSGF reads fraction time: its span is [0, 1] too
        assert main(["train", "moons", "--method", method, *tiny_2d(method), "--name", method, "--no-report"]) == 0
        run = RunFolder.open(runs_dir / method)
        outs = {}
        for warp in (1.0, 0.5):
            run.cfg["sample"]["time_warp"] = warp
            seen = []
            hook = run.model("velocity").register_forward_hook(lambda m, args, out: seen.append(float(args[1][0])))
            outs[warp], info = generate(run, 8, 4, seed=0)
            hook.remove()
            assert info["nfe"] == 4
            assert seen == pytest.approx([1 - (1 - i / 4) ** warp for i in range(4)])
        assert not torch.allclose(outs[1.0], outs[0.5])
    assert main(["train", "moons", *TINY_2D, "--name", "bad", "sample.time_warp=0"]) == 2
    err = capsys.readouterr().err
    assert "sample.time_warp" in err and "Traceback" not in err and not (runs_dir / "bad").exists()


class _Points:
    """A point mass at ``value`` in ``dims`` dimensions: from 0 to 1 the straight path's X_t is t in every coordinate
    (an oracle can read it off the first one)."""

    def __init__(self, value, dims=64):
        self.value, self.dims = value, dims

    def sample(self, n, generator, device):
        return torch.full((n, self.dims), float(self.value), device=device)


def test_time_predictor_that_has_not_learned_is_named_at_the_end_of_its_phase(tmp_path, caplog):
    """200 steps at lr 1e-4 left the CPU MNIST benchmark's predictor at 87% of a constant guess's MSE (t_hat 0.55 for
    every state, RESULTS.md): the phase end measures it on a fresh draw, records t_mse, and warns below the line;
    in 2-D (t cannot be read off a point there: 55% is the floor on moons) it records without warning."""
    import logging

    from sinkflow.methods.nsgfpp import LEARNED_FRACTION, TimeStep

    logged = []
    oracle, constant = (lambda x: x[:, 0]), (lambda x: torch.full((x.shape[0],), 0.5))
    for name, dims, model, warned in (("oracle", 64, oracle, False), ("constant", 64, constant, True),
                                      ("constant in 2-D", 2, constant, False)):
        step = TimeStep(_Points(0.0, dims), _Points(1.0, dims))
        net = torch.nn.Module()
        net.forward = model
        trainer = SimpleNamespace(ema=None, model=net, device="cpu", step=7,
                                  run=SimpleNamespace(logger=SimpleNamespace(log=lambda *a: logged.append(a))))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sinkflow.learning"):
            step.on_phase_end(trainer)
        phase, at, rec = logged[-1]
        assert (phase, at, rec["t_mse_constant"]) == ("time", 7, pytest.approx(1 / 12))
        assert ("has not learned" in caplog.text and "train.time.lr" in caplog.text) is warned, name
    assert logged[0][2]["t_mse"] < 1e-12
    assert logged[1][2]["t_mse"] == pytest.approx(1 / 12, rel=0.15) and logged[1][2]["t_mse"] > LEARNED_FRACTION / 12
    assert logged[2][2]["t_mse"] == pytest.approx(1 / 12, rel=0.15)  # recorded all the same


@pytest.mark.parametrize("time", ["flow", "fraction"])
def test_a_pool_on_disk_gives_the_batches_a_pool_in_memory_gives(tmp_path, time):
    """``pool.storage`` is a runtime key a resume may change (a machine with less RAM): the disk pool read its rows in
    file order and left them sorted, so the loss summed them in another order and a run resumed with
    ``pool.storage=disk`` trained other bits than the run it continued (and the memory plan's switch to disk another
    model). The same generator gives the same batches, row for row, from either storage."""
    batches = {}
    for storage in ("memory", "disk"):
        (tmp_path / storage).mkdir()
        run, *_ = _fake_run(tmp_path / storage, time, 1.0, storage)
        batches[storage] = nsgf.pool_batches(run)(torch.Generator().manual_seed(0), 40, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(batches["memory"], batches["disk"]))
