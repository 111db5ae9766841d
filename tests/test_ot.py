"""OT core: the NSGF velocity against an independent log-domain Sinkhorn, batching, W2, bad input."""

from __future__ import annotations

import itertools
import logging
import math
import re
import warnings

import numpy as np
import pytest
import torch
from geomloss import SamplesLoss
from scipy.optimize import linear_sum_assignment

from sinkflow.errors import SinkflowError
from sinkflow.ot import (
    energy_distance,
    eta_schedule,
    max_batches_in_flight,
    safe_diameter,
    simulate_sinkhorn_flow,
    sinkhorn_peak_bytes,
    sinkhorn_velocity,
    sinkhorn_velocity_batched,
    w2,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These problems are tiny: intra-op threads only add wake-up latency on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------
# independent reference: plain log-domain Sinkhorn in float64, run to convergence


def _log_sinkhorn(a_pts: torch.Tensor, b_pts: torch.Tensor, eps: float, tol: float = 1e-10):
    """Potentials (f, g) of OT_eps between uniform clouds, cost |x - y|^2 / 2, alternating updates."""
    C = ((a_pts[:, None, :] - b_pts[None, :, :]) ** 2).sum(-1) / 2
    n, m = C.shape
    log_a, log_b = -math.log(n), -math.log(m)
    f = torch.zeros(n, dtype=torch.float64)
    g = torch.zeros(m, dtype=torch.float64)
    for _ in range(20000):
        f = -eps * torch.logsumexp(log_b + (g[None, :] - C) / eps, dim=1)
        g = -eps * torch.logsumexp(log_a + (f[:, None] - C) / eps, dim=0)
        # after the g update the column marginals are exact; check the row marginals
        row = torch.exp(log_a + log_b + (f[:, None] + g[None, :] - C) / eps).sum(1)
        if (row * n - 1).abs().max() < tol:
            break
    return C, g


def reference_velocity(x: torch.Tensor, y: torch.Tensor, blur: float) -> torch.Tensor:
    """v_i = sum_j P_{j|i} y_j - sum_k Q_{k|i} x_k (nsgf_paper.md 1.4), in float64."""
    eps = blur**2
    xf = x.reshape(len(x), -1).double()
    yf = y.reshape(len(y), -1).double()

    def projection(src, tgt):
        C, g = _log_sinkhorn(src, tgt, eps)
        P = torch.softmax(-math.log(len(tgt)) + (g[None, :] - C) / eps, dim=1)
        return P @ tgt

    return (projection(xf, yf) - projection(xf, xf)).reshape(x.shape)


def _images(n: int, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian noise source and smooth synthetic images in [-1, 1] as target (no data download)."""
    gen = torch.Generator().manual_seed(seed)
    D = math.prod(shape)
    x = torch.randn(n, D, generator=gen)
    basis = torch.nn.functional.avg_pool1d(torch.randn(8, 1, D, generator=gen), 9, 1, 4)[:, 0] * 3
    y = torch.tanh(torch.randn(n, 8, generator=gen) @ basis)
    return x.reshape(n, *shape), y.reshape(n, *shape)


def _clouds_2d(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=gen)
    y = 0.5 * torch.randn(n, 2, generator=gen) + torch.tensor([2.0, 0.5])
    return x, y


# (shape, n, blur, scaling, relative tolerance on max|v - v_ref| / max|v_ref|).
# The residual is GeomLoss's epsilon-annealing truncation (one iteration at the final epsilon),
# measured at 4.4e-4 (2D), 9.6e-4 (28x28), 5.0e-4 (32x32); it shrinks as scaling -> 1
# (28x28: 3.5e-3 at scaling 0.9, 2.9e-3 at 0.95, 4.7e-4 at 0.99).
CASES = [
    ((2,), 32, 0.5, 0.99, 1e-2),
    ((1, 28, 28), 32, 4.0, 0.98, 3e-3),
    ((3, 32, 32), 16, 8.0, 0.98, 3e-3),
]


@pytest.mark.parametrize("shape,n,blur,scaling,rtol", CASES, ids=["2d", "1x28x28", "3x32x32"])
def test_velocity_matches_log_domain_reference(shape, n, blur, scaling, rtol):
    if len(shape) == 1:
        x, y = _clouds_2d(n, seed=1)
    else:
        x, y = _images(n, shape, seed=2)
    v = sinkhorn_velocity(x, y, blur=blur, scaling=scaling)
    ref = reference_velocity(x, y, blur)
    assert v.shape == x.shape and v.dtype == torch.float32
    scale = ref.abs().max().item()
    err = (v.double() - ref).abs().max().item()
    assert err <= rtol * scale, f"max abs error {err:.3g} vs scale {scale:.3g}"
    # the entropic plans must be informative: v is far from the plain mean shift mean(y) - mean(x)
    shift = (y.double().mean(0) - x.double().mean(0)).expand_as(ref)
    assert (ref - shift).abs().max().item() > 0.1 * scale


@pytest.mark.parametrize("n,m,dim,blur", [(24, 17, 2, 0.5), (12, 19, 50, 3.0)], ids=["2d", "50d"])
def test_velocity_is_minus_the_sinkhorn_divergences_gradient(n, m, dim, blur):
    """Paper eq. 13 against GeomLoss's debiased Sinkhorn divergence S (cost |x - y|^2 / 2, epsilon = blur^2): the first
    variation's gradient at x_i is n dS/dx_i, so v = -n grad S, here with unequal sizes and float64 input."""
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    y = 0.5 * torch.randn(m, dim, generator=gen, dtype=torch.float64) + 1.0
    xg = x.clone().requires_grad_(True)
    S = SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.995, debias=True)(xg, y)
    (grad,) = torch.autograd.grad(S, xg)
    v = sinkhorn_velocity(x, y, blur=blur, solver="converged", tol=1e-6, max_iters=2000)
    assert (v.double() + n * grad).abs().max().item() <= 3e-3 * grad.abs().max().item() * n


@pytest.mark.parametrize("solver", ["geomloss", "converged"])
def test_clouds_far_from_the_origin_get_the_velocity_of_the_same_clouds_at_it(solver):
    """The float32 costs |x|^2 + |y|^2 - 2 x.y lost the clouds' spread to cancellation at (1000, 700) from the origin:
    velocities 5-7 % off at blur 0.2, silently. The velocity does not change under a common shift; a batch far from
    the origin is now solved shifted, and one around it (every preset's) is handed on as it is."""
    x, y = _clouds_2d(64, seed=1)
    shift = torch.tensor([1000.0, 700.0])
    near = sinkhorn_velocity(x, y, blur=0.2, solver=solver)
    far = sinkhorn_velocity(x + shift, y + shift, blur=0.2, solver=solver)
    assert (far - near).abs().max().item() <= 1e-4 * near.abs().max().item()
    X, Y = torch.stack([x, x + shift]), torch.stack([y, y + shift])  # one batch at the origin, one far: per batch
    batched = sinkhorn_velocity_batched(X, Y, blur=0.2, solver=solver)
    near = sinkhorn_velocity(x, y, blur=0.2, diameter=safe_diameter(X, Y, batched=True), solver=solver)  # same schedule
    assert torch.equal(batched[0], near)
    assert (batched[1] - near).abs().max().item() <= 1e-4 * near.abs().max().item()
    from sinkflow.ot.precision import centred

    cx, cy = centred(x[None], y[None])
    assert torch.equal(cx[0], x) and torch.equal(cy[0], y)  # around the origin: the same values, bit for bit


def test_centring_reads_nothing_on_the_host(monkeypatch):
    """The far-from-origin check read its flag with bool(): a device sync per Sinkhorn call of a GPU pool build."""
    from sinkflow.ot.precision import centred

    def read(*args):
        raise AssertionError("a host read")

    for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, read)
    x, y = _clouds_2d(16, seed=1)
    X, Y = torch.stack([x, x + 1000.0]), torch.stack([y, y + 1000.0])
    cx, cy = centred(X, Y)
    monkeypatch.undo()
    assert torch.equal(cx[0], x) and cx[1].abs().max() < 10 and cy[1].abs().max() < 10  # the far batch moved


def test_one_euler_step_moves_towards_target():
    x, y = _clouds_2d(64, seed=3)
    v = sinkhorn_velocity(x, y, blur=0.3, scaling=0.8)
    x1 = x + 0.1 * v
    assert w2(x1, y) < w2(x, y) - 0.05
    S = SamplesLoss("sinkhorn", p=2, blur=0.3, scaling=0.8, debias=True)
    assert S(x1, y).item() < S(x, y).item()
    # the wrong sign moves away
    assert w2(x - 0.1 * v, y) > w2(x, y)


@pytest.mark.parametrize("shape", [(2,), (1, 28, 28)], ids=["2d", "1x28x28"])
def test_batched_equals_one_at_a_time(shape):
    B, n = 4, 24
    xs, ys = [], []
    for b in range(B):
        x, y = _clouds_2d(n, seed=10 + b) if len(shape) == 1 else _images(n, shape, seed=10 + b)
        xs.append(x)
        ys.append(y)
    X, Y = torch.stack(xs), torch.stack(ys)
    blur = 0.5 if len(shape) == 1 else 4.0
    diam = safe_diameter(X, Y, batched=True)
    vb = sinkhorn_velocity_batched(X, Y, blur=blur, scaling=0.9, diameter=diam)
    assert vb.shape == X.shape
    for b in range(B):
        v1 = sinkhorn_velocity(xs[b], ys[b], blur=blur, scaling=0.9, diameter=diam)
        # same iterations, only the batching differs: float32 rounding
        torch.testing.assert_close(vb[b], v1, rtol=0, atol=1e-5 * max(1.0, v1.abs().max().item()))


def test_unequal_sizes_use_two_calls_and_match_reference():
    x, _ = _clouds_2d(20, seed=4)
    _, y = _clouds_2d(28, seed=5)
    v = sinkhorn_velocity(x, y, blur=1.0, scaling=0.95)
    ref = reference_velocity(x, y, 1.0)
    assert (v.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


def test_float32_outside_autocast_and_settings_restored():
    x, y = _clouds_2d(32, seed=6)
    plain = sinkhorn_velocity(x, y, blur=0.5)
    matmul = torch.backends.cuda.matmul
    # a caller's TF32 in this torch's API: fp32_precision from torch 2.9, allow_tf32 before (strict_float32 reads both)
    key, tf32 = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    before = getattr(matmul, key)
    setattr(matmul, key, tf32)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            inside = sinkhorn_velocity(x.double(), y.double(), blur=0.5)
            assert not torch.is_grad_enabled()  # GeomLoss flips grad mode on globally; we restore it
        assert getattr(matmul, key) == tf32
    finally:
        setattr(matmul, key, before)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, plain, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# the flow


def test_simulate_shapes_states_and_w2_decrease():
    x0, y = _clouds_2d(48, seed=7)
    steps, eta = 5, 0.5
    xs, vs = simulate_sinkhorn_flow(x0, y, steps=steps, eta=eta, blur=0.3, scaling=0.8)
    assert xs.shape == vs.shape == (steps, 48, 2)
    torch.testing.assert_close(xs[0], x0)
    for k in range(steps - 1):  # state stored before each update: exactly `steps` updates
        torch.testing.assert_close(xs[k + 1], xs[k] + eta * vs[k])
    final = xs[-1] + eta * vs[-1]
    dists = [w2(xs[k], y) for k in range(steps)] + [w2(final, y)]
    assert all(b < a for a, b in zip(dists, dists[1:])), dists
    assert dists[-1] < 0.3 * dists[0]
    # the first velocity is the plain velocity at x0
    torch.testing.assert_close(vs[0], sinkhorn_velocity(x0, y, blur=0.3, scaling=0.8), rtol=0, atol=1e-6)


def test_simulate_batched_images_and_eta_growth():
    B, n, shape = 3, 16, (1, 28, 28)
    pairs = [_images(n, shape, seed=20 + b) for b in range(B)]
    X = torch.stack([p[0] for p in pairs])
    Y = torch.stack([p[1] for p in pairs])
    etas = eta_schedule(0.5, 4, growth=4.0)
    assert etas == pytest.approx([0.5 * math.exp(4.0 * (k - 4) / 4) for k in range(4)])
    assert eta_schedule(0.5, 3) == [0.5, 0.5, 0.5]
    xs, vs = simulate_sinkhorn_flow(X, Y, steps=4, eta=0.5, blur=4.0, scaling=0.8, eta_growth=4.0, batched=True)
    assert xs.shape == vs.shape == (4, B, n, *shape)
    for k in range(3):
        torch.testing.assert_close(xs[k + 1], xs[k] + etas[k] * vs[k])
    final = xs[-1] + etas[-1] * vs[-1]
    for b in range(B):
        assert w2(final[b], Y[b]) < w2(X[b], Y[b])


# ----------------------------------------------------------------------------------------------
# exact W2


def test_w2_against_brute_force_permutations():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 2)), rng.normal(size=(6, 2)) + 1.0
    cost = ((x[:, None] - y[None]) ** 2).sum(-1)
    brute = min(cost[range(6), list(p)].mean() for p in itertools.permutations(range(6)))
    assert w2(torch.from_numpy(x), torch.from_numpy(y)) == pytest.approx(math.sqrt(brute), rel=1e-9)
    # larger sets and image-shaped samples: the assignment problem gives the same value
    x, y = rng.normal(size=(40, 1, 3, 3)), rng.normal(size=(40, 1, 3, 3)) * 2
    cost = ((x.reshape(40, -1)[:, None] - y.reshape(40, -1)[None]) ** 2).sum(-1)
    r, c = linear_sum_assignment(cost)
    assert w2(torch.from_numpy(x).float(), torch.from_numpy(y).float()) == pytest.approx(
        math.sqrt(cost[r, c].mean()), rel=1e-5
    )
    assert w2(x, x) == pytest.approx(0.0, abs=1e-6)  # sqrt of float64 round-off


@pytest.mark.parametrize("solver", ["assignment", "emd"])
@pytest.mark.parametrize("shape", [(2,), (1, 28, 28), (3, 32, 32)])
def test_ot_permutation_is_pots_exact_plan(shape, solver, monkeypatch):
    """The minibatch coupling, by either of its solvers (SciPy's assignment up to ASSIGNMENT_MAX_N rows, POT's EMD
    above), is POT's EMD plan row for row at the experiments' shapes; at 6 points it is the brute-force optimum."""
    import ot

    from sinkflow.ot import exact
    from sinkflow.ot.exact import ot_permutation

    monkeypatch.setattr(exact, "ASSIGNMENT_MAX_N", 64 if solver == "assignment" else 0)

    gen = torch.Generator().manual_seed(len(shape))
    for n in (6, 64):
        x0, x1 = torch.randn(n, *shape, generator=gen), torch.randn(n, *shape, generator=gen) + 0.5
        cost = (torch.cdist(x0.flatten(1).double(), x1.flatten(1).double()) ** 2).numpy()
        plan = ot.emd(np.full(n, 1 / n), np.full(n, 1 / n), cost)
        perm = ot_permutation(x0, x1)
        assert perm.dtype == torch.int64 and perm.tolist() == plan.argmax(axis=1).tolist()
        if n == 6:
            best = min(itertools.permutations(range(6)), key=lambda p: cost[range(6), list(p)].sum())
            assert perm.tolist() == list(best)


@pytest.mark.parametrize("scale", [1e-6, 1e-8])
def test_exact_ot_does_not_depend_on_the_scale_of_the_points(scale, monkeypatch):
    """POT's network simplex stopped at a non-optimal plan on tiny costs (points spread 1e-6: W2 7e-5 high, 1e-8: 3x
    high; the same for the EMD coupling above ASSIGNMENT_MAX_N rows): W2 scales with the points and the coupling is
    the assignment's optimum at any scale."""
    from sinkflow.ot import exact
    from sinkflow.ot.exact import ot_permutation

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 2)), rng.normal(size=(200, 2)) + 0.3
    assert w2(x * scale, y * scale) == pytest.approx(scale * w2(x, y), rel=1e-9)
    monkeypatch.setattr(exact, "ASSIGNMENT_MAX_N", 0)  # the EMD solver
    cost = ((x[:, None] - y[None]) ** 2).sum(-1)
    r, c = linear_sum_assignment(cost)
    perm = ot_permutation(torch.from_numpy(x * scale), torch.from_numpy(y * scale)).numpy()
    assert cost[r, perm].sum() == pytest.approx(cost[r, c].sum(), rel=1e-9)


@pytest.mark.parametrize("assignment_max_n", [1024, 0], ids=["assignment", "emd"])
def test_exact_ot_does_not_depend_on_where_the_points_are(assignment_max_n, monkeypatch):
    """The float64 cost |a|^2 + |b|^2 - 2 a.b (cdist) lost the batches' spread to cancellation far from the origin:
    40 points of spread 1e-3 at 1e4 were paired 0.6 % (assignment) and 1.1 % (EMD) above the optimal cost (audit Z).
    A common shift changes no assignment; around the origin nothing is shifted (the permutation is the same bits)."""
    from sinkflow.ot import exact
    from sinkflow.ot.exact import ot_permutation

    monkeypatch.setattr(exact, "ASSIGNMENT_MAX_N", assignment_max_n)
    rng = np.random.default_rng(3)
    x, y = 1e-3 * rng.normal(size=(40, 2)), 1e-3 * rng.normal(size=(40, 2))
    cost = ((x[:, None] - y[None]) ** 2).sum(-1)
    r, c = linear_sum_assignment(cost)
    perm = ot_permutation(torch.from_numpy(x + 1e4), torch.from_numpy(y + 1e4)).numpy()
    assert cost[r, perm].sum() == pytest.approx(cost[r, c].sum(), rel=1e-9)
    assert np.array_equal(ot_permutation(torch.from_numpy(x), torch.from_numpy(y)).numpy(), c)


def test_fm_and_otcfm_targets_are_torchcfms():
    """FM's and OT-CFM's (t, x_t, u_t) are torchcfm's ConditionalFlowMatcher's at sigma = 0, OT-CFM's on the pairs of
    ExactOptimalTransportConditionalFlowMatcher's plan, which is our permutation (torchcfm then draws pairs from it
    with replacement; we use each once: docs/nsgfpp.md)."""
    from torchcfm.conditional_flow_matching import (
        ConditionalFlowMatcher,
        ExactOptimalTransportConditionalFlowMatcher,
    )

    from sinkflow.methods.flow_matching import FM, OTCFM

    gen = torch.Generator().manual_seed(0)
    x0, x1, t = torch.randn(33, 1, 3, 3, generator=gen), torch.randn(33, 1, 3, 3, generator=gen) + 2, torch.rand(33)
    plan = ExactOptimalTransportConditionalFlowMatcher().ot_sampler.get_map(x0, x1)
    assert np.allclose(plan.max(1), 1 / 33)  # a permutation
    for method, pairs in ((FM, x1), (OTCFM, x1[torch.from_numpy(plan.argmax(1))])):
        _, xt, ut = ConditionalFlowMatcher(sigma=0.0).sample_location_and_conditional_flow(x0, pairs, t=t)
        t_ours, xt_ours, ut_ours = method.sample_location_and_conditional_flow(x0, x1, t=t)
        assert torch.equal(t_ours, t) and torch.allclose(xt_ours, xt, atol=1e-6) and torch.equal(ut_ours, ut)


@pytest.mark.parametrize("solver", ["assignment", "emd"])
def test_ot_permutation_is_optimal_on_ties_duplicates_and_odd_sizes(solver, monkeypatch):
    """Ties (a shifted grid), repeated points, constant batches, 1-D (the sorted matching), one row, odd sizes: a
    permutation whose cost is the assignment optimum's."""
    from sinkflow.ot import exact
    from sinkflow.ot.exact import ot_permutation

    monkeypatch.setattr(exact, "ASSIGNMENT_MAX_N", 64 if solver == "assignment" else 0)
    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(np.arange(5.0), np.arange(5.0)), -1).reshape(-1, 2)
    few = rng.normal(size=(4, 2))
    cases = [(grid, grid + 0.5), (np.repeat(few, 5, 0), rng.normal(size=(20, 2))),
             (np.repeat(few, 5, 0), np.repeat(rng.normal(size=(5, 2)), 4, 0)), (np.zeros((9, 2)), np.ones((9, 2))),
             (rng.normal(size=(33, 1)), 3 * rng.normal(size=(33, 1))),
             (rng.normal(size=(1, 2)), rng.normal(size=(1, 2))),
             (rng.normal(size=(31, 1, 2, 2)), rng.normal(size=(31, 1, 2, 2)))]
    for a, b in cases:
        perm = ot_permutation(torch.from_numpy(a), torch.from_numpy(b)).numpy()
        assert sorted(perm.tolist()) == list(range(len(a)))
        cost = ((a.reshape(len(a), -1)[:, None] - b.reshape(len(b), -1)[None]) ** 2).sum(-1)
        r, c = linear_sum_assignment(cost)
        assert cost[r, perm].sum() == pytest.approx(cost[r, c].sum(), rel=1e-12, abs=1e-12)
        if a.shape[1:] == (1,):
            assert perm.tolist() == np.argsort(b[:, 0])[np.argsort(np.argsort(a[:, 0]))].tolist()


def test_ot_permutation_refuses_unequal_or_non_finite_batches():
    from sinkflow.ot.exact import ot_permutation

    with pytest.raises(SinkflowError, match="equal-size batches; got 8 and 9 rows; draw as many"):
        ot_permutation(torch.randn(8, 2), torch.randn(9, 2))
    with pytest.raises(SinkflowError, match="holds NaN/Inf values; check the data"):
        ot_permutation(torch.randn(8, 2), torch.full((8, 2), float("inf")))


def test_a_flow_that_overflows_before_its_exact_landing_is_a_clear_error():
    """eta = 1e38 sends the particles to Inf after the first step: the landing's OT solver is never handed them."""
    x, y = torch.randn(64, 2), torch.randn(64, 2) + 3
    with pytest.raises(SinkflowError, match=r"NaN/Inf before its exact landing \(step 1 of 2\); lower eta"):
        simulate_sinkhorn_flow(x, y, steps=2, eta=1e38, blur=0.5, landing="exact")


@pytest.mark.parametrize("solver", ["geomloss", "converged"])
def test_points_outside_float32s_range_are_a_clear_error(solver):
    """The solve runs in float32: a flow whose eta is too large grows its particles ~eta-fold per step until the
    squared diameter overflows, which ended in numpy's 'Maximum allowed size exceeded' (GeomLoss) or torch's
    'unsupported range: inf' (converged) instead of the flow's own message; data at 1e-25 gave NaN velocities."""
    x, y = _clouds_2d(16, seed=0)
    with pytest.raises(SinkflowError, match=r"particles left float32's range at step 5 of 6 .*; lower eta or raise"):
        simulate_sinkhorn_flow(x, y, steps=6, eta=1e4, blur=0.5, solver=solver)
    for scale in (1e19, 1e-25):
        with pytest.raises(SinkflowError, match=r"outside float32's range.*; rescale the data to a spread of about 1"):
            sinkhorn_velocity(x * scale, y * scale, blur=0.5 * scale, solver=solver)
    v = sinkhorn_velocity(x * 1e15, y * 1e15, blur=0.5e15, solver=solver)  # large, but inside the range
    assert torch.isfinite(v).all()


def test_w2_bad_input():
    x = torch.randn(8, 2)
    with pytest.raises(SinkflowError, match="NaN"):
        w2(x, torch.full((8, 2), float("nan")))
    with pytest.raises(SinkflowError, match="per-sample shapes differ"):
        w2(x, torch.randn(8, 3))


def test_w2_and_energy_distance_do_not_move_when_both_sets_are_shifted_far_from_the_origin():
    """Both are translation-invariant; computed as |x|^2 + |y|^2 - 2 x.y (POT's ot.dist, torch.cdist) they were not:
    two unit-spread clouds shifted to 1e7 had a W2 2% low, and an energy distance at 1e6 was 2% off."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(300, 2)), rng.normal(size=(300, 2))
    x_in = x + 1e7
    kept = x_in.copy()
    assert w2(x_in, y + 1e7) == pytest.approx(w2(x, y), rel=1e-8)
    assert energy_distance(x + 1e6, y + 1e6) == pytest.approx(energy_distance(x, y), rel=1e-6)
    w2(torch.from_numpy(x_in), y), energy_distance(torch.from_numpy(x_in), y)  # a float64 tensor shares its memory
    assert np.array_equal(x_in, kept)  # the caller's points are not shifted in place


def test_energy_distance_against_brute_force():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(7, 2)), rng.normal(size=(5, 2)) * 2 + 1
    d = lambda a, b: math.dist(a, b)  # noqa: E731
    cross = sum(d(a, b) for a in x for b in y) / 35
    xx = sum(d(x[i], x[j]) for i in range(7) for j in range(7) if i != j) / 42
    yy = sum(d(y[i], y[j]) for i in range(5) for j in range(5) if i != j) / 20
    assert energy_distance(x, y) == pytest.approx(2 * cross - xx - yy, rel=1e-12)
    assert energy_distance(torch.from_numpy(x), torch.from_numpy(y)) == pytest.approx(energy_distance(y, x), rel=1e-12)
    # image-shaped samples are flattened; row blocks do not change the sums
    imgs = rng.normal(size=(1500, 1, 2, 2))
    flat = imgs.reshape(1500, -1)
    cross = np.linalg.norm(flat[:, None] - flat[None, :40], axis=-1).mean()
    self_ = np.linalg.norm(flat[:, None] - flat[None], axis=-1).sum() / (1500 * 1499)
    self_40 = np.linalg.norm(flat[:40, None] - flat[None, :40], axis=-1).sum() / (40 * 39)
    assert energy_distance(imgs, imgs[:40]) == pytest.approx(2 * cross - self_ - self_40, abs=1e-7)


def test_energy_distance_is_unbiased_and_prefers_the_exact_distribution():
    """Averaged over many small draws, two draws of one distribution score 0 (the V-statistic, with the self
    terms' zero diagonals kept, does not), and a contracted sampler scores above the exact one."""
    rng = np.random.default_rng(2)
    centres = np.array([[-2.0, 0.0], [2.0, 0.0]])
    draw = lambda n: centres[rng.integers(0, 2, n)] + 0.3 * rng.normal(size=(n, 2))  # noqa: E731
    same = [energy_distance(draw(16), draw(16)) for _ in range(400)]
    se = np.std(same) / math.sqrt(len(same))
    assert abs(np.mean(same)) < 3 * se
    v_stat = [2 * SamplesLoss("energy")(torch.from_numpy(a), torch.from_numpy(b)).item()
              for a, b in ((draw(16), draw(16)) for _ in range(400))]
    assert np.mean(v_stat) > 10 * se  # the biased estimator is off by O(1/n)
    hedged = [energy_distance(0.8 * draw(16), draw(16)) for _ in range(400)]
    assert np.mean(hedged) - np.mean(same) > 3 * se


def test_energy_distance_bad_input():
    x = torch.randn(8, 2)
    with pytest.raises(SinkflowError, match="NaN"):
        energy_distance(x, torch.full((8, 2), float("nan")))
    with pytest.raises(SinkflowError, match="per-sample sizes differ"):
        energy_distance(x, torch.randn(8, 3))
    with pytest.raises(SinkflowError, match="at least 2 points"):
        energy_distance(x[:1], x)


# ----------------------------------------------------------------------------------------------
# degenerate input: a clear SinkflowError before GeomLoss runs


def _bad(x, y, **kw):
    kw.setdefault("blur", 0.5)
    return lambda: sinkhorn_velocity(x, y, **kw)


X2, Y2 = _clouds_2d(16, seed=8)
NAN = X2.clone()
NAN[3, 1] = float("nan")
INF = Y2.clone()
INF[0, 0] = float("inf")
PERM = X2[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
BAD = [
    ("nan-x", _bad(NAN, Y2), "x contains NaN or Inf"),
    ("inf-y", _bad(X2, INF), "y contains NaN or Inf"),
    ("shape", _bad(X2, torch.randn(16, 3)), "per-sample shapes differ"),
    ("image-shape", _bad(torch.randn(4, 1, 28, 28), torch.randn(4, 3, 32, 32)), "per-sample shapes differ"),
    ("one-point", _bad(X2[:1], Y2), "too few points"),
    ("1d", _bad(torch.randn(16), torch.randn(16)), "must be shaped"),
    ("identical", _bad(X2, X2.clone()), "identical point clouds"),
    ("identical-permuted", _bad(X2, PERM), "identical point clouds"),
    ("blur-zero", _bad(X2, Y2, blur=0.0), "blur must be a positive"),
    ("blur-negative", _bad(X2, Y2, blur=-1.0), "blur must be a positive"),
    ("scaling", _bad(X2, Y2, scaling=1.0), "scaling must lie in"),
    ("diameter", _bad(X2, Y2, diameter=0.0), "diameter must be a positive"),
    ("integer", _bad(X2.to(torch.uint8), Y2), "non-floating dtype"),
    ("backend", _bad(X2, Y2, backend="multiscale"), "unknown Sinkhorn backend"),
    (
        "batched-identical",
        lambda: sinkhorn_velocity_batched(torch.stack([X2, Y2]), torch.stack([Y2, Y2]), blur=0.5),
        r"identical point clouds \(pool batches \[1\]\)",
    ),
    (
        "batched-count",
        lambda: sinkhorn_velocity_batched(torch.stack([X2, X2]), Y2[None], blur=0.5),
        "pool batches but y holds",
    ),
    (
        "simulate-steps",
        lambda: simulate_sinkhorn_flow(X2, Y2, steps=0, eta=0.1, blur=0.5),
        "steps must be a positive",
    ),
    (
        "simulate-nan",
        lambda: simulate_sinkhorn_flow(NAN, Y2, steps=2, eta=0.1, blur=0.5),
        "x contains NaN",
    ),
]


@pytest.mark.parametrize("call,message", [(c, m) for _, c, m in BAD], ids=[i for i, _, _ in BAD])
def test_degenerate_input_raises_clear_error(call, message):
    with pytest.raises(SinkflowError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# memory sizing


def test_peak_estimate_bounds_measured_cpu_peak():
    from sinkflow.ot.sinkhorn_peak import OVERHEAD_BYTES, measured_cpu_peak_bytes

    B, n, D = 3, 96, 40
    peak = measured_cpu_peak_bytes(B, n, D, blur=1.0, scaling=0.8, diameter=20.0)
    est = sinkhorn_peak_bytes(B, n, D)
    assert peak > 0
    assert 0.5 * (est - OVERHEAD_BYTES) <= peak <= est, (peak, est)  # an upper bound, not a loose one


def test_max_batches_in_flight_fits_budget():
    for n, D, budget in [(256, 2, 2**30), (64, 784, 2**28), (128, 3072, 10 * 2**30)]:
        B = max_batches_in_flight(n, D, budget)
        assert B >= 1
        assert sinkhorn_peak_bytes(B, n, D) <= budget < sinkhorn_peak_bytes(B + 1, n, D)
    assert max_batches_in_flight(256, 2, 2**31) >= 2 * max_batches_in_flight(256, 2, 2**30) - 1
    with pytest.raises(SinkflowError, match="needs about .* MiB"):
        max_batches_in_flight(4096, 3072, 2**20)


def test_cpu_chunking_gives_the_same_velocities(monkeypatch):
    import sinkflow.ot.velocity as vel

    X = torch.stack([_clouds_2d(20, seed=30 + b)[0] for b in range(5)])
    Y = torch.stack([_clouds_2d(20, seed=40 + b)[1] for b in range(5)])
    whole = sinkhorn_velocity_batched(X, Y, blur=0.5, diameter=10.0)
    monkeypatch.setattr(vel, "CPU_CHUNK_BYTES", 2 * 20 * 20 * 4 * 2)  # chunks of 2 batches: 2 + 2 + 1
    chunked = sinkhorn_velocity_batched(X, Y, blur=0.5, diameter=10.0)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)


# The converged solver at a small blur, where GeomLoss's one pass is far off: every shape, against the
# independent float64 reference. GeomLoss at scaling 0.9 is shown to be off at the same epsilon, so the
# test would fail if the solver fell back to it.
@pytest.mark.parametrize("shape,n,blur", [((2,), 48, 0.15), ((1, 28, 28), 32, 2.0), ((3, 32, 32), 16, 4.0)],
                         ids=["2d", "1x28x28", "3x32x32"])
def test_converged_solver_matches_reference_where_geomloss_does_not(shape, n, blur):
    x, y = _clouds_2d(n, seed=3) if len(shape) == 1 else _images(n, shape, seed=4)
    ref = reference_velocity(x, y, blur)
    scale = ref.abs().max().item()
    v = sinkhorn_velocity(x, y, blur=blur, scaling=0.9, solver="converged", max_iters=2000, tol=1e-6)
    assert v.shape == x.shape and v.dtype == torch.float32
    assert (v.double() - ref).abs().max().item() <= 2e-3 * scale
    if len(shape) == 1:
        rough = sinkhorn_velocity(x, y, blur=blur, scaling=0.9)
        assert (rough.double() - ref).abs().max().item() > 1e-2 * scale


def test_converged_solver_batched_equals_one_at_a_time():
    xs, ys = zip(*(_clouds_2d(32, seed=s) for s in range(3)))
    x, y = torch.stack(xs), torch.stack(ys)
    kw = dict(blur=0.2, scaling=0.8, solver="converged", max_iters=500, tol=1e-6)
    together = sinkhorn_velocity(x, y, batched=True, **kw)
    for b in range(3):
        assert torch.allclose(together[b], sinkhorn_velocity(x[b], y[b], **kw), atol=1e-4)


def test_converged_solver_drops_finished_batches_without_changing_any_bit():
    """A batch leaves the solve when it meets tol: its result and iteration count are what it gets alone."""
    from sinkflow.ot.sinkhorn import converged_velocity

    xs, ys = zip(*(_clouds_2d(48, seed=s) for s in range(4)))
    x, y = torch.stack(xs), torch.stack(ys) * torch.tensor([1.0, 3.0, 0.5, 2.0])[:, None, None]  # unequal difficulty
    kw = dict(blur=0.2, scaling=0.8, diameter=15.0, max_iters=400, tol=1e-4)
    together, iters = converged_velocity(x, y, **kw)
    assert len(set(iters.tolist())) > 1  # the batches finish at different iterations
    for b in range(4):
        alone, n = converged_velocity(x[b : b + 1], y[b : b + 1], **kw)
        assert torch.equal(together[b], alone[0]) and int(n) == int(iters[b])


def test_self_potential_is_solved_first_to_its_fixed_point_and_stops_early(monkeypatch):
    """The debiasing potential is solved on its own before the cross problem: it meets its own (1000x tighter)
    tolerance, each batch as alone, in far fewer c-transforms than the cross potentials need, and stops at the
    dtype's rounding when its tolerance is below it (tol 0 in float32 must not run to max_iters)."""
    from sinkflow.ot import sinkhorn as S

    xs, _ = zip(*(_clouds_2d(48, seed=s) for s in range(3)))
    x = torch.stack(xs) * torch.tensor([1.0, 3.0, 0.5])[:, None, None]
    a_log, c_xx, eps = x.new_full((3, 48), -math.log(48)), S._cost(x, x), 0.04
    start = S._softmin(1.0, c_xx, a_log)
    p, iters = S._self_potential(eps, c_xx, a_log, start, 1e-6 * eps, 500)
    assert int(iters.max()) < 500
    fixed = (p + S._softmin(eps, c_xx, a_log + p / eps)) / 2
    assert (fixed - p).abs().max() < 1e-6 * eps
    for b in range(3):
        alone, n = S._self_potential(eps, c_xx[b : b + 1], a_log[b : b + 1], start[b : b + 1], 1e-6 * eps, 500)
        assert torch.equal(alone[0], p[b]) and int(n) == int(iters[b])
    calls = []
    real = S._softmin
    monkeypatch.setattr(S, "_softmin", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    S._self_potential(eps, c_xx, a_log, start, 0.0, 10_000)  # only the float32 floor can stop it
    assert len(calls) < 200
    calls.clear()
    y = torch.stack([_clouds_2d(48, seed=10 + s)[1] for s in range(3)]) * 2 + 1
    kw = dict(blur=0.2, scaling=0.8, diameter=15.0, max_iters=400, tol=1e-4)
    _, iters = S.converged_velocity(x, y, **kw, final="log")
    final = len(calls) - 3 * (len(S.epsilon_schedule(15.0, 0.2, 0.8)) + 1)  # after the annealing's c-transforms
    # updating p along with f and g took 3 c-transforms per cross update; solved first, p adds a few, then 2 each
    assert 2 * int(iters.max()) < final < 3 * int(iters.max()), (final, iters)
    calls.clear()
    S.converged_velocity(x, y, **kw)  # on the absorbed kernel the cross iterations make no c-transform at all
    assert len(calls) - 3 * (len(S.epsilon_schedule(15.0, 0.2, 0.8)) + 1) < 0.2 * final


def test_log_domain_cross_potentials_stop_at_float32_rounding():
    """The log-domain stopping rule had no rounding floor (the self potential's had): below float32's resolution of
    the potentials a tight tol was never met, and every float32 solve ran to max_iters where float64's took ~120
    (review of 2026-11-27). It now stops there, as close to the float64 velocity as float32 gets."""
    from sinkflow.ot.sinkhorn import converged_velocity

    x, y = _clouds_2d(48, seed=0)
    x, y = x[None], y[None] * 2 + 1
    kw = dict(blur=0.2, scaling=0.8, diameter=15.0, max_iters=2000, tol=1e-5, final="log")  # float64: 274 iterations
    v64, it64 = converged_velocity(x.double(), y.double(), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capped solve warns
        v32, it32 = converged_velocity(x, y, **kw)
    assert int(it64.max()) < 2000 and int(it32.max()) <= int(it64.max())
    assert (v32.double() - v64).abs().max() < 1e-4 * v64.abs().max()


@pytest.mark.parametrize("final", ["kernel", "log"])
def test_a_tight_tol_at_a_blur_as_large_as_the_data_stops_at_float32s_rounding(final):
    """The stopping floor counted the potential's magnitude but not its log-sum-exp's rounding (eps log N; log N on
    the absorbed kernel, which had no floor at all): at a blur as large as the data (16 points of spread 0.3, blur
    2, tol 1e-5) every float32 solve ran to max_iters and warned, its velocity right to 1e-6 (audit Z)."""
    from sinkflow.ot.sinkhorn import converged_velocity

    gen = torch.Generator().manual_seed(0)
    x, y = 0.3 * torch.randn(2, 16, 2, generator=gen), 0.3 * torch.randn(2, 16, 2, generator=gen) + 0.15
    kw = dict(blur=2.0, scaling=0.9, diameter=3.0, max_iters=200, tol=1e-5, final=final)
    v64, _ = converged_velocity(x.double(), y.double(), **{**kw, "tol": 1e-9, "max_iters": 5000})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capped solve warns
        v32, it32 = converged_velocity(x, y, **kw)
    assert int(it32.max()) < 100, it32
    assert (v32.double() - v64).abs().max() < 1e-5 * v64.abs().max()


def test_kernel_iterations_match_the_log_domain_and_fall_back_per_batch(monkeypatch):
    """The final-epsilon iterations on the absorbed kernel are the log-domain ones up to float rounding (the same
    iteration counts, velocities within 1e-3 in float32, 1e-9 in float64), and a batch whose annealed logits or scalings leave float32's safe range
    is solved in the log domain instead, alone: every other batch keeps its kernel result, bit for bit."""
    from sinkflow.ot import sinkhorn as S

    xs, ys = zip(*(_clouds_2d(48, seed=s) for s in range(4)))
    x, y = torch.stack(xs), torch.stack(ys) * torch.tensor([1.0, 3.0, 0.5, 2.0])[:, None, None]
    kw = dict(blur=0.2, scaling=0.8, diameter=15.0, max_iters=400, tol=1e-3)
    v_log, it_log = S.converged_velocity(x, y, **kw, final="log")
    v_ker, it_ker = S.converged_velocity(x, y, **kw)
    # float32 rounding, carried through up to 400 iterations (batch 1 hits the cap): far below the solve's own error
    assert torch.equal(it_ker, it_log) and (v_ker - v_log).abs().max() < 1e-3
    assert all(not torch.equal(v_ker[b], v_log[b]) for b in range(4))  # two paths, so the checks below can tell
    xd, yd = x.double(), y.double()
    assert (S.converged_velocity(xd, yd, **kw)[0] - S.converged_velocity(xd, yd, **kw, final="log")[0]).abs().max() < 1e-9
    # these batches' annealed logits all peak near 3.87 and their scalings reach 1.4 / 5-11 while iterating:
    for limit, kernel_batches in ((6.0, [0, 2]), (3.85, [2])):  # scalings past 6 in 1 and 3; logits past 3.85 in 0, 1, 3
        monkeypatch.setattr(S, "KERNEL_SAFE", limit)
        v, it = S.converged_velocity(x, y, **kw)
        for b in range(4):
            assert torch.equal(v[b], (v_ker if b in kernel_batches else v_log)[b]), (limit, b)
        assert torch.equal(it, it_log)
    with pytest.raises(ValueError, match="final must be"):
        S.converged_velocity(x, y, **kw, final="exact")


def test_a_capped_self_potential_counts_as_a_capped_solve(monkeypatch):
    """The self (debiasing) potential is part of the velocity: a batch whose self solve stops at max_iters is
    reported like a capped cross solve (iterations = max_iters, SolveStats.capped, or the warning), not passed
    silently because its cross potentials converged. At blur 4 in float64 the cross problem converges in ~19
    updates; the self problem at a 1e-10 x tolerance needs ~36, so a cap of 25 stops only the self solve."""
    import warnings

    from sinkflow.ot import sinkhorn as S

    xs, ys = zip(*(_clouds_2d(48, seed=s) for s in range(2)))
    x, y = torch.stack(xs).double(), torch.stack(ys).double() * 2 + 1
    kw = dict(blur=4.0, scaling=0.8, diameter=12.0, max_iters=25, tol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", S.SinkhornConvergenceWarning)
        _, iters = S.converged_velocity(x, y, **kw)
    assert int(iters.max()) < 25
    monkeypatch.setattr(S, "SELF_TOL", 1e-10)
    with S.solve_stats() as stats:
        _, capped = S.converged_velocity(x, y, **kw)
    assert (stats.problems, stats.capped) == (2, 2) and capped.tolist() == [25, 25]
    with pytest.warns(S.SinkhornConvergenceWarning, match="raise sinkhorn.max_iters"):
        S.converged_velocity(x, y, **kw)


def test_converged_solver_takes_a_blur_above_the_diameter():
    """GeomLoss anneals from diameter^2 straight to blur^2 when blur >= diameter; the converged solver's schedule
    raised torch.arange's RuntimeError there (small-scale data, or an explicit diameter below the blur)."""
    from geomloss._legacy.sinkhorn_divergence import epsilon_schedule as geomloss_schedule

    from sinkflow.ot.sinkhorn import epsilon_schedule

    assert epsilon_schedule(1.0, 2.0, 0.9) == geomloss_schedule(2, 1.0, 2.0, 0.9) == [1.0, 4.0]
    x, y = _clouds_2d(16, seed=5)
    x, y = x * 1e-3, y * 1e-3
    v = sinkhorn_velocity(x, y, blur=0.5, solver="converged", tol=1e-4)
    ref = reference_velocity(x, y, 0.5)
    assert (v.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_unknown_solver_is_a_clear_error():
    x, y = _clouds_2d(8, seed=0)
    with pytest.raises(SinkflowError, match="unknown Sinkhorn solver"):
        sinkhorn_velocity(x, y, blur=0.1, solver="exact")


def test_clamped_log_sum_exp_matches_torch_far_below_float_range():
    """The solver's c-transform clamps shifted logits at -60 before exp (exp's slow path below -87):
    the result must equal torch.logsumexp where most terms underflow and rows have a far-off maximum."""
    from sinkflow.ot.sinkhorn import _cost, _plan_rows, _softmin

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 2, generator=g) * 4
    y = torch.randn(3, 70, 2, generator=g) * 4 + 10  # every row's nearest target is far away
    h = torch.randn(3, 70, generator=g) * 5
    cost = _cost(x, y)
    for eps in (1e-3, 1e-2, 1.0):
        logits = h[:, None, :] - cost / eps
        ref = -eps * torch.logsumexp(logits, dim=2)
        assert torch.allclose(_softmin(eps, cost, h), ref, rtol=1e-6, atol=0)
        assert torch.allclose(_plan_rows(eps, cost, h), torch.softmax(logits, dim=2), atol=1e-7)


def test_converged_solver_warns_when_it_stops_at_max_iters():
    """A pool that silently stops short of tol puts the error in its end points (docs/nsgf.md): say so."""
    from sinkflow.ot.sinkhorn import SinkhornConvergenceWarning, converged_velocity

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 64, 2, generator=g), torch.randn(2, 64, 2, generator=g) * 3 + 2
    with pytest.warns(SinkhornConvergenceWarning, match="raise sinkhorn.max_iters"):
        converged_velocity(x, y, blur=0.05, scaling=0.8, diameter=12.0, max_iters=2, tol=1e-6)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", SinkhornConvergenceWarning)
        _, done = converged_velocity(x, y, blur=0.5, scaling=0.8, diameter=12.0, max_iters=2000, tol=1e-3)
    assert done.shape == (2,) and int(done.max()) < 2000


def test_solve_stats_count_the_capped_problems_instead_of_warning():
    """Inside ``solve_stats`` the converged solver reports to the collector (problems, capped, iterations), not
    by a warning per call: the pool build says once what share of its solves hit the cap."""
    import warnings

    from sinkflow.ot.sinkhorn import SinkhornConvergenceWarning, converged_velocity, solve_stats

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 64, 2, generator=g), torch.randn(3, 64, 2, generator=g) * 3 + 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", SinkhornConvergenceWarning)
        with solve_stats() as stats:
            _, capped = converged_velocity(x, y, blur=0.05, scaling=0.8, diameter=12.0, max_iters=2, tol=1e-6)
            _, done = converged_velocity(x[:2], y[:2], blur=0.5, scaling=0.8, diameter=12.0, max_iters=2000, tol=1e-3)
    assert (stats.problems, stats.capped) == (5, 3) and stats.max_iters == 2000
    assert stats.iterations == capped.tolist() + done.tolist()


@pytest.mark.parametrize("max_iters, level", [(400, logging.INFO), (3, logging.WARNING)])
def test_a_pool_build_reports_its_capped_sinkhorn_solves_once(runs_dir, caplog, max_iters, level):
    """One line at the end of the pool build: a few capped solves are information, a large share a warning that
    names the keys to raise."""
    import warnings

    from sinkflow import config
    from sinkflow.engine.trainer import Trainer
    from sinkflow.methods import distributions, nsgf
    from sinkflow.ot.sinkhorn import SinkhornConvergenceWarning
    from sinkflow.runtime.run_folder import RunFolder

    cfg = config.resolve("moons", ["pool.batches=4", "pool.steps=3", "pool.batch_size=32", "pool.chunk=2",
                                   "experiment.device=cpu", f"sinkhorn.max_iters={max_iters}"])
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="sinkflow"):
        warnings.simplefilter("error", SinkhornConvergenceWarning)
        Trainer(RunFolder.create(cfg), nsgf.pool_task(cfg, *distributions(cfg))).fit()
    lines = [r for r in caplog.records if "Sinkhorn solves" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == level
    assert re.search(r"pool: \d+ of 8 Sinkhorn solves \(\d+\.\d%\) stopped at sinkhorn.max_iters=" + str(max_iters),
                     lines[0].getMessage())
    assert ("raise sinkhorn.max_iters" in lines[0].getMessage()) == (level == logging.WARNING)
