"""Atomic, rotated checkpoints that any PyTorch tool can read (`torch.load`).

A checkpoint is written to a temporary file in the same folder, fsynced, then renamed over its final
name, so a crash mid-write never leaves a half-written file under a real name. Rotation deletes old
checkpoints only *after* the new one is complete, so the newest valid checkpoint always survives.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinkflow.errors import SinkflowError

STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def atomic_write_bytes(path: Path, write) -> None:
    """Call ``write(fileobj)`` on a temp file next to ``path``, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_save(obj: Any, path: Path) -> None:
    atomic_write_bytes(Path(path), lambda f: torch.save(obj, f))


def load(path: Path, map_location="cpu") -> dict:
    """Load a checkpoint, turning a truncated or foreign file into a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise SinkflowError(f"checkpoint {path} does not exist", "check the run folder path")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # truncated zip, pickle garbage, ...
        raise SinkflowError(
            f"checkpoint {path} is corrupt or truncated ({type(exc).__name__})",
            "delete it to resume from the previous checkpoint, or start a new run",
        ) from None
    if not isinstance(obj, dict) or "format" not in obj:
        raise SinkflowError(f"{path} is not a sinkflow checkpoint", "pass a run folder written by `sinkflow train`")
    return obj


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class PhaseCheckpoints:
    """Step checkpoints of one phase (``step_XXXXXXXX.pt``) and its ``final.pt``."""

    def __init__(self, folder: Path, keep: int = 3):
        self.folder = Path(folder)
        self.keep = max(1, keep)

    @property
    def final_path(self) -> Path:
        return self.folder / "final.pt"

    def steps(self) -> list[tuple[int, Path]]:
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := STEP_FILE.match(p.name))]
        return sorted(found)

    def save(self, state: dict, step: int) -> Path:
        path = self.folder / f"step_{step:08d}.pt"
        atomic_save({"format": 1, "step": step, **state}, path)
        for _, old in self.steps()[: -self.keep]:  # only after the new one is complete
            old.unlink(missing_ok=True)
        return path

    def save_final(self, state: dict) -> Path:
        atomic_save({"format": 1, "final": True, **state}, self.final_path)
        return self.final_path

    def latest(self) -> dict | None:
        """The newest loadable step checkpoint; a corrupt newest one is reported, not skipped silently."""
        steps = self.steps()
        if not steps:
            return None
        return load(steps[-1][1])
