"""Matplotlib PNGs (Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def scatter_samples(generated: torch.Tensor, target: torch.Tensor, path: Path, title: str = "") -> Path:
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(target[:, 0], target[:, 1], s=3, alpha=0.5, label="target", c="tab:blue")
    ax.scatter(generated[:, 0], generated[:, 1], s=3, alpha=0.5, label="generated", c="tab:orange")
    return _save(fig, ax, title, path, markerscale=4)


def trajectories(path_states: torch.Tensor, path: Path, title: str = "", n_paths: int = 256) -> Path:
    """``path_states``: (steps+1, N, 2). Source in black, paths in grey, end points in orange."""
    p = path_states[:, :n_paths]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot(p[:, :, 0], p[:, :, 1], c="grey", alpha=0.3, lw=0.5)
    ax.scatter(p[0, :, 0], p[0, :, 1], s=4, c="black", label="source")
    ax.scatter(p[-1, :, 0], p[-1, :, 1], s=4, c="tab:orange", label="generated")
    return _save(fig, ax, title, path, markerscale=3)


def _save(fig, ax, title: str, path: Path, markerscale: int) -> Path:
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper right", markerscale=markerscale)
    ax.set_aspect("equal")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
