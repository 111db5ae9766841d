"""What belongs to a run: the config keys frozen by the artifacts on disk, and every checkpoint's identity.

One place decides which keys shaped an artifact (``frozen_keys``). A key is frozen once an artifact it
shaped exists in the run folder; ``sinkflow train --resume RUN key=value`` that changes it is refused:

- the pool (``RUN/pool/``, ``checkpoints/pool/``) freezes every ``pool.*`` and ``sinkhorn.*`` key, the
  data section and the seed;
- a training phase's checkpoints freeze the same, plus its whole architecture ``model.<phase>.*`` and the
  ``nsgf.*`` section (how the network reads the pool: ``nsgf.time`` is the meaning of its time input);

except ``RUNTIME_KEYS``, which change how an artifact is computed or stored, never what it holds.
New ``pool.*`` / ``sinkhorn.*`` / ``model.*`` keys are therefore frozen without being listed here.

Every checkpoint carries ``identity(cfg, phase)``: preset, method, phase, a hash of the frozen keys and
the frozen values themselves (so a mismatch names the key). A checkpoint whose identity or step does
not match the run and its file name is refused on load (``check_checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sinkflow import config as config_mod
from sinkflow.errors import SinkflowError

# Frozen by every artifact: the run's identity, its data and its seed.
COMMON = ("experiment.preset", "experiment.method", "experiment.seed", "data.")
# Frozen by every artifact too: the pool and the Sinkhorn problem it solved (a training phase learns from it).
POOL_SECTIONS = ("pool.", "sinkhorn.")
# Keys that never shape what an artifact holds: where/how it is computed or stored.
RUNTIME_KEYS = frozenset({
    "pool.in_flight", "pool.chunk", "pool.storage", "pool.ram_gb", "pool.disk_gb",
    "data.root", "data.download",
    "model.flow.memory", "model.flow.drift_tol", "model.flow.checkpoint_segments",
})
# ... but pool.chunk numbers the finished chunks in progress.json: frozen while a pool is half built.
HALF_BUILT_POOL_KEYS = ("pool.chunk",)
# Refused on resume even before any artifact exists: they decide what the run is.
ALWAYS_FROZEN = ("experiment.preset", "experiment.method")
# ... and where it is: a resume continues the folder it was given (config.yaml naming another would lie).
LOCATION_KEYS = ("experiment.name", "experiment.runs_dir")


# Where a point file or an image folder is, not what it holds: data that moved (a project folder renamed, a run
# copied to another machine) is named at its new place by a resume (``train --resume RUN data.target=NEW``). What it
# holds is identified by RUN/data_split.json's hashes (``check_split``: refused if they differ), so a path-to-path
# change of these keys is allowed where that record holds the data's hash, and is no checkpoint's difference.
# key -> (where the record keeps its hash, the hash keys that identify the data)
DATA_LOCATION_KEYS = {"data.target": ((), ("points_sha256", "train_files_sha256")),
                      "data.source": (("source",), ("points_sha256",)),
                      "data.path": ((), ("train_files_sha256",))}


def _data_paths(key: str, a: Any, b: Any) -> bool:
    """Are ``a`` and ``b`` two places of the data ``key`` names (point files, or image folders for data.path), not a
    change of which data (``moons`` -> ``checkerboard``, or a built-in name -> a file)?"""
    if key not in DATA_LOCATION_KEYS or not (isinstance(a, str) and isinstance(b, str) and a and b):
        return False
    return key == "data.path" or all(v.lower().endswith(config_mod.schema.POINT_FILE_SUFFIXES) for v in (a, b))


def _hash_recorded(run_dir: Path, key: str) -> bool:
    """Does RUN/data_split.json hold the hash that identifies ``key``'s data?"""
    where, hashes = DATA_LOCATION_KEYS[key]
    try:
        node = json.loads((Path(run_dir) / "data_split.json").read_text())
    except (OSError, ValueError):
        return False
    for part in where:
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict) and any(isinstance(node.get(h), str) for h in hashes)


# Frozen by a training phase's checkpoints: how a network reads the pool (nsgf.time is its input's meaning).
TRAIN_SECTIONS = ("nsgf.",)


def frozen_prefixes(cfg: dict, phase: str) -> tuple[str, ...]:
    """A phase that trains a network (it has a ``model.<phase>`` section) is also shaped by that section and by
    how it reads the pool; a phase without one (the pool build) only by the data and the pool's problem."""
    trains = phase in cfg.get("model", {})
    return COMMON + POOL_SECTIONS + (TRAIN_SECTIONS + (f"model.{phase}.",) if trains else ())


def frozen_keys(cfg: dict, phase: str) -> dict[str, Any]:
    """The flattened keys (and values) that shaped ``phase``'s artifact."""
    prefixes = frozen_prefixes(cfg, phase)
    flat = config_mod.flatten(cfg)
    return {k: flat[k] for k in sorted(flat) if k.startswith(prefixes) and k not in RUNTIME_KEYS}


def config_hash(frozen: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(frozen, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(cfg: dict, phase: str) -> dict:
    exp = cfg["experiment"]
    frozen = frozen_keys(cfg, phase)
    return {"preset": exp["preset"], "method": exp["method"], "phase": phase, "config_hash": config_hash(frozen),
            "frozen": frozen}


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for the plain values an identity holds; anything else (a tensor put there) is not the same."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    try:
        if number(a) and number(b):
            return a == b  # 1 and 1.0: a value written before its key was coerced to a float
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a tensor or other object whose == is not a bool
        return False


def first_difference(theirs: dict, ours: dict) -> tuple[str, Any, Any] | None:
    """(key, their value, our value) of the first frozen key whose values differ; keys only one side has (added to
    sinkflow later: they take their default) are skipped, and so is data at another place (``DATA_LOCATION_KEYS``:
    RUN/data_split.json's hashes identify it, checked before a resume or an evaluation reads it)."""
    theirs = theirs if isinstance(theirs, dict) else {}
    for key in sorted(set(theirs) & set(ours), key=str):
        if not _same(theirs[key], ours[key]) and not _data_paths(key, theirs[key], ours[key]):
            return key, theirs[key], ours[key]
    return None


def check_checkpoint(obj: dict, expected: dict, path: Path, step: int | None = None) -> None:
    """Refuse a checkpoint that belongs to another run or phase, or whose step is not its file's."""
    got = obj.get("identity")
    foreign = "it belongs to another run; remove it (and any later ones) to resume from the one before, or start a new run"
    if not isinstance(got, dict):
        raise SinkflowError(f"checkpoint {path} carries no run identity (written by an older sinkflow or another tool)",
                            "start a new run; sinkflow only resumes checkpoints it wrote for this run")
    if not _same(got.get("phase"), expected["phase"]):
        raise SinkflowError(f"checkpoint {path} is phase '{got.get('phase')}', not '{expected['phase']}'", foreign)
    for key in ("preset", "method"):
        if not _same(got.get(key), expected[key]):
            raise SinkflowError(f"checkpoint {path} was written by a run of {key} '{got.get(key)}', "
                                f"this run's {key} is '{expected[key]}'", foreign)
    diff = first_difference(got.get("frozen"), expected["frozen"])
    if diff:  # config.yaml edited by hand, or a checkpoint copied in from another run
        key, was, now = diff
        raise SinkflowError(f"checkpoint {path} was written with {key}={was!r} but the run's config.yaml has "
                            f"{key}={now!r}", f"if config.yaml was edited, set {key} back to {was!r} in it (a new "
                            f"value of this key needs a new run); if the checkpoint was copied in, {foreign}")
    if not isinstance(obj.get("step"), int) or isinstance(obj.get("step"), bool):
        raise SinkflowError(f"checkpoint {path} does not say which step it holds", foreign)
    if step is not None and obj["step"] != step:
        raise SinkflowError(f"checkpoint {path} holds step {obj['step']}, not step {step} as its name says",
                            "it was renamed or copied in; delete it to resume from the checkpoint before it")
    if step is None and Path(path).name == "final.pt" and obj.get("final") is not True:
        raise SinkflowError(f"checkpoint {path} is not a final checkpoint (a step checkpoint renamed?)",
                            "delete it to resume the phase from its last step checkpoint")


# ---- frozen keys on resume ------------------------------------------------------------------------------

def _nonempty(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def artifacts(run_dir: Path) -> dict[str, str]:
    """{phase: what is on disk} for every phase that has left an artifact in the run folder."""
    run_dir = Path(run_dir)
    found: dict[str, str] = {}
    ck = run_dir / "checkpoints"
    if ck.is_dir():
        for d in sorted(ck.iterdir()):
            if d.is_dir() and any(p.suffix == ".pt" for p in d.iterdir()):
                found[d.name] = "the finished pool" if d.name == "pool" else f"the '{d.name}' checkpoints"
    if "pool" not in found and (_nonempty(run_dir / "pool")):
        found["pool"] = "the half-built pool"
    return found


def check_frozen(old: dict, new: dict, run_dir: Path) -> None:
    """Refuse a resume config that changes a key which shaped an artifact already in ``run_dir``."""
    on_disk = artifacts(run_dir)
    old_flat, new_flat = config_mod.flatten(old), config_mod.flatten(new)
    for key in sorted(new_flat):
        if new_flat[key] == old_flat.get(key):
            continue
        if _data_paths(key, old_flat.get(key), new_flat[key]) and _hash_recorded(run_dir, key):
            continue  # the data moved: its hashes in data_split.json are compared before it is read (check_split)
        if key in ALWAYS_FROZEN:
            why = "the run folder was made for it"
        elif key in LOCATION_KEYS:
            raise SinkflowError(f"cannot resume {run_dir} with {key}={new_flat[key]!r}: a resume continues the run in "
                                "its own folder, which it does not rename or move",
                                f"drop that override; to continue a copy elsewhere, `cp -r {run_dir} NEW` and "
                                "`sinkflow train --resume NEW`")
        else:
            order = ["pool", *config_mod.schema.METHOD_PHASES.get(old["experiment"]["method"], ())]
            shaped = [what for phase, what in sorted(on_disk.items(), key=lambda item: (  # the first the run built
                order.index(item[0]) if item[0] in order else len(order), item[0]))
                      if key.startswith(frozen_prefixes(old, phase)) and key not in RUNTIME_KEYS]
            if key in HALF_BUILT_POOL_KEYS and on_disk.get("pool") == "the half-built pool":
                shaped.append("the half-built pool (its finished chunks are numbered by it)")
            if not shaped:
                continue
            why = f"it shaped {shaped[0]}"
        raise SinkflowError(
            f"cannot resume {run_dir} with {key}={new_flat[key]!r}: the run has {key}={old_flat.get(key)!r} and {why}",
            "drop that override to resume, or start a new run with it")
