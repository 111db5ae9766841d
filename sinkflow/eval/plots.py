"""Matplotlib PNGs (Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def scatter_samples(generated: torch.Tensor, target: torch.Tensor | None, path: Path, title: str = "") -> Path:
    """Generated over target points: a scatter of the first two coordinates (rows of any shape are flattened), or
    two histograms for one-dimensional points. ``target`` None: the generated points alone (a run sampled without
    its point file)."""
    generated = flat(generated)
    target = flat(target) if target is not None else generated[:0]
    fig, ax = plt.subplots(figsize=(5, 5))
    if generated.shape[1] == 1:
        both = torch.cat([generated, target])
        bins = torch.linspace(float(both.min()), float(both.max()), 61)
        if len(target):
            ax.hist(target[:, 0].numpy(), bins=bins.numpy(), density=True, alpha=0.5, label="target",
                    color="tab:blue")
        ax.hist(generated[:, 0].numpy(), bins=bins.numpy(), density=True, alpha=0.5, label="generated",
                color="tab:orange")
        return _save(fig, ax, title, path, markerscale=1, equal=False)
    if len(target):
        ax.scatter(target[:, 0], target[:, 1], s=3, alpha=0.5, label="target", c="tab:blue")
    ax.scatter(generated[:, 0], generated[:, 1], s=3, alpha=0.5, label="generated", c="tab:orange")
    return _save(fig, ax, title + two_of(generated), path, markerscale=4)


def trajectories(path_states: torch.Tensor, path: Path, title: str = "", n_paths: int = 256) -> Path:
    """``path_states``: (steps+1, N, *shape). Source in black, paths in grey, end points in orange: in the plane of
    the first two coordinates, or against the sampling step for one-dimensional points (the states' index: it was
    drawn as "flow time" 0..1, which a warped grid (sample.time_warp), NSGF's flow time (nsgf.time=flow, sum of
    eta) and NSGF++'s NSGF steps then straight flow from t_hat are not)."""
    p = path_states[:, :n_paths].reshape(path_states.shape[0], min(n_paths, path_states.shape[1]), -1)
    fig, ax = plt.subplots(figsize=(5, 5))
    if p.shape[2] == 1:
        k = torch.arange(p.shape[0])
        ax.plot(k, p[:, :, 0], c="grey", alpha=0.3, lw=0.5)
        ax.scatter(torch.zeros(p.shape[1]), p[0, :, 0], s=4, c="black", label="source")
        ax.scatter(torch.full((p.shape[1],), p.shape[0] - 1), p[-1, :, 0], s=4, c="tab:orange", label="generated")
        ax.set_xlabel("sampling step")
        return _save(fig, ax, title, path, markerscale=3, equal=False)
    ax.plot(p[:, :, 0], p[:, :, 1], c="grey", alpha=0.3, lw=0.5)
    ax.scatter(p[0, :, 0], p[0, :, 1], s=4, c="black", label="source")
    ax.scatter(p[-1, :, 0], p[-1, :, 1], s=4, c="tab:orange", label="generated")
    return _save(fig, ax, title + two_of(p[0]), path, markerscale=3)


def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(len(x), -1)


def two_of(x: torch.Tensor) -> str:
    """A title's note when the plane shown is two of more coordinates."""
    d = flat(x).shape[1]
    return f"\n(coordinates 1-2 of {d})" if d > 2 else ""


def _save(fig, ax, title: str, path: Path, markerscale: int, equal: bool = True) -> Path:
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper right", markerscale=markerscale)
    if equal:
        ax.set_aspect("equal")
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def save_figure(fig, path, **kwargs) -> Path:
    """``fig.savefig(path)``, atomically (``atomic_write_bytes``), and closed: a kill or a full disk mid-write leaves
    the file that was there (a `sample --out samples.png` of before, a report's plot) as it was, where savefig had
    cut it short, and names the file in its error. The format is the name's suffix, as savefig reads it."""
    from sinkflow.data.atomic_write import atomic_write_bytes

    path = Path(path)
    try:
        atomic_write_bytes(path, lambda f: fig.savefig(f, format=path.suffix[1:].lower() or None, **kwargs))
    finally:
        plt.close(fig)
    return path
