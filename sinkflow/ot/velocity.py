"""Empirical NSGF velocity from GeomLoss Sinkhorn potentials, and the particle flow it drives.

Conventions (GeomLoss p=2, see docs/ot.md): cost C(x, y) = |x - y|^2 / 2, epsilon = blur^2, uniform
weights, ``debias=False``. The velocity is the paper's eq. 13,

    v(x_i) = grad f_{mu,mu}(x_i) - grad f_{mu,mu*}(x_i),

so ``x + eta * v`` moves the particles towards the target. Both OT problems, (x, y) and (x, x), and
any number of independent pool batches go through ONE GeomLoss call as a (2B, N, D) batch: on small
problems the per-call Python overhead of the ~50-100 annealing iterations dominates, so batching is
what makes pool building fast.
"""

from __future__ import annotations

import math

import torch
from geomloss import SamplesLoss

from sinkflow.config.checks import float_tensor, is_positive, is_real, is_whole, shown
from sinkflow.errors import SinkflowError, require
from sinkflow.ot.precision import centred, strict_float32

_BACKENDS = ("tensorized", "online")
SOLVERS = ("geomloss", "converged")  # converged: sinkflow.ot.sinkhorn, iterated to tol at the final epsilon


# ----------------------------------------------------------------------------------------------
# validation: every degenerate input is caught here, before GeomLoss sees it


def _check_params(blur: float, scaling: float, diameter: float | None, backend: str, solver: str = "geomloss") -> None:
    require(solver in SOLVERS, f"unknown Sinkhorn solver {solver!r}", f"use one of {', '.join(SOLVERS)}")
    require(
        is_positive(blur),
        f"Sinkhorn blur must be a positive number, got {shown(blur)}",
        "set blur > 0 (epsilon = blur^2; a scale somewhat below the typical distance between points)",
    )
    require(
        is_real(scaling) and 0 < scaling < 1,
        f"Sinkhorn scaling must lie in (0, 1), got {shown(scaling)}",
        "use 0.8-0.95 (closer to 1 is more accurate and slower)",
    )
    if diameter is not None:
        require(
            is_positive(diameter),
            f"Sinkhorn diameter must be a positive number or None, got {shown(diameter)}",
            "leave diameter=None to bound it from the data",
        )
    require(
        backend in _BACKENDS,
        f"unknown Sinkhorn backend {backend!r}",
        f"use one of {', '.join(_BACKENDS)}",
    )
    check_backend_installed(backend, solver)


def check_backend_installed(backend: str, solver: str = "geomloss") -> None:
    """GeomLoss's ``online`` backend needs pykeops; the converged solver has no backend, so it needs nothing (a
    run with ``solver=converged``, where the config says the key is not read, failed in its pool on it)."""
    if backend == "online" and solver == "geomloss":
        try:
            import pykeops  # noqa: F401
        except ImportError:
            raise SinkflowError(
                "Sinkhorn backend 'online' needs pykeops, which is not installed",
                "pip install 'sinkflow[keops]' or use backend='tensorized' (sinkhorn.backend=tensorized)",
            ) from None


def _check_clouds(x: torch.Tensor, y: torch.Tensor, batched: bool) -> tuple[int, int, int, int]:
    """Validate a pair of floating point clouds (``float_tensor`` has made them tensors); return (B, N, M, D) of
    their flattened (B, N, D) views."""
    lead = 2 if batched else 1
    layout = "(B, N, *)" if batched else "(N, *)"
    for name, t in (("x", x), ("y", y)):
        require(
            t.dim() >= lead + 1,
            f"{name} has shape {tuple(t.shape)} but must be shaped {layout} with per-sample dims",
            "add a feature axis, e.g. x[..., None] for 1-D points",
        )
    require(
        x.device == y.device,
        f"x is on {x.device} but y is on {y.device}",
        "move both point clouds to the same device",
    )
    if batched:
        require(
            x.shape[0] == y.shape[0],
            f"x holds {x.shape[0]} pool batches but y holds {y.shape[0]}",
            "pass one target batch per source batch",
        )
    require(
        x.shape[lead:] == y.shape[lead:],
        f"per-sample shapes differ: x {tuple(x.shape[lead:])} vs y {tuple(y.shape[lead:])}",
        "source and target samples must have the same shape",
    )
    B = x.shape[0] if batched else 1
    N, M = x.shape[lead - 1], y.shape[lead - 1]
    require(
        N >= 2 and M >= 2,
        f"too few points: x has {N}, y has {M} (need at least 2 each)",
        "use batches of at least 2 samples",
    )
    require(B >= 1, "x holds no pool batches", "pass at least one batch")
    D = math.prod(x.shape[lead:])
    finite = torch.stack([torch.isfinite(x).all(), torch.isfinite(y).all()]).tolist()
    for name, ok in zip(("x", "y"), finite):
        require(ok, f"{name} contains NaN or Inf", f"check the data or the step that produced {name}")
    same = _identical_batches(x.reshape(B, N, D), y.reshape(B, M, D))
    if same:
        where = f" (pool batches {same[:5]}{'...' if len(same) > 5 else ''})" if batched else ""
        raise SinkflowError(
            f"x and y are identical point clouds{where}, so the Sinkhorn velocity is zero everywhere",
            "draw the source and the target from different distributions or different samples",
        )
    return B, N, M, D


def _identical_batches(x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """Indices of batches whose two clouds hold the same points (in any order).

    Sorting the points along a fixed projection makes equal sets line up; only batches whose
    projections match exactly are compared row by row. No RNG is used (the caller's stream is kept).
    """
    B, N, D = x.shape
    if y.shape[1] != N:
        return []
    r = torch.cos(torch.arange(D, device=x.device, dtype=torch.float64) * 2.399963 + 0.5)
    px, ix = (x.double() @ r).sort(dim=1)
    py, iy = (y.double() @ r).sort(dim=1)
    candidates = (px == py).all(dim=1)
    if not bool(candidates.any()):
        return []
    xs = x.gather(1, ix[..., None].expand(B, N, D))
    ys = y.gather(1, iy[..., None].expand(B, N, D))
    return [int(b) for b in torch.nonzero(candidates & (xs == ys).all(dim=(1, 2))).flatten()]


_F32 = torch.finfo(torch.float32)


def _check_float32_range(blur: float, diameter: float, step: int | None = None, steps: int | None = None) -> None:
    """The solve runs in float32: epsilon = blur^2 and the first epsilon of the annealing, diameter^2 (the scale of
    the costs), must be normal float32 numbers. Outside that range GeomLoss failed with numpy's 'Maximum allowed size
    exceeded', the converged solver with torch's 'unsupported range: inf' or 'cannot be converted to type float', and
    points at 1e-25 came back as NaN velocities. A flow whose eta is too large grows its particles about eta-fold per
    step and reaches it after a few steps (``step``: the message names the step, as for NaN velocities)."""
    if _F32.tiny <= blur**2 <= _F32.max and diameter**2 <= _F32.max:
        return
    if step:
        raise SinkflowError(f"the Sinkhorn flow's particles left float32's range at step {step} of {steps} (they span "
                            f"{diameter:.3g}, blur {blur:.3g})", "lower eta or raise blur")
    raise SinkflowError(f"the Sinkhorn problem is outside float32's range, where it is solved: blur^2 = {blur**2:.3g}, "
                        f"diameter^2 = {diameter**2:.3g} (float32 holds {_F32.tiny:.2g} to {_F32.max:.2g})",
                        "rescale the data to a spread of about 1 (points - mean, / std) and the blur with it")


# ----------------------------------------------------------------------------------------------
# the solve


def safe_diameter(x: torch.Tensor, y: torch.Tensor, *, batched: bool = False) -> float:
    """Upper bound on every pairwise distance: the diagonal of the joint bounding box of x and y.

    x, y: (N, *) or, with batched=True, (B, N, *); one bound for all batches. Passed to GeomLoss
    explicitly so the annealing schedule (diameter -> blur) is the same for every batch of a call
    and is chosen by us, not silently per call.
    """
    lead = 2 if batched else 1
    D = math.prod(x.shape[lead:])
    return _bbox_diameter(x.reshape(-1, D), y.reshape(-1, D))


def _bbox_diameter(x: torch.Tensor, y: torch.Tensor) -> float:
    """safe_diameter for clouds already flattened to (..., D)."""
    D = x.shape[-1]
    pts = torch.cat([x.reshape(-1, D), y.reshape(-1, D)]).float()
    d = (pts.amax(0) - pts.amin(0)).norm().item()
    return max(d, 1e-6)


# On CPU a batch is solved in chunks whose (2B, N, M) cost matrix stays within about this size: past
# the per-core L2 cache every elementwise pass of the ~50-100 Sinkhorn iterations becomes
# memory-bound. Measured (1 thread, n=256, D=2): 4 batches in one (8, 256, 256) call took 0.87-0.92 s,
# one batch per call 0.56-0.58 s. Small problems (n=64) still go many at once, where batching pays.
# On CUDA the whole batch goes at once (the caller sizes it with max_batches_in_flight).
CPU_CHUNK_BYTES = 256 << 10


CONVERGED_CHUNK_BYTES = 32 << 20  # converged solver: cost matrices of at most this size per call


def _velocity_flat(
    x: torch.Tensor,
    y: torch.Tensor,
    blur: float,
    scaling: float,
    diameter: float,
    backend: str,
    solver: str = "geomloss",
    max_iters: int = 200,
    tol: float = 1e-3,
) -> torch.Tensor:
    """v for float32 clouds x (B, N, D), y (B, M, D); no validation (callers do it)."""
    B, N, M = x.shape[0], x.shape[1], y.shape[1]
    x, y = centred(x, y)
    if solver == "converged":
        from sinkflow.ot.sinkhorn import converged_velocity

        return _in_chunks(lambda a, b: converged_velocity(a, b, blur=blur, scaling=scaling, diameter=diameter,
                                                         max_iters=max_iters, tol=tol)[0],
                          x, y, max(1, CONVERGED_CHUNK_BYTES // (N * max(N, M) * 4)))
    chunk = B if x.device.type != "cpu" else max(1, CPU_CHUNK_BYTES // (2 * N * M * 4))
    return _in_chunks(lambda a, b: _velocity_solve(a, b, blur, scaling, diameter, backend), x, y, chunk)


def _in_chunks(solve, x: torch.Tensor, y: torch.Tensor, chunk: int) -> torch.Tensor:
    """``solve(x, y)`` over the batch dimension in slices of ``chunk`` problems (one call when it fits)."""
    if chunk >= x.shape[0]:
        return solve(x, y)
    return torch.cat([solve(x[s : s + chunk], y[s : s + chunk]) for s in range(0, x.shape[0], chunk)])


def _velocity_solve(
    x: torch.Tensor,
    y: torch.Tensor,
    blur: float,
    scaling: float,
    diameter: float,
    backend: str,
) -> torch.Tensor:
    """One GeomLoss call for all of x (B, N, D), y (B, M, D)."""
    B, N, D = x.shape
    M = y.shape[1]
    loss = SamplesLoss(
        loss="sinkhorn",
        p=2,
        blur=blur,
        scaling=scaling,
        diameter=diameter,
        debias=False,
        potentials=True,
        backend=backend,
    )
    # GeomLoss switches grad mode on globally at the end of its loop; enable_grad restores the
    # caller's mode (e.g. no_grad) on exit.
    with torch.enable_grad():
        if N == M:  # (x, y) and (x, x) stacked: one call for both problems and all batches
            X = torch.cat([x, x]).requires_grad_(True)
            Y = torch.cat([y, x])
            w = x.new_full((2 * B, N), 1.0 / N)
            F, _ = loss(w, X, w, Y)
            (g,) = torch.autograd.grad(F.sum(), X)
            grad_cross, grad_self = g[:B], g[B:]
        else:  # different sizes cannot share a batch: two calls
            X = x.clone().requires_grad_(True)
            a, b = x.new_full((B, N), 1.0 / N), x.new_full((B, M), 1.0 / M)
            F_ab, _ = loss(a, X, b, y)
            F_aa, _ = loss(a, X, a, x)
            (grad_cross,) = torch.autograd.grad(F_ab.sum(), X)
            (grad_self,) = torch.autograd.grad(F_aa.sum(), X)
    # GeomLoss detaches the right-hand cloud, so these are the envelope gradients grad f(x_i).
    return grad_self - grad_cross


def sinkhorn_velocity(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    blur: float,
    scaling: float = 0.9,
    diameter: float | None = None,
    backend: str = "tensorized",
    batched: bool = False,
    solver: str = "geomloss",
    max_iters: int = 200,
    tol: float = 1e-3,
) -> torch.Tensor:
    """NSGF velocity v = grad f(mu,mu) - grad f(mu,mu*) at the points of x (paper eq. 13).

    x: (N, *) source particles, y: (M, *) target samples with the same per-sample shape; with
    ``batched=True`` x is (B, N, *) and y (B, M, *), B independent problems solved at once.
    x and y are tensors or numpy arrays (these land on the CPU) of any floating dtype; scalars may be numpy's.
    Returns a float32 tensor shaped like x. Computed in float32 with autocast and TF32 off,
    whatever the input dtype or the ambient settings.
    """
    _check_params(blur, scaling, diameter, backend, solver)
    x, y = float_tensor(x, "x"), float_tensor(y, "y")
    B, N, M, D = _check_clouds(x, y, batched)
    with torch.no_grad():
        xf = x.detach().reshape(B, N, D).float()
        yf = y.detach().reshape(B, M, D).float()
    diam = float(diameter) if diameter is not None else _bbox_diameter(xf, yf)
    _check_float32_range(float(blur), diam)
    with strict_float32(x.device.type):
        v = _velocity_flat(xf, yf, float(blur), float(scaling), diam, backend, solver, max_iters, tol)
    return v.reshape(x.shape)


def sinkhorn_velocity_batched(x: torch.Tensor, y: torch.Tensor, **kwargs) -> torch.Tensor:
    """``sinkhorn_velocity(x, y, batched=True, ...)`` for x (B, N, *), y (B, M, *)."""
    return sinkhorn_velocity(x, y, batched=True, **kwargs)


# ----------------------------------------------------------------------------------------------
# the particle flow (paper Alg. 1, inner loop)


SCHEDULES = ("constant", "incremental", "harmonic")
LANDINGS = ("sinkhorn", "exact")


def _exact_landing(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y_j(i) - x_i per batch of x, y (B, N, D): the displacement onto each particle's exact-OT partner."""
    from sinkflow.ot.exact import ot_permutation

    return torch.stack([y[b][ot_permutation(x[b], y[b])] - x[b] for b in range(x.shape[0])])


def eta_schedule(eta: float, steps: int, growth: float | None = None, schedule: str | None = None) -> list[float]:
    """Step sizes eta_0..eta_{T-1}.

    constant: eta at every step. incremental (``growth`` r > 0; the default when a growth is given):
    eta_k = eta * exp(r * (k - T) / T), the dev code's "incremental lr" hint with r = 4: small early steps
    where the velocity is large, growing to eta * exp(-r / T) at the last (eta * [0.018, 0.041, 0.091, 0.20, 0.45]
    at T = 5, r = 4: it never reaches eta). harmonic: eta_k = eta / (T - k). With v ~ T(x) - x
    (small blur), step k then moves eta/(T-k) of the displacement still to go, i.e. eta/T of the original
    one: a constant-speed path, and eta = 1 lands on the target batch at the last step (docs/nsgf.md).
    """
    schedule = schedule or ("incremental" if growth else "constant")
    require(schedule in SCHEDULES, f"unknown eta schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    if schedule == "constant":
        return [float(eta)] * steps
    if schedule == "harmonic":
        return [float(eta) / (steps - k) for k in range(steps)]
    require(
        is_positive(growth),
        f"eta_growth must be a positive number for the incremental schedule, got {shown(growth)}",
        "use e.g. pool.eta_growth=4.0 (the dev-code hint), or pool.schedule=constant",
    )
    return [float(eta) * math.exp(growth * (k - steps) / steps) for k in range(steps)]


def simulate_sinkhorn_flow(
    x0: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    eta: float,
    blur: float,
    scaling: float = 0.9,
    diameter: float | None = None,
    backend: str = "tensorized",
    eta_growth: float | None = None,
    schedule: str | None = None,
    batched: bool = False,
    solver: str = "geomloss",
    max_iters: int = 200,
    tol: float = 1e-3,
    landing: str = "sinkhorn",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit Euler x_{k+1} = x_k + eta_k v(x_k; y) for exactly ``steps`` updates.

    ``landing="exact"``: the last step moves each particle onto its partner in the exact OT matching of the
    particles to the target batch (the exact assignment; v = (y_j(i) - x_i) / eta_{T-1}), the blur -> 0 limit of
    the last Sinkhorn step. Along the harmonic schedule the last step lands, and an entropic one lands blurred: the
    end points spread at the blur's scale (docs/nsgf.md).

    Step sizes come from ``eta_schedule(eta, steps, eta_growth, schedule)``. The same target batch y is
    used at every step (paper Alg. 1). Returns (xs, vs), float32, each
    shaped (steps, *x0.shape): the state *before* step k and its velocity. The final state is
    xs[-1] + eta_{T-1} * vs[-1]. With diameter=None the bound is recomputed from the data at every
    step (the particles move).
    """
    require(
        is_whole(steps),
        f"steps must be a positive integer, got {shown(steps)}",
        "use at least one Euler step",
    )
    require(
        is_positive(eta),
        f"eta must be a positive number, got {shown(eta)}",
        "use a step size in (0, 1]",
    )
    _check_params(blur, scaling, diameter, backend, solver)
    require(landing in LANDINGS, f"unknown landing {landing!r}", f"use one of {', '.join(LANDINGS)}")
    x0, y = float_tensor(x0, "x"), float_tensor(y, "y")
    B, N, M, D = _check_clouds(x0, y, batched)
    steps = int(steps)  # a numpy integer too (is_whole): shapes and list lengths below want a Python int
    require(landing != "exact" or N == M, f"an exact landing needs as many particles as target points, got {N} and {M}",
            "use equal batch sizes")
    etas = eta_schedule(eta, steps, eta_growth, schedule)
    device = x0.device
    xs = torch.empty((steps, *x0.shape), dtype=torch.float32, device=device)
    vs = torch.empty_like(xs)
    with torch.no_grad():
        x = x0.detach().reshape(B, N, D).float().clone()
        yf = y.detach().reshape(B, M, D).float()
    with strict_float32(device.type):
        for k in range(steps):
            if landing == "exact" and k == steps - 1:
                require(bool(torch.isfinite(x).all()), f"the Sinkhorn flow's particles reached NaN/Inf before its "
                        f"exact landing (step {k} of {steps})", "lower eta or raise blur")
                v = _exact_landing(x, yf) / etas[k]
                xs[k], vs[k] = x.reshape(x0.shape), v.reshape(x0.shape)
                break
            diam = float(diameter) if diameter is not None else _bbox_diameter(x, yf)
            _check_float32_range(float(blur), diam, k, steps)
            v = _velocity_flat(x, yf, float(blur), float(scaling), diam, backend, solver, max_iters, tol)
            with torch.no_grad():
                xs[k] = x.reshape(x0.shape)
                vs[k] = v.reshape(x0.shape)
                x = x + etas[k] * v
    bad = (~torch.isfinite(vs.reshape(steps, -1))).any(dim=1)
    if bool(bad.any()):
        k = int(torch.nonzero(bad)[0])
        raise SinkflowError(
            f"the Sinkhorn flow produced NaN/Inf velocities at step {k} of {steps}",
            "lower eta or raise blur",
        )
    return xs, vs
