"""LR range test: lands in a known good range, survives NaN losses, restores model and optimizer bit for bit."""

import copy
import math

import torch
import torch.nn as nn

from sinkflow.tools.lr_find import lr_range_test, plot, write_lr


def problem(seed=0):
    torch.manual_seed(seed)
    w = torch.randn(8, 1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    gen = torch.Generator().manual_seed(seed)

    def batch_fn(i):
        x = torch.randn(64, 8, generator=gen)
        return x, x @ w

    def loss_fn(m, b):
        return (m(b[0]) - b[1]).pow(2).mean()

    return model, batch_fn, loss_fn


def final_loss(lr, steps=150):
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for i in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, batch_fn(i))
        loss.backward()
        opt.step()
    with torch.no_grad():
        return sum(float(loss_fn(model, batch_fn(1000 + i))) for i in range(5)) / 5


def test_suggestions_land_in_the_good_range():
    grid = [10 ** (e / 2) for e in range(-10, 1)]  # 1e-5 .. 1
    losses = {lr: final_loss(lr) for lr in grid}
    best = min(v for v in losses.values() if math.isfinite(v))
    good = [lr for lr, v in losses.items() if math.isfinite(v) and v <= 3 * best]
    lo, hi = min(good), max(good)
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    res = lr_range_test(model, opt, loss_fn, batch_fn, start_lr=1e-6, end_lr=10, steps=120)
    assert "diverged" in res.stop_reason
    s = res.suggestions
    assert s["conservative"] <= s["moderate"] <= s["aggressive"]
    for name in ("moderate", "aggressive"):
        assert lo / 1.5 <= s[name] <= hi * 1.5, (name, s, lo, hi, losses)
    assert lo / 10 <= s["conservative"] <= hi
    assert final_loss(s["moderate"]) <= 3 * best


def test_restores_model_and_optimizer_bit_identical():
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i in range(3):  # non-trivial optimizer state first
        opt.zero_grad()
        loss_fn(model, batch_fn(i)).backward()
        opt.step()
    w0, o0 = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    rng0 = torch.get_rng_state()
    lr_range_test(model, opt, loss_fn, batch_fn, steps=40)
    for k, v in model.state_dict().items():
        assert torch.equal(v, w0[k]), k
    o1 = opt.state_dict()
    assert o1["param_groups"] == o0["param_groups"]
    for pid, st in o0["state"].items():
        for k, v in st.items():
            assert torch.equal(o1["state"][pid][k], v), (pid, k)
    assert torch.equal(torch.get_rng_state(), rng0)


def test_survives_nan_losses():
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    calls = {"n": 0}

    def flaky(m, b):
        calls["n"] += 1
        loss = loss_fn(m, b)
        return loss * float("nan") if calls["n"] in (10, 30, 31) else loss

    w0 = copy.deepcopy(model.state_dict())
    res = lr_range_test(model, opt, flaky, batch_fn, start_lr=1e-6, end_lr=10, steps=120)
    assert sum(math.isnan(v) for v in res.losses) == 3
    assert res.suggestions, res.stop_reason
    assert all(torch.equal(v, w0[k]) for k, v in model.state_dict().items())
    # a loss that stays NaN ends the sweep instead of crashing
    res = lr_range_test(model, opt, lambda m, b: loss_fn(m, b) * float("nan"), batch_fn, steps=50)
    assert "non-finite" in res.stop_reason and res.suggestions == {}


def test_plot_and_write(tmp_path):
    model, batch_fn, loss_fn = problem()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    res = lr_range_test(model, opt, loss_fn, batch_fn, steps=60)
    png = plot(res, tmp_path / "lr.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    cfg = tmp_path / "cfg.yaml"
    write_lr(cfg, "train.velocity.lr", 3e-4)
    assert "0.0003" in cfg.read_text()


def test_lr_find_cli_on_a_preset_writes_the_run_config(runs_dir):
    from helpers import TINY_2D, cli

    assert cli("train", "moons", *TINY_2D, "--name", "r", "--no-report", cwd=runs_dir.parent).returncode == 0
    run = runs_dir / "r"
    out = cli("lr-find", str(run), "--steps", "40", "--end-lr", "1", "--out", "lr.png", "--write", str(run),
              cwd=runs_dir.parent)
    assert out.returncode == 0, out.stderr
    assert "moderate" in out.stdout and (runs_dir.parent / "lr.png").is_file()
    import yaml

    lr = yaml.safe_load((run / "config.yaml").read_text())["train"]["velocity"]["lr"]
    assert lr != 0.001 and f"train.velocity.lr={lr:.3g}" in out.stdout
