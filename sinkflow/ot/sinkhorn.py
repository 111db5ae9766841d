"""A converged batched Sinkhorn solver for the NSGF velocity (``sinkhorn.solver=converged``).

Why not GeomLoss alone: its epsilon-scaling loop does one (averaged) update per epsilon and then stops,
so at the final epsilon the potentials are not converged. Along a flow whose last step moves the whole
remaining distance (the harmonic schedule, eta_{T-1} = 1), that error lands in the samples: on moons
the flowed particles end W2 0.150 from their own target batch at scaling 0.95 and 0.078 at scaling 0.99
(docs/nsgf.md). This solver runs the same annealing (GeomLoss's schedule and symmetric averaged updates, in the
log domain), solves the self (debiasing) potential, then keeps iterating the cross potentials at the final epsilon
until the marginals are met to ``tol``: on the kernel with the annealed potentials absorbed (one exp per solve,
matrix-vector products per update) where float32 allows it, in the log domain where it does not.

Conventions are GeomLoss's (p = 2): cost C(x, y) = |x - y|^2 / 2, epsilon = blur^2, uniform weights.
With converged potentials the velocity has a closed form (the envelope theorem):

    v_i = sum_j P_{j|i} y_j - sum_k Q_{k|i} x_k,

P the entropic plan of (x, y) and Q that of the symmetric problem (x, x), both row-normalised: the
entropic barycentric projection onto the target batch minus the self-projection.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

class SinkhornConvergenceWarning(UserWarning):
    """Some Sinkhorn problems stopped at ``max_iters`` before ``tol``: their velocities (and, along a harmonic
    flow whose last step moves the whole way, the pool's end points) are off by the unconverged part."""


class SolveStats:
    """Counts of the converged solver's problems while ``solve_stats()`` is active: ``problems`` solved,
    ``capped`` of them stopped at ``max_iters`` before ``tol``, and ``iterations`` (each problem's count at the
    final epsilon). A caller that reports these (the pool build, once at its end) replaces the per-call
    ``SinkhornConvergenceWarning``: a pool where 3 % of 800 solves hit the cap would otherwise warn as loudly as one
    where all do."""

    def __init__(self):
        self.problems, self.capped, self.iterations, self.max_iters, self.tol = 0, 0, [], None, None

    def add(self, iters: torch.Tensor, max_iters: int, tol: float) -> None:
        self.problems += len(iters)
        self.capped += int((iters >= max_iters).sum())
        self.iterations += iters.tolist()
        self.max_iters, self.tol = max_iters, tol

    def merge(self, other: "SolveStats") -> "SolveStats":
        """Add ``other``'s counts (another rank's share of a pool build) to these; returns self."""
        self.problems += other.problems
        self.capped += other.capped
        self.iterations += other.iterations
        self.max_iters = self.max_iters if other.max_iters is None else other.max_iters
        self.tol = self.tol if other.tol is None else other.tol
        return self


_ACTIVE: list[SolveStats] = []


@contextlib.contextmanager
def solve_stats(stats: SolveStats | None = None):
    """Collect into ``stats`` (a new ``SolveStats`` by default) every ``converged_velocity`` call inside the
    block; those calls do not warn."""
    stats = SolveStats() if stats is None else stats
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


OMEGA = 1.9  # over-relaxation of the final-epsilon Sinkhorn updates (1 = plain Sinkhorn; < 2 for stability)


def _cost(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x - y|^2 / 2 for x (B, N, D), y (B, M, D) -> (B, N, M), clamped at 0 (rounding)."""
    sq = (x * x).sum(-1)[:, :, None] + (y * y).sum(-1)[:, None, :] - 2 * torch.bmm(x, y.transpose(1, 2))
    return sq.clamp_(min=0) / 2


# exp() of arguments far below float32's range (< -87) takes a slow scalar path on CPU: ~30 ns per entry
# instead of ~1.5 (benchmarks/sinkhorn_solver.py). Shifted logits are clamped here first; a term e^-60
# below the row's largest changes a sum of at most a few thousand terms by less than 1e-20 of itself.
LOGIT_FLOOR = -60.0


def _shifted_exp(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp(z - m), m) along the last dim, m the row max, in place on z; tiny terms clamped (LOGIT_FLOOR)."""
    m = z.amax(-1, keepdim=True)
    return z.sub_(m).clamp_(min=LOGIT_FLOOR).exp_(), m


def _softmin(eps: float, cost: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """-eps log sum_j exp(h_j - C_ij / eps): the c-transform of a potential given as log-weights h (B, M)."""
    e, m = _shifted_exp(torch.add(h[:, None, :], cost, alpha=-1.0 / eps))
    return -eps * (e.sum(-1).log_() + m.squeeze(-1))


def _plan_rows(eps: float, cost: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The row-normalised plan softmax_j(h_j - C_ij / eps) (B, N, M)."""
    e, _ = _shifted_exp(torch.add(h[:, None, :], cost, alpha=-1.0 / eps))
    return e.div_(e.sum(-1, keepdim=True))


def _until_converged(update, state: tuple, fixed: tuple, max_iters: int) -> tuple[tuple, torch.Tensor]:
    """Iterate ``state, still = update(*state, *fixed)`` over a batch of problems, each until its own ``still``
    (B,) turns False or ``max_iters``; returns (state, iterations (B,), ``max_iters`` where it stopped short).

    A converged problem leaves the set (its state written back), and every tensor of ``state`` and ``fixed`` is
    sliced to the problems still iterating, so a problem's result does not depend on which problems share the
    call (bit for bit) and a call costs the sum of its problems' iterations, not B times the slowest one's (1.4x
    faster on a pool group of 16 batches of 8gaussians-moons, where the slowest needs 151 and most about 65)."""
    out, live = state, torch.arange(state[0].shape[0], device=state[0].device)
    iters = torch.full((len(live),), max_iters, dtype=torch.long, device=live.device)
    for done in range(1, max_iters + 1):
        state, still = update(*state, *fixed)
        if not bool(still.all()):
            stop = ~still
            out = tuple(o.index_copy(0, live[stop], s[stop]) for o, s in zip(out, state))
            iters[live[stop]] = done
            live, state, fixed = live[still], tuple(s[still] for s in state), tuple(t[still] for t in fixed)
            if len(live) == 0:
                return out, iters
    return tuple(o.index_copy(0, live, s) for o, s in zip(out, state)), iters


SELF_TOL = 1e-3  # the self potential is solved to SELF_TOL x the cross potentials' tolerance (see _self_potential)


def _self_potential(eps: float, c_xx: torch.Tensor, a_log: torch.Tensor, p: torch.Tensor, tol: float,
                    max_iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, iterations): the debiasing (self) potential p of OT_eps(x, x) at the final epsilon, each batch iterated
    until no entry moves by more than ``tol`` or than the dtype's rounding at p's magnitude (or ``max_iters``).

    Its symmetric update reads nothing of the cross problem's f and g, so it is solved on its own, first: from the
    annealed start it converges in about ten updates where the cross potentials need tens to hundreds (8gaussians-
    moons, 16 pool batches: p's step under 1e-5 eps after 10, f's under 0.01 eps after 77), and updating it along
    with them spent a third of the final-epsilon work on a solved problem. Solved to 1000x the cross tolerance, its
    remaining error changes the plan's weights by under 1e-5 (benchmarks/sinkhorn_solver.py measures the velocities
    against a converged float64 solve)."""

    def update(p, c_xx, a_log):
        p_new = (p + _softmin(eps, c_xx, a_log + p / eps)) / 2
        # below tol, or below the rounding of the dtype at the potentials' magnitude (where float32 stops moving)
        return (p_new,), (p_new - p).abs().amax(1) >= _stop_below(p_new, tol, eps * math.log(c_xx.shape[2]))

    (p,), iters = _until_converged(update, (p,), (c_xx, a_log), max_iters)
    return p, iters


def _stop_below(potential: torch.Tensor, tol: float, sum_scale: float) -> torch.Tensor:
    """(B,) the change below which a potential has converged: ``tol``, or the dtype's rounding of one update where
    that is larger (float32 stops moving there: in the log domain a tol of 1e-5 eps is below float32's resolution
    of potentials of size ~1, and such solves ran to max_iters where float64 took 119). An update's rounding is
    about the potential's magnitude plus its log-sum-exp's, ``sum_scale`` (eps log N in the log domain, log N on the
    absorbed kernel, in units of eps): with the potential's magnitude alone, a tight tol at a blur as large as the
    data ran every problem to max_iters and warned, though its velocity was right to 1e-6 (audit Z)."""
    floor = (4 * torch.finfo(potential.dtype).eps) * (potential.abs().amax(1) + sum_scale)
    return torch.clamp(floor, min=tol)


KERNEL_SAFE = 30.0  # the absorbed kernel is used while every logit (f_i + g_j - C_ij) / eps and log-scaling stays below
# this (e^30 ~ 1e13: float32 sums of a few thousand such terms stay finite); beyond it the log-domain loop runs instead


def _log_domain_final(eps, c_xy, c_yx, a_log, b_log, f, g, tol, max_iters, omega):
    """(f, g, iterations, plan_y): alternating over-relaxed log-domain updates at the final epsilon, to tol."""

    def update(f, g, c_xy, c_yx, a_log, b_log):
        g = (1 - omega) * g + omega * _softmin(eps, c_yx, a_log + f / eps)
        f_new = (1 - omega) * f + omega * _softmin(eps, c_xy, b_log + g / eps)
        return (f_new, g), (f_new - f).abs().amax(1) >= _stop_below(f_new, tol * eps, eps * math.log(c_xy.shape[2]))

    (f, g), iters = _until_converged(update, (f, g), (c_xy, c_yx, a_log, b_log), max_iters)
    return f, g, iters, _plan_rows(eps, c_xy, b_log + g / eps)


def _kernel_final(eps, logits, a_log, b_log, f, g, tol, max_iters, omega):
    """The same iterations as ``_log_domain_final`` on the absorbed kernel K_ij = exp((f_i + g_j - C_ij) / eps) of the
    annealed potentials (``logits``: the exponent, overwritten), with f = f0 + eps lu, g = g0 + eps lv: each
    c-transform becomes a matrix-vector product, lv = -log(K^T (a e^lu)), lu = -log(K (b e^lv)), instead of an exp
    over the whole cost matrix (Schmitzer's stabilised scaling, arXiv:1610.06519). The exp is paid once per solve
    instead of twice per iteration, the plan comes from K without another, and the iterates are the log-domain ones
    up to float rounding (the same iteration counts on every measured pool group: benchmarks/sinkhorn_solver.py).
    The products are written as a multiply and a sum over one axis: each batch's sums then run in the same order
    whatever batches share the call (bmm's do not: its result for one batch changed with the batch count), and on
    CPU they are faster than bmm's matrix-vector path (B = 16, 256 x 256: 0.41 + 0.34 ms against 1.64 + 0.19 ms, 1
    thread). Returns (f, g, iterations, plan_y, good): ``good`` (B,) is False where a scaling left float32's safe
    range (``KERNEL_SAFE``) or is not finite; the caller solves those batches again in the log domain."""
    kernel = logits.clamp_(min=LOGIT_FLOOR).exp_()

    def update(lu, lv, kernel, a_log, b_log):  # products as multiply-and-sum, not bmm: see the docstring
        lv = (1 - omega) * lv - omega * (kernel * (lu + a_log).exp_()[:, :, None]).sum(1).log_()
        lu_new = (1 - omega) * lu - omega * (kernel * (lv + b_log).exp_()[:, None, :]).sum(2).log_()
        return (lu_new, lv), (lu_new - lu).abs().amax(1) >= _stop_below(lu_new, tol, math.log(kernel.shape[2]))

    (lu, lv), iters = _until_converged(update, (torch.zeros_like(f), torch.zeros_like(g)), (kernel, a_log, b_log),
                                       max_iters)
    good = torch.maximum(lu.abs().amax(1), lv.abs().amax(1)) < KERNEL_SAFE  # False for NaN too
    plan_y = kernel.mul_((lv + b_log).exp_()[:, None, :])
    return f + eps * lu, g + eps * lv, iters, plan_y.div_(plan_y.sum(-1, keepdim=True)), good


def _final_potentials(final, eps, c_xy, c_yx, a_log, b_log, f, g, tol, max_iters, omega):
    """(f, g, iterations, plan_y) at the final epsilon: on the absorbed kernel (``final="kernel"``) for each batch whose
    annealed potentials allow it, in the log domain for the others (and for all with ``final="log"``). The choice is
    made per batch, so a batch's result still does not depend on which batches share the call."""
    if final not in ("kernel", "log"):
        raise ValueError(f"final must be 'kernel' or 'log', got {final!r}")
    log_args = (eps, c_xy, c_yx, a_log, b_log, f, g, tol, max_iters, omega)
    if final == "log":
        return _log_domain_final(*log_args)
    logits = (f[:, :, None] + g[:, None, :]).sub_(c_xy).div_(eps)
    rows = (logits.amax((1, 2)) <= KERNEL_SAFE).nonzero().squeeze(1)  # the batches tried on the kernel
    if len(rows) == 0:
        return _log_domain_final(*log_args)
    every = len(rows) == len(f)
    pick = (lambda t: t) if every else (lambda t: t[rows])  # noqa: E731
    *res, good = _kernel_final(eps, pick(logits), pick(a_log), pick(b_log), pick(f), pick(g), tol, max_iters, omega)
    if every and bool(good.all()):
        return tuple(res)
    done = rows[good]
    redo = torch.ones(len(f), dtype=torch.bool, device=f.device).index_fill_(0, done, False).nonzero().squeeze(1)
    out = [torch.empty((len(f), *r.shape[1:]), dtype=r.dtype, device=r.device).index_copy_(0, done, r[good])
           for r in res]
    again = _log_domain_final(eps, c_xy[redo], c_yx[redo], a_log[redo], b_log[redo], f[redo], g[redo], tol, max_iters,
                              omega)  # too far for float32 scalings: these batches in the log domain
    return tuple(o.index_copy_(0, redo, q) for o, q in zip(out, again))


def epsilon_schedule(diameter: float, blur: float, scaling: float) -> list[float]:
    """GeomLoss's annealing (p = 2): diameter^2, then down by scaling^2 per stage, ending at blur^2. A blur at or
    above the diameter has no stages between the two (GeomLoss's ``np.arange`` is empty there; torch's refuses the
    range, which made the converged solver fail on it with a raw RuntimeError)."""
    if blur >= diameter:
        return [diameter**2, blur**2]
    stages = torch.arange(2 * math.log(diameter), 2 * math.log(blur), 2 * math.log(scaling), dtype=torch.float64)
    return [diameter**2] + [float(e) for e in stages.exp()] + [blur**2]


def converged_velocity(x: torch.Tensor, y: torch.Tensor, *, blur: float, scaling: float, diameter: float,
                       max_iters: int = 200, tol: float = 1e-3, omega: float = OMEGA,
                       final: str = "kernel") -> tuple[torch.Tensor, torch.Tensor]:
    """(v, iterations) for clouds x (B, N, D), y (B, M, D) of any float dtype; ``iterations`` (B,) counts each
    batch's updates at the final epsilon (``max_iters`` where it stopped short of ``tol``).

    Each batch stops when one more Sinkhorn update moves none of its potentials by more than ``tol * eps``
    (then the plan's row marginals are within a factor exp(tol) of uniform), or after ``max_iters``; a
    stopped batch leaves the computation (``_until_converged``). The self (debiasing) potential is solved first, on
    its own (``_self_potential``), to a tighter tolerance; a batch whose self solve hit ``max_iters`` counts as
    stopped short too. The final-epsilon updates are over-relaxed (``omega``): plain Sinkhorn at eps = 0.01 on 256
    points needs thousands of iterations, over-relaxed about a hundred (benchmarks/sinkhorn_solver.py). They run on
    the absorbed kernel (``final="kernel"``, ``_kernel_final``) where the annealed potentials allow it, else (or with
    ``final="log"``) in the log domain.
    """
    B, N, _ = x.shape
    M = y.shape[1]
    a_log = x.new_full((B, N), -math.log(N))
    b_log = x.new_full((B, M), -math.log(M))
    c_xy, c_xx = _cost(x, y), _cost(x, x)
    c_yx = c_xy.transpose(1, 2)
    eps_list = epsilon_schedule(diameter, blur, scaling)
    eps = eps_list[0]
    f, g, p = _softmin(eps, c_xy, b_log), _softmin(eps, c_yx, a_log), _softmin(eps, c_xx, a_log)
    for eps in eps_list:  # symmetric, averaged updates while annealing (as GeomLoss)
        ft = _softmin(eps, c_xy, b_log + g / eps)
        gt = _softmin(eps, c_yx, a_log + f / eps)
        pt = _softmin(eps, c_xx, a_log + p / eps)
        f, g, p = (f + ft) / 2, (g + gt) / 2, (p + pt) / 2
    eps = blur**2
    p, self_iters = _self_potential(eps, c_xx, a_log, p, SELF_TOL * tol * eps, max_iters)
    f, g, iters, plan_y = _final_potentials(final, eps, c_xy, c_yx, a_log, b_log, f, g, tol, max_iters, omega)
    iters[self_iters >= max_iters] = max_iters  # a capped self solve leaves the velocity unconverged too
    capped = bool((iters >= max_iters).any())
    if _ACTIVE:  # a caller counts and reports them
        _ACTIVE[-1].add(iters.cpu(), max_iters, tol)
    elif capped:  # one constant message per run
        warnings.warn(SinkhornConvergenceWarning(
            f"Sinkhorn problems stopped at sinkhorn.max_iters={max_iters} before sinkhorn.tol={tol}: the flow's "
            f"velocities are not converged; raise sinkhorn.max_iters (or sinkhorn.blur: a larger epsilon converges "
            f"faster)"), stacklevel=2)
    plan_x = _plan_rows(eps, c_xx, a_log + p / eps)
    return torch.bmm(plan_y, y) - torch.bmm(plan_x, x), iters
