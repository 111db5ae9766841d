"""The 2D benchmark samplers of NSGF's Table 1, in torch, drawing only from the caller's generator.

Definitions follow scikit-learn (moons, S-curve), FFJORD (checkerboard) and torchcfm (8 Gaussians),
with one deliberate change: by default every sampler draws a *stratified* (balanced) sample, whose
points each follow the documented distribution exactly but whose empirical measure has much less
mass imbalance. That is what puts the finite-sample W2 floor (docs/data.md) below the paper's numbers;
``stratified=False`` gives the plain i.i.d. draw. Formulas: docs/data.md.
"""

from __future__ import annotations

import math

import torch
from torch.quasirandom import SobolEngine

from sinkflow.data.base import Distribution, check_sample_args
from sinkflow.errors import SinkflowError

_F64 = torch.float64
# torchcfm's centre order (torchcfm/utils.py eight_normal_sample); label k is the k-th centre.
_S = 1.0 / math.sqrt(2.0)
EIGHT_CENTRES = torch.tensor(
    [(1, 0), (-1, 0), (0, 1), (0, -1), (_S, _S), (_S, -_S), (-_S, _S), (-_S, -_S)], dtype=_F64
)
_SOBOL_MAX_DIM = 21201


def stratified_uniform(n: int, generator: torch.Generator) -> torch.Tensor:
    """n points of U[0,1), one in each interval [i/n, (i+1)/n), in random order (float64)."""
    return (torch.randperm(n, generator=generator).to(_F64) + torch.rand(n, generator=generator, dtype=_F64)) / n


def balanced_counts(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """n//k per category, the n%k leftovers given to distinct categories chosen at random."""
    counts = torch.full((k,), n // k, dtype=torch.long)
    counts[torch.randperm(k, generator=generator)[: n % k]] += 1
    return counts


def qmc_normal(n: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Randomised quasi-Monte-Carlo N(0, I): scrambled Sobol points pushed through the normal inverse CDF.

    The scramble seed is drawn from ``generator``, so draws stay reproducible and resumable.
    """
    if dim > _SOBOL_MAX_DIM:
        raise SinkflowError(f"qmc normal supports at most {_SOBOL_MAX_DIM} dimensions, got {dim}", "use 'normal'")
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    u = SobolEngine(dim, scramble=True, seed=seed).draw(n, dtype=_F64)
    eps = torch.finfo(_F64).eps
    return torch.special.ndtri(u.clamp(eps, 1.0 - eps))


def _finish(x: torch.Tensor, device) -> torch.Tensor:
    return x.to(torch.float32).to(device)


class Normal(Distribution):
    """Standard normal N(0, I) on any per-sample shape; ``qmc=True`` draws randomised Sobol points."""

    def __init__(self, shape: tuple[int, ...] = (2,), qmc: bool = False):
        self.shape = tuple(int(s) for s in shape)
        if not self.shape or any(s < 1 for s in self.shape):
            raise SinkflowError(f"normal: invalid sample shape {shape!r}",
                                "give positive ints, e.g. (2,) (in a run the shape follows data.target)")
        self.qmc = qmc
        self.name = "normal-qmc" if qmc else "normal"

    def sample(self, n, generator, device="cpu"):
        check_sample_args(n, generator, device)
        if self.qmc:
            x = qmc_normal(n, math.prod(self.shape), generator).reshape(n, *self.shape)
            return _finish(x, device)
        return torch.randn(n, *self.shape, generator=generator).to(device)


class EightGaussians(Distribution):
    """8 isotropic Gaussians (std ``std``) centred on a circle of radius ``radius``.

    ``stratified=True`` (default): every centre gets n//8 points (leftovers to random distinct centres)
    instead of torchcfm's multinomial counts. ``qmc=True`` also draws the offsets by randomised QMC, each mode's
    from its own scrambled Sobol draw (n/8 points: a power of 2 at n = 1024 or a pool batch of 256)."""

    name = "8gaussians"
    shape = (2,)

    def __init__(self, radius: float = 5.0, std: float = math.sqrt(0.1), stratified: bool = True, qmc: bool = False):
        self.radius, self.std, self.stratified, self.qmc = float(radius), float(std), stratified, qmc
        if qmc:
            self.name = "8gaussians-qmc"

    def sample_with_labels(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Float64 points and their centre index, on CPU (tests and plots use the labels)."""
        check_sample_args(n, generator)
        if self.stratified:
            labels = torch.repeat_interleave(torch.arange(8), balanced_counts(n, 8, generator))
            labels = labels[torch.randperm(n, generator=generator)]
        else:
            labels = torch.randint(0, 8, (n,), generator=generator)
        if self.qmc:  # each mode's offsets are a Sobol draw of their own: one draw of n dealt out by the shuffled
            # labels left every mode an i.i.d.-like subset of it (a mode's half-split off by +-5 of 128 points)
            noise = torch.empty(n, 2, dtype=_F64)
            for k in range(8):
                at = (labels == k).nonzero().flatten()
                if len(at):
                    noise[at] = qmc_normal(len(at), 2, generator)
        else:
            noise = torch.randn(n, 2, generator=generator, dtype=_F64)
        return self.radius * EIGHT_CENTRES[labels] + self.std * noise, labels

    def sample(self, n, generator, device="cpu"):
        check_sample_args(n, generator, device)
        return _finish(self.sample_with_labels(n, generator)[0], device)


class Moons(Distribution):
    """scikit-learn ``make_moons`` (two interleaved half circles plus N(0, noise^2 I)), then ``x*scale + shift``.

    ``stratified=True`` (default): n//2 points on the outer moon, arc angles stratified (one uniform draw
    in each of n equal intervals of [0, pi], so two batches never share their angles). ``stratified=False`` draws the
    angles uniformly at random (an i.i.d. sample of the same curve).
    """

    name = "moons"
    shape = (2,)

    def __init__(self, noise: float = 0.015, scale: float = 3.0, shift: tuple[float, float] = (-1.0, -1.0),
                 stratified: bool = True):
        self.noise, self.scale, self.stratified = float(noise), float(scale), stratified
        self.shift = torch.tensor(shift, dtype=_F64)

    def sample(self, n, generator, device="cpu"):
        check_sample_args(n, generator, device)
        n_out = n // 2
        n_in = n - n_out
        if self.stratified:
            a = math.pi * stratified_uniform(n_out, generator)
            b = math.pi * stratified_uniform(n_in, generator)
        else:
            a = math.pi * torch.rand(n_out, generator=generator, dtype=_F64)
            b = math.pi * torch.rand(n_in, generator=generator, dtype=_F64)
        outer = torch.stack([torch.cos(a), torch.sin(a)], 1)
        inner = torch.stack([1 - torch.cos(b), 1 - torch.sin(b) - 0.5], 1)
        x = torch.cat([outer, inner])[torch.randperm(n, generator=generator)]
        x = x + self.noise * torch.randn(n, 2, generator=generator, dtype=_F64)
        return _finish(x * self.scale + self.shift, device)


class SCurve(Distribution):
    """scikit-learn ``make_s_curve`` projected on its (x, z) coordinates, noise ``noise``, times ``scale``.

    t = 3*pi*(u - 1/2), x = sin t, z = sign(t) (cos t - 1). ``stratified=True`` (default) draws u with
    one point per interval [i/n, (i+1)/n) in random order; ``stratified=False`` draws u ~ U[0,1).
    """

    name = "scurve"
    shape = (2,)

    def __init__(self, noise: float = 0.05, scale: float = 1.5, stratified: bool = True):
        self.noise, self.scale, self.stratified = float(noise), float(scale), stratified

    def sample(self, n, generator, device="cpu"):
        check_sample_args(n, generator, device)
        u = stratified_uniform(n, generator) if self.stratified else torch.rand(n, generator=generator, dtype=_F64)
        t = 3 * math.pi * (u - 0.5)
        x = torch.stack([torch.sin(t), torch.sign(t) * (torch.cos(t) - 1)], 1)
        x = x + self.noise * torch.randn(n, 2, generator=generator, dtype=_F64)
        return _finish(x * self.scale, device)


class Checkerboard(Distribution):
    """FFJORD's checkerboard: uniform on 8 unit squares of a 4x4 board on [-2,2]^2, times ``scale``.

    ``stratified=True`` (default): n//8 points per square (leftovers to random distinct squares), each
    square filled by a jittered k x k grid (k = floor(sqrt(m)), one uniform point per cell) plus
    m - k^2 uniform points. ``stratified=False`` is FFJORD's i.i.d. formula.
    """

    name = "checkerboard"
    shape = (2,)

    def __init__(self, scale: float = 2.0, stratified: bool = True):
        self.scale, self.stratified = float(scale), stratified

    @staticmethod
    def _jittered_unit_square(m: int, generator: torch.Generator) -> torch.Tensor:
        k = math.isqrt(m)
        cells = torch.arange(k * k)
        grid = torch.stack([cells // k, cells % k], 1).to(_F64)
        pts = (grid + torch.rand(k * k, 2, generator=generator, dtype=_F64)) / max(k, 1)
        return torch.cat([pts, torch.rand(m - k * k, 2, generator=generator, dtype=_F64)])

    def sample(self, n, generator, device="cpu"):
        check_sample_args(n, generator, device)
        if not self.stratified:
            x1 = torch.rand(n, generator=generator, dtype=_F64) * 4 - 2
            x2_ = torch.rand(n, generator=generator, dtype=_F64) - torch.randint(0, 2, (n,), generator=generator) * 2
            x2 = x2_ + torch.floor(x1) % 2
            return _finish(torch.stack([x1, x2], 1) * self.scale, device)
        counts = balanced_counts(n, 8, generator)
        parts = []
        for square in range(8):  # column c in 0..3 covers x1 in [c-2, c-1); two allowed rows per column
            col, row = divmod(square, 2)
            p = self._jittered_unit_square(int(counts[square]), generator)
            x1 = col - 2 + p[:, 0]
            x2 = p[:, 1] - 2 * row + (col % 2)  # FFJORD: x2 = U - 2*B + floor(x1) % 2, B in {0, 1}
            parts.append(torch.stack([x1, x2], 1))
        x = torch.cat(parts)[torch.randperm(n, generator=generator)]
        return _finish(x * self.scale, device)


TOY2D = {
    "8gaussians": EightGaussians,
    "moons": Moons,
    "scurve": SCurve,
    "checkerboard": Checkerboard,
}
