"""An honest evaluation of flows: a validation split carved from train (no image in two splits, selection
never reads test), closed-form baseline densities checked on cases with known answers, and the flow-aware
doctor catching planted faults (a frozen coupling, a log-det sign error)."""

import math

import numpy as np
import pytest
import torch

from sinkflow import methods
from sinkflow.cli import main
from sinkflow.data import build_distribution
from sinkflow.data.images import val_split
from sinkflow.flows import baselines, build_flow
from sinkflow.methods import normalizing_flow as flow_method
from sinkflow.runtime.run_folder import RunFolder

TINY = ["model.flow.levels=2", "model.flow.depth_per_level=2", "model.flow.hidden_channels=16", "--batch-size", "4",
        "train.flow.ckpt_every=2", "train.flow.log_every=1", "train.flow.warmup=2", "eval.n=8", "eval.seeds=1",
        "--device", "cpu"]


@pytest.fixture(autouse=True)
def fresh_distributions():
    methods._distributions.cache_clear()
    yield
    methods._distributions.cache_clear()


# ---- the split ----------------------------------------------------------------------------------

def test_val_split_is_disjoint_fixed_and_covers_train():
    fit, val = val_split(1438, 0.1)
    assert len(val) == 144 and len(fit) == 1294
    assert not set(fit.tolist()) & set(val.tolist()) and sorted([*fit.tolist(), *val.tolist()]) == list(range(1438))
    fit2, val2 = val_split(1438, 0.1)
    assert torch.equal(val, val2) and torch.equal(fit, fit2)  # fixed seed
    assert len(val_split(10, 0.0)[1]) == 0 and len(val_split(3, 0.5)[1]) == 2  # rounding, >= 1 left to fit
    assert len(val_split(2, 0.01)[1]) == 1


def test_digits_no_image_in_two_splits(tmp_path):
    d = build_distribution("digits", data_cfg={"root": str(tmp_path), "val_fraction": 0.1})
    assert len(d) == len(d.fit_index) == 1294 and len(d.val_index) == 144 and len(d.test_images) == 359
    assert d.val_set().shape == (144, 1, 8, 8) and d.fit_images().shape == (1294, 1, 8, 8)
    # everything the train split serves comes from fit_index: record the rows it gathers
    from sinkflow.data import images

    seen, real = [], images._gather

    def spy(arr, idx):
        if arr is d.images:
            seen.append(idx)
        return real(arr, idx)

    images._gather = spy
    try:
        for s in range(20):
            d.sample(64, torch.Generator().manual_seed(s))
    finally:
        images._gather = real
    seen = set(torch.cat(seen).tolist())
    assert len(seen) > 500 and seen <= set(d.fit_index.tolist()) and not seen & set(d.val_index.tolist())
    # by content too: a validation image that is served was a duplicate of a fitting image in the raw data
    fit_rows = {r.tobytes() for r in d.fit_images()}
    val_rows = [r.tobytes() for r in np.asarray(d.images)[d.val_index.numpy()]]
    test_rows = {r.tobytes() for r in np.asarray(d.test_images)}
    assert sum(r in fit_rows for r in val_rows) <= 2 and sum(r in test_rows for r in val_rows) <= 2
    # no validation split: the old behaviour, and val_set says how to get one
    plain = build_distribution("digits", data_cfg={"root": str(tmp_path)})
    assert len(plain) == 1438
    with pytest.raises(Exception, match="val_fraction"):
        plain.val_set()


def test_val_fraction_is_validated(tmp_path):
    with pytest.raises(Exception, match="val_fraction"):
        build_distribution("digits", data_cfg={"root": str(tmp_path), "val_fraction": 0.9})


def test_selection_never_reads_test(runs_dir, tmp_path, monkeypatch):
    args = ["train", "flow-digits", *TINY, f"data.root={tmp_path / 'data'}", "--train-iters", "4", "--name", "s",
            "--no-report", "checkpoint.keep=10"]
    assert main(args) == 0
    run = RunFolder.open(runs_dir / "s")
    _, target = methods.distributions(run.cfg)

    class NoTest:
        def __len__(self):
            raise AssertionError("selection read the test split")

        def __getitem__(self, i):
            raise AssertionError("selection read the test split")

    def no_test_set(*a, **k):
        raise AssertionError("selection read the test split")

    monkeypatch.setattr(target, "test_images", NoTest())
    monkeypatch.setattr(target, "test_set", no_test_set)
    paths = sorted((run.dir / "checkpoints/flow").glob("step_*.pt"))
    best, curve = flow_method.select_checkpoint(run, paths, seeds=1)
    assert [r["step"] for r in curve] == [2, 4] and best in paths
    assert all(math.isfinite(r["val_bpd"]) for r in curve)


def test_eval_reports_val_and_test(runs_dir, tmp_path, capsys):
    args = ["train", "flow-digits", *TINY, f"data.root={tmp_path / 'data'}", "--train-iters", "2", "--name", "e",
            "--no-report"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["eval", str(runs_dir / "e")]) == 0
    out = capsys.readouterr().out
    assert "Validation bits/dim" in out and "Test bits/dim" in out and "held-out split" in out
    # eval.seeds=1: one dequantisation draw, said so (it printed "+- 0.0000 over 1 dequantisation draws")
    bpd = [line for line in out.splitlines() if "bits/dim on" in line]
    assert len(bpd) == 2 and all("one dequantisation draw (no spread)" in x and "+-" not in x for x in bpd), bpd
    assert main(["eval", str(runs_dir / "e"), "--split", "val"]) == 0  # choosing: nothing read from the test split
    out = capsys.readouterr().out
    assert "Validation bits/dim" in out and "Test bits/dim" not in out and "validation split" in out


# ---- baselines ----------------------------------------------------------------------------------

def test_gaussian_known_answer_constant_data():
    """All images identical: the dequantised data is U[k, k+1)^D, the fit N(k + 1/2, I/12), and its expected
    score on the same image is (1/2) log2(2 pi e / 12) bits/dim exactly."""
    k = np.full((50, 5), 3)
    mean, cov = baselines.fit_gaussian(k, 17)
    assert np.allclose(mean, 3.5) and np.allclose(cov, np.eye(5) / 12)
    assert baselines.gaussian_bpd(k, k[:3], 17) == pytest.approx(0.5 * math.log2(2 * math.pi * math.e / 12), abs=1e-12)


def test_gaussian_closed_form_matches_monte_carlo():
    rng = np.random.default_rng(0)
    fit = np.clip(rng.normal(4, 2, (400, 3)) + rng.normal(0, 1, (400, 1)), 0, 8).round().astype(int)
    test = rng.integers(0, 9, (20, 3))
    mean, cov = baselines.fit_gaussian(fit, 9)
    deq = np.concatenate([fit + rng.random(fit.shape) for _ in range(200)])  # the fit, by sampling the noise
    assert np.allclose(mean, deq.mean(0), atol=0.01) and np.allclose(cov, np.cov(deq.T, bias=True), atol=0.02)
    dist = torch.distributions.MultivariateNormal(torch.tensor(mean), torch.tensor(cov))
    u = torch.rand(20000, *test.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mc = float(-dist.log_prob(torch.tensor(test) + u).mean()) / (3 * math.log(2))
    assert baselines.gaussian_bpd(fit, test, 9) == pytest.approx(mc, abs=2e-3)


def test_histogram_and_uniform_known_answers():
    assert baselines.uniform_bpd(17) == pytest.approx(math.log2(17))
    fit = np.array([[0, 1], [1, 1]])
    # pixel 0: counts (1, 1) + 1 -> 1/2 each; pixel 1: (0, 2) + 1 -> (1/4, 3/4)
    assert baselines.independent_pixel_bpd(fit, np.array([[0, 1]]), 2) == pytest.approx((1 + math.log2(4 / 3)) / 2)
    with pytest.raises(Exception, match="levels"):
        baselines.gaussian_bpd(fit, np.array([[0, 2]]), 2)


# ---- the flow-aware doctor -----------------------------------------------------------------------

DIGITS_BPD = 2.39  # independent-pixel bits/dim of the digits (benchmarks/RESULTS.md)
OVERFIT_STEPS = 200


def digits_batch(n=8):
    from sklearn.datasets import load_digits

    k = torch.tensor(load_digits().images[:n], dtype=torch.float32).unsqueeze(1)
    return k  # levels 0..16


def overfit_step(model, levels, n_bins=17, lr=1e-2):
    from sinkflow.flows import bits_per_dim, preprocess

    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    with torch.no_grad():
        model.log_prob(preprocess(levels + 0.5, n_bins))  # ActNorm init

    def step():
        x = preprocess(levels + torch.rand(levels.shape, generator=gen), n_bins)
        loss = bits_per_dim(model.log_prob(x), x[0].numel(), n_bins).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def small_flow():
    torch.manual_seed(0)
    return build_flow({"levels": 2, "depth_per_level": 2, "hidden_channels": 32, "logit_alpha": 0.001}, (1, 8, 8))


def test_doctor_flow_overfit_rule_passes_a_healthy_flow():
    from sinkflow.tools import doctor

    model = small_flow()
    levels = digits_batch()
    assert doctor.check_flow_trainable(model).ok
    assert doctor.check_flow_logdet(model, (levels + 0.5) / 17 - 0.5).ok
    f = doctor.overfit_one_batch_bpd(overfit_step(model, levels), DIGITS_BPD, steps=OVERFIT_STEPS)
    assert f.ok, f.line()


def test_doctor_catches_a_frozen_coupling():
    from sinkflow.flows import AffineCoupling
    from sinkflow.tools import doctor

    model = small_flow()
    coupling = [m for m in model.modules() if isinstance(m, AffineCoupling)][1]
    coupling.requires_grad_(False)  # one frozen coupling: invisible to the trainable-only wiring checks
    f = doctor.check_flow_trainable(model)
    assert f.ok is False and "frozen" in f.symptom and "levels.0.layers" in f.symptom
    # every coupling frozen: the flow is linear and cannot fit even one batch
    for m in model.modules():
        if isinstance(m, AffineCoupling):
            m.requires_grad_(False)
    f = doctor.overfit_one_batch_bpd(overfit_step(model, digits_batch()), DIGITS_BPD, steps=OVERFIT_STEPS)
    assert f.ok is False and "cannot fit even one batch" in f.cause, f.line()


def test_doctor_catches_a_logdet_sign_error(monkeypatch):
    from sinkflow.flows import coupling
    from sinkflow.tools import doctor

    original = coupling._Coupling._couple

    def wrong_sign(self, act, shift, scale, log_scale, n):
        y, logdet = original(self, act, shift, scale, log_scale, n)
        return y, -logdet

    monkeypatch.setattr(coupling._Coupling, "_couple", wrong_sign)
    model = small_flow()
    levels = digits_batch()
    f = doctor.check_flow_logdet(model, (levels + 0.5) / 17 - 0.5)
    assert f.ok is False and "slogdet" in f.symptom
    f = doctor.overfit_one_batch_bpd(overfit_step(model, levels), DIGITS_BPD, steps=OVERFIT_STEPS)
    assert f.ok is False and "not normalised" in f.cause, f.line()


def test_published_bits_per_dim_only_beside_the_images_they_were_measured_on():
    """flow-cifar10 at data.image_size=16 (or data.channels=1) printed Glow's 3.35 "for context" beside its own
    bits/dim, which depends on the resolution and channels: the published numbers are for 256 levels at the set's
    own shape only."""
    from sinkflow.methods.normalizing_flow import published_bpd

    assert [v for _, v in published_bpd("cifar10", 256, (3, 32, 32))] == [3.49, 3.35]
    assert [v for _, v in published_bpd("mnist", 256, (1, 28, 28))] == [1.06, 1.05]
    for target, bins, shape in (("cifar10", 256, (3, 16, 16)), ("cifar10", 256, (1, 32, 32)),
                                ("cifar10", 32, (3, 32, 32)), ("mnist", 256, (1, 32, 32)), ("digits", 256, (1, 8, 8))):
        assert published_bpd(target, bins, shape) == [], (target, bins, shape)
