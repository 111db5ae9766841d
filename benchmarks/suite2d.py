"""Eight 2D target families that are in no preset: the kinds of point clouds users bring (issue 26).

Each family is a mixture of components; a component maps a uniform vector u in [0, 1)^3 to a point (Gaussian
parts through the normal inverse CDF). That gives every family two samplers from one definition:

- ``iid``: mode labels drawn with the family's masses, u ~ U[0, 1)^3: what a user's own data is;
- ``stratified``: mode counts split by largest remainder (balanced), u a scrambled-Sobol draw per mode: the
  low-floor test draw of the QMC / stratified protocol (as the presets' stratified test sets).

``write_suite(folder)`` saves each family as an (N, 2) float32 ``.npy`` of 10,000 training rows followed by 1,024
held-out rows (``data.test_rows=1024``), deterministically (a fixed seed per family and draw), to be passed as
``data.target=`` exactly as a user would. Nothing here is read by sinkflow itself.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
from scipy.special import ndtri
from scipy.stats import qmc
from scipy.stats import t as student_t

TRAIN_ROWS, TEST_ROWS = 10_000, 1024
_EPS = 1e-12


def _u(u):
    return np.clip(u, _EPS, 1 - _EPS)


def gaussian(centre, std):
    """N(centre, diag(std)^2) from u[:, :2]."""
    c, s = np.asarray(centre, float), np.asarray(std, float) * np.ones(2)
    return lambda u: c + s * ndtri(_u(u[:, :2]))


def curve(path, noise):
    """A point of ``path(s)`` (s = u[:, 0]) plus isotropic Gaussian noise from u[:, 1:3]."""
    return lambda u: path(u[:, 0]) + noise * ndtri(_u(u[:, 1:3]))


def spiral(s):  # Archimedean spiral, two turns, radius 0.5 -> 4.5
    th = 4 * math.pi * s
    r = 0.5 + 4.0 * s
    return np.stack([r * np.cos(th), r * np.sin(th)], 1)


def ring(radius, centre=(0.0, 0.0)):
    return lambda s: np.asarray(centre) + radius * np.stack([np.cos(2 * math.pi * s), np.sin(2 * math.pi * s)], 1)


def roll(s):  # scikit-learn's swiss roll (x, z) projection, scaled to radius ~4.9
    t = 1.5 * math.pi * (1 + 2 * s)
    return 0.35 * np.stack([t * np.cos(t), t * np.sin(t)], 1)


def disk(centre, radius):
    """Uniform on a disk from u[:, :2] (area-preserving: r = R sqrt(u0))."""
    c = np.asarray(centre, float)
    return lambda u: c + radius * np.sqrt(u[:, :1]) * np.stack(
        [np.cos(2 * math.pi * u[:, 1]), np.sin(2 * math.pi * u[:, 1])], 1)


def heavy(scale, df):
    """Independent Student-t(df) coordinates (heavy tails: a few points far out), times ``scale``."""
    return lambda u: scale * student_t.ppf(_u(u[:, :2]), df)


# name -> (data.source, mode masses, components, what it tests)
FAMILIES: dict[str, tuple[str, list[float], list, str]] = {
    "unequal": ("normal", [0.62, 0.31, 0.07],
                [gaussian((-2.5, -1.0), 0.6), gaussian((2.0, 1.5), 0.45), gaussian((2.5, -2.5), 0.3)],
                "3 Gaussians of masses 62 / 31 / 7 %"),
    "spiral": ("normal", [1.0], [curve(spiral, 0.03)], "a thin two-turn spiral (noise 0.03)"),
    "grid25": ("normal", [0.04] * 25,
               [gaussian((1.6 * (i % 5 - 2), 1.6 * (i // 5 - 2)), 0.12) for i in range(25)],
               "25 equal Gaussians on a 5 x 5 grid (std 0.12, spacing 1.6)"),
    "student": ("normal", [1.0], [heavy(0.8, 4.0)], "independent Student-t(4) coordinates, scale 0.8"),
    "aniso": ("normal", [0.5, 0.5], [gaussian((0.0, 0.6), (4.0, 0.08)), gaussian((0.0, -0.6), (4.0, 0.08))],
              "two flat Gaussians, std 4 along x and 0.08 along y"),
    "rings": ("normal", [0.25, 0.75], [curve(ring(1.0), 0.06), curve(ring(3.0), 0.06)],
              "two concentric rings, radii 1 and 3 (mass as circumference)"),
    "sizes": ("normal", [0.5, 0.5], [disk((-1.5, 0.0), 2.5), gaussian((3.5, 2.0), 0.1)],
              "a uniform disk of radius 2.5 and a Gaussian of std 0.1, equal mass"),
    "8g-roll": ("8gaussians", [1.0], [curve(roll, 0.15)], "a noisy swiss roll from the 8-Gaussian source"),
}


def counts(masses, n: int, rng: np.random.Generator, stratified: bool) -> np.ndarray:
    """Points per mode: multinomial (i.i.d.) or largest remainder, leftovers to random modes (stratified)."""
    p = np.asarray(masses, float) / sum(masses)
    if not stratified:
        return rng.multinomial(n, p)
    c = np.floor(n * p).astype(int)
    rest = n - c.sum()
    if rest:
        frac = n * p - c
        order = np.argsort(-(frac + 1e-9 * rng.random(len(p))))
        c[order[:rest]] += 1
    return c


def sample(name: str, n: int, seed: int, stratified: bool = False, masses=None) -> np.ndarray:
    """n points (float64, shuffled) of family ``name``: an i.i.d. draw, or the stratified (QMC) one; ``masses``
    replaces the family's mode masses (a training file's own, say: ``file_masses``)."""
    return sample_with_labels(name, n, seed, stratified, masses)[0]


def sample_with_labels(name: str, n: int, seed: int, stratified: bool = False,
                       masses=None) -> tuple[np.ndarray, np.ndarray]:
    """``sample`` and each point's component index (for the mode-mass diagnostics)."""
    _, family_masses, comps, _ = FAMILIES[name]
    masses = family_masses if masses is None else masses
    rng = np.random.default_rng(seed)
    parts, labels = [], []
    for k, (m, comp) in enumerate(zip(counts(masses, n, rng, stratified), comps)):
        if m == 0:
            continue
        if stratified:
            with warnings.catch_warnings():  # m is rarely a power of 2: the draw is still a stratified one
                warnings.simplefilter("ignore", UserWarning)
                u = qmc.Sobol(3, scramble=True, seed=rng).random(m)
        else:
            u = rng.random((m, 3))
        parts.append(comp(u))
        labels.append(np.full(m, k))
    order = rng.permutation(n)
    return np.concatenate(parts)[order], np.concatenate(labels)[order]


def labelled_reference(name: str, n: int = 200_000):
    """A KD-tree over an n-point draw of family ``name`` (seed 9000) and each point's mode: nearest-neighbour mode
    assignment for ``file_masses`` and ``nsgf_suite.diagnose`` (built once, about a second at 200,000 points)."""
    from scipy.spatial import cKDTree

    ref, labels = sample_with_labels(name, n, seed=9000)
    return cKDTree(ref), labels


def file_masses(name: str, rows: np.ndarray, reference=None) -> list[float]:
    """The share of ``rows`` in each mode of family ``name``: each row takes the mode of its nearest neighbour in a
    labelled reference draw (``labelled_reference``; pass one already built to reuse it)."""
    tree, labels = reference if reference is not None else labelled_reference(name)
    idx = tree.query(rows)[1]
    return [float(v) for v in np.bincount(labels[idx], minlength=len(FAMILIES[name][1])) / len(rows)]


DRAW_STRIDE = 1000  # draw d of a family uses seed 26_000 + family index + DRAW_STRIDE * d (draw 0: the original files)


def write_suite(folder: Path, names=None, draw: int = 0) -> dict[str, Path]:
    """Save each family as ``folder/<name>.npy`` (draw 0) or ``folder/<name>-d<draw>.npy``: 10,000 training rows,
    then 1,024 held-out rows (float32), one independent i.i.d. draw per ``draw``. A model can only be as close to
    the family as its 10,000 rows are: one draw's mode masses are off by about 0.5 % (binomial) and its 0.1 % tail is
    a dozen points, and that draw is shared by every training seed that trains on it, so ``nsgf_suite`` gives each
    training seed its own draw and the seed spread then includes the data's own noise."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names or FAMILIES:
        x = sample(name, TRAIN_ROWS + TEST_ROWS, seed=26_000 + list(FAMILIES).index(name) + DRAW_STRIDE * draw)
        path = folder / (f"{name}.npy" if draw == 0 else f"{name}-d{draw}.npy")
        if not path.exists() or not np.array_equal(np.load(path), x.astype(np.float32)):
            np.save(path, x.astype(np.float32))
        out[name] = path
    return out
