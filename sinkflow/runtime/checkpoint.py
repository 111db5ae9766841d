"""Atomic, rotated checkpoints that any PyTorch tool can read (`torch.load(path, weights_only=True)`).

A checkpoint is written to a temporary file in the same folder, fsynced, then renamed over its final
name (``sinkflow.data.atomic_write``), so a crash mid-write never leaves a half-written file under a real
name. Rotation deletes old checkpoints only *after* the new one is complete, so the newest valid checkpoint
always survives.

Checkpoints hold only tensors, numbers, strings, lists and dicts (RNG states included), and every load
goes through ``torch.load(..., weights_only=True)``: a crafted file cannot run code, it is refused. A
checkpoint with a non-finite tensor is never written. Each checkpoint carries the run's identity
(``sinkflow.runtime.identity``) and the step it holds; ``PhaseCheckpoints.load`` checks both.
"""

from __future__ import annotations

import random
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinkflow.data.atomic_write import atomic_write_bytes
from sinkflow.errors import SinkflowError
from sinkflow.runtime.lock import check_held

STEP_FILE = re.compile(r"^step_(\d+)\.pt$")
FORMAT = 2  # 2: weights-only payload (plain RNG states), run identity and step in every checkpoint


def non_finite(obj: Any, where: str = "") -> str | None:
    """The name of the first floating-point tensor in a nested dict/list holding NaN or Inf, else None."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
            return where or "a tensor"
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        bad = non_finite(value, f"{where}.{key}" if where else str(key))
        if bad:
            return bad
    return None


def atomic_save(obj: Any, path: Path) -> None:
    """Write a checkpoint atomically; one holding NaN or Inf is refused (it would poison every resume)."""
    bad = non_finite(obj)
    if bad:
        raise SinkflowError(f"refusing to write {path}: {bad} holds NaN or Inf",
                            "the earlier checkpoints are kept; lower the learning rate or check the data")
    atomic_write_bytes(Path(path), lambda f: torch.save(obj, f))


# how the weights-only unpickler words a refused payload (torch 2.4-2.13: "Unsupported global"; 2.14: "unsupported
# GLOBAL posix.system whose module posix is blocked")
_UNSAFE = re.compile(r"unsupported (global|operand|class)|not an allowed global|is blocked", re.IGNORECASE)


def load(path: Path, map_location="cpu") -> dict:
    """Load a checkpoint without running code: tensors, numbers, strings, lists and dicts only.

    A truncated file, a file that needs more than that (a pickle that would import or call anything)
    and a file that is not a sinkflow checkpoint are each a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise SinkflowError(f"checkpoint {path} does not exist", "check the run folder path")
    try:
        check_sums(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "pickle protocol N" chatter of the weights-only unpickler
            obj = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # truncated zip, pickle garbage, a global the weights-only unpickler refuses...
        text = str(exc)
        if "Weights only load failed" in text and _UNSAFE.search(text) and _a_pickle(path):
            raise SinkflowError(
                f"checkpoint {path} holds objects other than tensors, numbers, strings, lists and dicts, so it "
                "was refused (loading it could run code)",
                "use only checkpoints this sinkflow wrote for this run (checkpoints of sinkflow before format 2 "
                "pickled numpy RNG states and cannot be resumed: start a new run)") from None
        earlier = _earlier_checkpoint(path)
        raise SinkflowError(
            f"checkpoint {path} is corrupt or truncated ({type(exc).__name__})",
            f"delete it to resume from the previous checkpoint ({earlier.name}), or start a new run" if earlier else
            "delete it to run this phase again from its start (it has no earlier checkpoint), or start a new run",
        ) from None
    if not isinstance(obj, dict) or "format" not in obj:
        raise SinkflowError(f"{path} is not a sinkflow checkpoint", "pass a run folder written by `sinkflow train`")
    return obj


def check_sums(path: Path) -> None:
    """Raise ``zipfile.BadZipFile`` where a record of the torch archive ``path`` fails the CRC-32 torch.save wrote
    for it. torch.load never checks them: a flipped byte in a weight (a disk or copy fault) loaded without a word, and
    the resume trained on, and `sample` drew from, a network nobody trained. A record whose CRC is 0 (torch's
    ``compute_crc32`` off) has none to check; a file that is not a zip is left to torch.load's own errors."""
    if not zipfile.is_zipfile(path):
        return
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        return
    with archive:
        for info in archive.infolist():
            if info.CRC:
                with archive.open(info) as record:  # reading to its end checks the CRC
                    while record.read(1 << 24):
                        pass


def _a_pickle(path: Path) -> bool:
    """Is ``path`` a whole torch archive (a zip) or a pickle (protocol >= 2 opens with PROTO, 0x80)? Random bytes
    over a checkpoint (a disk fault) read as pickle opcodes too, "Unsupported operand 156": called a refusal to run
    code, their fix had been "start a new run" where deleting the file resumes from the checkpoint before it."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(1)
        return zipfile.is_zipfile(path) or head == b"\x80"
    except OSError:
        return False


def _earlier_checkpoint(path: Path) -> Path | None:
    """The newest step checkpoint beside ``path`` written before it (any, for final.pt), or None: what deleting a
    damaged ``path`` falls back to (the message said "the previous checkpoint" where there was none, and the resume
    then trained the phase from step 0 without a word)."""
    mine = STEP_FILE.match(path.name)
    before = [p for step, p in PhaseCheckpoints(path.parent).steps() if mine is None or step < int(mine.group(1))]
    return before[-1] if before else None


def rng_state() -> dict:
    """Every global RNG state as tensors, numbers, strings and lists (loadable with ``weights_only=True``)."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"name": str(name), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "python": {"version": int(version), "state": list(mt), "gauss_next": gauss_next}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    if isinstance(npy, dict):
        npy = (npy["name"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    np.random.set_state(npy)
    py = state["python"]
    if isinstance(py, dict):
        py = (py["version"], tuple(py["state"]), py["gauss_next"])
    random.setstate(py)
    if "cuda" in state and torch.cuda.is_available():
        set_cuda_rng_states(state["cuda"])


def set_cuda_rng_states(states: list) -> None:
    """Each CUDA card's generator state, for the cards this machine has: a run saves one state per visible card
    (``get_rng_state_all``), and ``set_rng_state_all`` sets them by index, so a run trained where 8 cards were visible
    and resumed on a machine with 1 ended in torch's IndexError from ``default_generators[1]`` (a traceback mid-resume);
    the states of cards not here have no generator to go to (a resume on other cards draws other dropout masks)."""
    for index, cuda_state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(cuda_state, index)


TMP_FILE = re.compile(r"^\..+\.tmp(-?\d+(-[0-9a-f]{8})?)?$")  # atomic_write.temp_beside's, and the older forms


def remove_orphans(folder: Path) -> list[Path]:
    """Delete the temp files (``.NAME.tmp-PID-RANDOM``) that killed writes left in ``folder`` and below.

    Call it only while holding the run folder's lock: then no other process is writing there."""
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in folder.rglob(".*.tmp*"):
        if p.is_file() and TMP_FILE.match(p.name):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


class PhaseCheckpoints:
    """Step checkpoints of one phase (``step_XXXXXXXX.pt``) and its ``final.pt``.

    ``identity`` (``sinkflow.runtime.identity.identity``) is written into every checkpoint, and every
    checkpoint loaded through this object must carry the same one and the step its file name says."""

    def __init__(self, folder: Path, keep: int = 3, identity: dict | None = None):
        self.folder = Path(folder)
        self.keep = max(1, keep)
        self.identity = identity

    @property
    def final_path(self) -> Path:
        return self.folder / "final.pt"

    def steps(self) -> list[tuple[int, Path]]:
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := STEP_FILE.match(p.name))]
        return sorted(found)

    def _payload(self, state: dict, **extra) -> dict:
        return {"format": FORMAT, **({"identity": self.identity} if self.identity else {}), **state, **extra}

    def save(self, state: dict, step: int) -> Path:
        check_held(self.folder.parent.parent)  # RUN/checkpoints/<phase>: still this process's run folder
        path = self.folder / f"step_{step:08d}.pt"
        atomic_save(self._payload(state, step=step), path)
        for _, old in self.steps()[: -self.keep]:  # only after the new one is complete
            old.unlink(missing_ok=True)
        return path

    def save_final(self, state: dict) -> Path:
        check_held(self.folder.parent.parent)
        atomic_save(self._payload(state, final=True), self.final_path)
        return self.final_path

    def load(self, path: Path) -> dict:
        """Load one of this phase's checkpoints and check that it belongs here (identity, step)."""
        path = Path(path)
        obj = load(path)
        if self.identity is not None:
            from sinkflow.runtime.identity import check_checkpoint

            m = STEP_FILE.match(path.name)
            check_checkpoint(obj, self.identity, path, step=int(m.group(1)) if m else None)
        return obj

    def latest(self) -> dict | None:
        """The newest step checkpoint, checked; a corrupt or foreign newest one is reported, not skipped."""
        steps = self.steps()
        if not steps:
            return None
        return self.load(steps[-1][1])

    def final(self) -> dict:
        return self.load(self.final_path)

    def last_good(self) -> str:
        """Which checkpoint a resume would continue from, in words (for stop messages)."""
        steps = self.steps()
        if steps:
            return f"the last good checkpoint {steps[-1][1]} (step {steps[-1][0]}) is kept"
        return "no checkpoint of this phase exists yet (a resume restarts it from step 0)"
