"""A run folder: the resolved config, provenance, checkpoints, logs, and the phases' outputs.

Layout::

    RUN/config.yaml        resolved config tree (what `--resume` re-reads)
    RUN/meta.json          seed, package versions, git hash, command line
    RUN/checkpoints/PHASE/step_XXXXXXXX.pt, final.pt
    RUN/pool/              the NSGF trajectory pool (numpy .npy, memmap-able)
    RUN/metrics.jsonl, RUN/tb/, RUN/status.json
    RUN/.lock              held (fcntl.flock) by the one process writing the run, with its pid@host

Nothing is written into a run folder until every check has passed (``RunFolder.start``); docs/reliability.md.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from sinkflow import config as config_mod
from sinkflow.config import schema
from sinkflow.data import sample_shape
from sinkflow.data.atomic_write import atomic_write_text, write_refused
from sinkflow.errors import SinkflowError
from sinkflow.runtime import dist
from sinkflow.runtime.checkpoint import PhaseCheckpoints, remove_orphans
from sinkflow.runtime.identity import check_frozen, identity
from sinkflow.runtime.lock import finish_fix, lock_run, run_lock
from sinkflow.runtime.metrics import MetricsLogger
from sinkflow.runtime.state_check import check_final, check_weights

log = logging.getLogger("sinkflow")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise SinkflowError(f"experiment.device={name!r} is not a device", "use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SinkflowError(f"experiment.device={name} but CUDA is not available here", "use --device cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise SinkflowError(f"experiment.device={name} but this machine has {count} CUDA device(s)",
                                f"use cuda:0..cuda:{count - 1}, cuda or auto")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():  # a traceback from the pool, after the run folder was made
            raise SinkflowError(f"experiment.device={name} but MPS (Apple GPU) is not available here",
                                "use --device cpu or auto")
    elif device.type != "cpu":
        raise SinkflowError(f"experiment.device={name} is not supported", "use auto, cpu, cuda or cuda:N")
    return device


def _git_hash() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except Exception:
        return None


def _versions() -> dict:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for pkg in ("sinkflow", "torch", "torchvision", "geomloss", "pot", "numpy", "scikit-learn"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return versions


class RunFolder:
    """Everything a phase needs: config, device, folder, logger, checkpoints, finished phases' models."""

    def __init__(self, run_dir: Path, cfg: dict, log: bool = True, log_best_effort: bool = False):
        """``log=False``: a read-only look at a run (doctor, lr-find on a user's run) logs nothing into it.
        ``log_best_effort`` (``sinkflow eval``): a folder that cannot be written skips the record
        (``MetricsLogger.failed`` says why) instead of failing the caller."""
        self.dir = Path(run_dir)
        self.cfg = cfg
        self.read_only = not log  # a task computes what it would keep in the folder, but does not write it
        self.dist = dist.current()
        self.device = dist.device_for(self.dist, resolve_device(cfg["experiment"]["device"]))
        self.logger = MetricsLogger(self.dir, enabled=self.dist.is_main and log, best_effort=log_best_effort)
        self._models: dict[str, torch.nn.Module] = {}
        self._pending_config: dict | None = None  # a resume's new config.yaml, written by start()
        self._checked_finals: set[tuple] = set()
        self._disk_config: dict = cfg
        self.resume_at: tuple | None = None  # (phase, step) where a resume continues (plan_resume)
        self.phase_keys: dict[str, str] = {}  # phase name -> its model key (plan_resume)
        self.to_train: list[str] = []  # model keys of the training phases a resume still trains (plan_resume)
        self.shorthand_keys: set[str] = set()  # keys a resume's shorthands changed and no override named (open)

    # ---- creation and resume -------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: dict, call: str | None = None) -> "RunFolder":
        """A new run folder holding ``cfg`` and meta.json: seed, time, git, versions, the process's argv and cwd,
        and ``call``, the Python call that started it where that is not the command line (``sinkflow.train(...)``
        from a notebook: argv is the kernel's)."""
        exp = cfg["experiment"]
        resolve_device(exp["device"])  # a bad device is refused before the folder exists
        if exp["name"] is not None and not exp["name"].strip():  # `--name " "` made a folder named " "
            raise SinkflowError(f"experiment.name={exp['name']!r} is blank", "use a plain name, e.g. --name moons-long, "
                                "or leave it out for <preset>-<method>-<time>")
        if exp["name"] and (exp["name"] in (".", "..") or any(sep in exp["name"] for sep in ("/", "\\", os.sep))):
            parts = exp["name"].replace("\\", "/").split("/")
            where = (f"outside {exp['runs_dir']}" if ".." in parts else f"in {exp['runs_dir']} itself"
                     if set(parts) <= {".", ""} else f"in a subfolder of {exp['runs_dir']}")
            raise SinkflowError(f"experiment.name={exp['name']!r} is a path, not a folder name (the run would be "
                                f"made {where})", "use a plain name, e.g. --name moons-long, and "
                                "experiment.runs_dir for where run folders go")
        name = exp["name"] or dist.on_main(lambda: claim_name(
            Path(exp["runs_dir"]).expanduser(), f"{exp['preset']}-{exp['method']}-{time.strftime('%Y%m%d-%H%M%S')}"))
        name = dist.broadcast_object(name)  # rank 0's clock names the folder for every rank
        cfg = absolute_data_paths(cfg, PATH_KEYS)
        run_dir = Path(exp["runs_dir"]).expanduser() / name  # runs_dir: ~/runs made ./~/runs

        def refuse_existing():
            if (run_dir / "config.yaml").exists():  # sinkflow.train (``call``): a notebook continues it by a call
                raise SinkflowError(f"run folder {run_dir} already exists",
                                    f"continue it with sinkflow.resume({str(run_dir.resolve())!r}) or pick another "
                                    "name=" if call else f"resume it with `sinkflow train --resume "
                                    f"{shlex.quote(str(run_dir))}` or pick another experiment.name")
            raise SinkflowError(f"run folder {run_dir} already exists and is not empty, but has no config.yaml "
                                "(a damaged run?); nothing in it was changed",
                                "restore its config.yaml to resume it, or pick another experiment.name")

        def occupied() -> bool:  # anything but a lock file left by a refused start: never write over it
            return run_dir.is_dir() and any(p.name != ".lock" for p in run_dir.iterdir())

        if dist.broadcast_object(occupied()):  # every rank refuses, none waits
            refuse_existing()
        def make():
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SinkflowError(f"cannot create the run folder {run_dir} ({exc.strerror})",
                                    "point experiment.runs_dir at a writable folder") from None
            with run_lock(run_dir):  # two `train --name X` at once: the second stops here (start() re-locks)
                if occupied():
                    refuse_existing()
                write_config(run_dir, cfg)
                meta = {"seed": exp["seed"], "created": time.strftime("%Y-%m-%d %H:%M:%S"), "git": _git_hash(),
                        "versions": _versions(), "argv": sys.argv, "cwd": os.getcwd(),
                        "world_size": dist.current().world, **({"call": call} if call else {})}
                atomic_write_text(run_dir / "meta.json", json.dumps(meta, indent=2))

        dist.on_main(make)  # rank 0 writes; a failure there is every rank's one line
        return cls(run_dir, cfg)

    @classmethod
    def open(cls, run_dir: Path, overrides: list[str] | None = None, shorthands: dict | None = None,
             log_best_effort: bool = False) -> "RunFolder":
        """Re-open a run folder (nothing is written). Overrides of keys frozen by what is already on disk
        are refused (``sinkflow.runtime.identity``); ``start()`` writes the new config once the run starts.
        ``log_best_effort``: as in ``RunFolder()``."""
        cfg = read_config(run_dir)
        named = config_mod.override_keys(overrides or [])
        short = config_mod.apply_shorthands(cfg, shorthands or {})
        new = absolute_data_paths(config_mod.apply_overrides(short, overrides or []),
                                  [k for k in named if k in PATH_KEYS])
        config_mod.validate(new)
        config_mod.check_read(new, named)
        check_frozen(cfg, new, Path(run_dir))
        run = cls(run_dir, new, log_best_effort=log_best_effort)
        run._disk_config = cfg
        disk = config_mod.flatten(cfg)
        shorthand = {k for k, v in config_mod.flatten(short).items() if v != disk.get(k) and k not in named}
        read = schema.used(new)
        for key in shorthand - read.keys():  # `--train-iters` sets every phase's key: the method's phases only
            run.keep_on_disk(key)
        run.shorthand_keys = shorthand & read.keys()
        if new != cfg:
            run._pending_config = new
        return run

    def plan_resume(self, at: tuple, to_train: list[str], phase_keys: dict[str, str]) -> None:
        """Where a resume continues (``(phase, step)``, or ``("done", None)``), the model keys of the training phases
        it still trains, and each training phase's model key: what ``start`` records the resume's changes with, as
        ``experiment.verify`` found them in the folder."""
        self.resume_at, self.to_train, self.phase_keys = at, list(to_train), dict(phase_keys)

    def keep_on_disk(self, key: str) -> None:
        """Set ``key`` back to its value on disk in the config this resume writes (a shorthand's key for a phase that
        has finished: ``--train-iters 60`` reaches the phases still to train)."""
        section, _, rest = key.partition(".")
        node, disk = self.cfg[section], self._disk_config[section]
        *path, leaf = rest.split(".")
        for part in path:
            node, disk = node[part], disk[part]
        node[leaf] = disk[leaf]

    def sampling_changes(self) -> dict:
        """``sample.*`` values of this in-memory config that differ from the config.yaml the run was opened with
        (a `sinkflow eval` / `sample` call's ``sample.key=value``): what an evaluation record says it sampled with."""
        disk = self._disk_config.get("sample", {})
        return {k: v for k, v in self.cfg.get("sample", {}).items() if disk.get(k) != v}

    def changes(self) -> dict[str, tuple]:
        """{key: (value on disk, new value)} for every key a resume's overrides change."""
        if self._pending_config is None:
            return {}
        old, new = config_mod.flatten(self._disk_config), config_mod.flatten(self._pending_config)
        read = schema.used(self._pending_config)  # a shorthand also sets keys of phases this method has not
        return {k: (old.get(k), v) for k, v in sorted(new.items()) if old.get(k) != v and k in read}

    def start(self) -> None:
        """The run really starts: take the folder's lock, write the resumed config and record what it changed
        (meta.json ``changes``: key, old and new value, the phase and step it took effect; a resume on another number
        of processes as key ``world_size``), drop orphaned temp files."""
        def begin():
            check_writable(self.dir)
            lock_run(self.dir)
            changes = self.changes()
            if self._pending_config is not None:
                write_config(self.dir, self._pending_config)
            self._record_changes(changes)
            for path in remove_orphans(self.dir):
                log.info("removed %s (left by a killed write)", path)

        dist.on_main(begin)  # rank 0 writes; a failure there (the lock held elsewhere) is every rank's one line
        self._pending_config = None
        check_shared(self.dir)

    def _record_changes(self, changes: dict[str, tuple]) -> None:
        phase, step = self.resume_at or (None, None)
        entries = []
        for key, (old, new) in changes.items():
            parts = key.split(".")
            key_phase, key_step = phase, step
            if parts[0] == "train" and parts[1] != self._phase_key(phase):
                key_phase, key_step = parts[1], 0  # a later phase's key: from its first step
            entries.append((key, old, new, key_phase, key_step))
        world = self.dist.world
        if self.resume_at is not None and phase != "done" and (last := ran_on(self.dir)) != world:
            entries.append(("world_size", last, world, phase, step, self._world_note(last, world)))
        record_changes(self.dir, entries)

    def record_hand_edits(self, key: str, trained: object, phase: str, step: int) -> None:
        """Record in meta.json the keys of ``train.<key>`` that config.yaml holds at other values than ``trained``
        (the section a step checkpoint was trained with) and that no recorded change explains: config.yaml edited
        by hand between a stop and this resume. The edit applies from ``step``, as an override would, but nothing
        said so: meta.json's ``changes`` (what a run trained with, and from when) missed it. A checkpoint from
        before the section was saved (``trained`` not a dict) is not compared, nor a read-only look (lr-find and
        doctor set a phase's keys in memory)."""
        if self.read_only or not isinstance(trained, dict):
            return
        latest = {}  # each key's last recorded value: a resume's override, an earlier resume's, lr-find --write
        try:
            meta = json.loads((self.dir / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        for change in (meta.get("changes") or []) if isinstance(meta, dict) else []:
            if isinstance(change, dict) and "key" in change:
                latest[change["key"]] = change.get("to")
        now = self.cfg["train"][key]
        edits = [(f"train.{key}.{k}", trained[k], v, phase, step, "edited in config.yaml")
                 for k, v in sorted(now.items()) if k in trained and trained[k] != v
                 and latest.get(f"train.{key}.{k}", trained[k]) != v]
        if edits:
            log.warning("config.yaml was edited since the step-%d checkpoint of %s: %s; the edit%s from this step on "
                        "(recorded in meta.json's changes; `sinkflow train --resume RUN key=value` records it itself)",
                        step, phase, ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new, *_ in edits),
                        " applies" if len(edits) == 1 else "s apply")
            record_changes(self.dir, edits)

    def _world_note(self, old: int, new: int) -> str:
        """What a resume on ``new`` processes instead of ``old`` changes: each phase still to train's global batch
        (``batch_size`` is per process) and base learning rate (its ``lr_scaling`` rule, docs/performance.md)."""
        said = []
        for key in self.to_train:
            was, now = self._disk_config["train"][key], self.cfg["train"][key]
            said.append(f"train.{key}: global batch {was['batch_size'] * old} -> {now['batch_size'] * new}, base lr "
                        f"{was['lr'] * dist.lr_scale(was['lr_scaling'], old):.4g} -> "
                        f"{now['lr'] * dist.lr_scale(now['lr_scaling'], new):.4g} (lr_scaling {now['lr_scaling']})")
        return "; ".join(said)

    def _phase_key(self, phase: str | None) -> str | None:
        return self.phase_keys.get(phase, phase)

    # ---- phases --------------------------------------------------------------------------------
    def checkpoints(self, phase: str) -> PhaseCheckpoints:
        return PhaseCheckpoints(self.dir / "checkpoints" / phase, keep=self.cfg["checkpoint"]["keep"],
                                identity=identity(self.cfg, phase))

    def phase_done(self, phase: str, check=None) -> bool:
        """A phase is finished when its final.pt exists, loads, and belongs to this run (else: an error).
        ``check(state, where)`` also checks its content (``experiment.verify``), in the same single load."""
        path = self.checkpoints(phase).final_path
        if not path.is_file():
            return False
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in self._checked_finals or check is not None:
            state = self.checkpoints(phase).final()
            if check is not None:
                check(state, str(path))
            self._checked_finals.add(key)
        return True

    def final_state(self, phase: str) -> dict:
        path = self.checkpoints(phase).final_path
        if not path.is_file():
            raise SinkflowError(f"phase '{phase}' of {self.dir} has not finished", finish_fix(self.dir))
        return self.checkpoints(phase).final()

    def require_trained(self) -> None:
        """Refuse, before any work, a run whose networks are not all trained (a phase with a model section and no
        final.pt): `eval` and `tune` trained the FD-CNN classifier and scored the held-out reference (minutes on
        MNIST, Inception features on CIFAR-10) before their first sample met "has not finished"."""
        for phase in schema.METHOD_REGISTRY[self.cfg["experiment"]["method"]].phases:
            if phase in self.cfg.get("model", {}) and not self.checkpoints(phase).final_path.is_file():
                raise SinkflowError(f"phase '{phase}' of {self.dir} has not finished", finish_fix(self.dir))

    def model(self, phase: str) -> torch.nn.Module:
        """The frozen, eval-mode model a finished phase produced (its EMA weights when it kept one)."""
        if phase not in self._models:
            state = self.final_state(phase)
            model = build_phase_model(self.cfg, phase, sample_shape(self.cfg))
            where = str(self.checkpoints(phase).final_path)
            check_final(state, model, where)
            use_ema = state.get("ema") is not None
            load_model_state(model, state["ema"] if use_ema else state["model"], where, "ema" if use_ema else "model")
            model.to(self.device).eval().requires_grad_(False)
            self._models[phase] = model
        return self._models[phase]

    @property
    def loaded_models(self) -> dict[str, torch.nn.Module]:
        """The finished phases' networks loaded so far (by ``model``), by phase: what a later phase holds frozen."""
        return dict(self._models)

    def variant(self, sample: dict | None = None, eval: dict | None = None,
                models: dict[str, torch.nn.Module] | None = None) -> "RunFolder":
        """This run with other ``sample.*`` / ``eval.*`` values, or some finished phases' networks replaced by
        ``models``, in memory: a second view of the same folder, device and logger that shares the networks already
        loaded (nothing is reloaded or written, config.yaml is untouched). How many samplers are scored without
        setting another object's config and putting it back (``sinkflow tune``); keys that shape a network stay."""
        view = copy.copy(self)
        view.cfg = {**self.cfg, "sample": {**self.cfg["sample"], **(sample or {})},
                    "eval": {**self.cfg["eval"], **(eval or {})}}
        if models:  # the view's own table: a swapped network never leaks into this run's
            view._models = {**self._models, **models}
        return view

    def release(self) -> None:
        """Free what a finished phase held before the next one starts: its trainer's reference cycles (collected),
        the cuBLAS / cuBLASLt workspaces of the streams it ran on (``free_blas_workspaces``), then the cached blocks.
        Called between phases, after the finished phase's step graph was released (``Trainer.fit``)."""
        gc.collect()
        if self.device.type == "cuda":
            free_blas_workspaces()
            torch.cuda.empty_cache()


def free_blas_workspaces() -> None:
    """Drop the cuBLAS and cuBLASLt workspaces torch keeps for every (handle, stream) that ran a matrix product.

    Why: they come from the caching allocator (``memory_allocated`` counts them), 32 MiB each on a Hopper card, and
    torch never frees them; every phase runs on streams of its own (its step graph's warm-up and capture stream, its
    prefetch workers'), so each finished phase left about 64 MiB allocated for good, and a later phase started on
    top of them (``benchmarks/memory_estimate.py`` on an H200, 2026-11-30: the nsf row 130 MiB above the velocity
    row of the same network, the time row 312 MiB above, as 2 and 5 earlier streams' 64 MiB would be; read from
    torch's CublasHandlePool.cpp, not yet measured with this release). torch allocates a stream's
    workspace again at its next product. Safe between phases only: a CUDA graph captured with a dropped workspace
    and replayed afterwards would write into freed memory, and a finished phase's step graph is released
    (``StepGraph.release``) before ``RunFolder.release`` runs; inductor's CUDA-graph trees clear the same maps around
    their own recordings."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # torch's own (its CUDA-graph trees call it)
    if clear is not None:
        clear()


def check_shared(run_dir: Path) -> None:
    """Under torchrun, every rank sees the run folder rank 0 writes, or every rank stops in one line: on nodes with
    their own disks the other ranks read a pool, checkpoints and config.yaml that were never there (node 1 said the
    pool was damaged and to delete it: on node 0 that deleted a good one) or a stale copy (a resume from two steps
    at once, which hung). Rank 0 writes a file of a fresh token; each rank reads it back."""
    import uuid

    info = dist.current()
    if not info.enabled:
        return
    token = dist.broadcast_object(uuid.uuid4().hex)  # rank 0's
    probe = Path(run_dir) / f".shared-{token}"
    dist.on_main(lambda: atomic_write_text(probe, token))
    try:
        seen = probe.is_file() and probe.read_text() == token
    except OSError:
        seen = False
    every = dist.all_gather_object((seen, socket.gethostname()))
    dist.on_main(lambda: probe.unlink(missing_ok=True))
    blind = [f"rank {rank} on {host}" for rank, (ok, host) in enumerate(every) if not ok]
    if blind:
        raise SinkflowError(f"{', '.join(blind[:4])}{', ...' if len(blind) > 4 else ''} cannot see the run folder "
                            f"{run_dir} that rank 0 writes (nodes with their own disks, or a copy of the run on each)",
                            "put experiment.runs_dir on a filesystem every node mounts at the same path (NFS, Lustre, "
                            "a shared volume) and start every node there; nothing was trained", every_rank=True)


def ran_on(run_dir: Path) -> int:
    """The number of processes the run last trained on: meta.json's last ``world_size`` change, else the
    ``world_size`` it was created with (1 in a meta.json from before it was recorded)."""
    try:
        meta = json.loads((Path(run_dir) / "meta.json").read_text())
    except (OSError, ValueError):
        return 1
    if not isinstance(meta, dict):
        return 1
    changed = [c.get("to") for c in meta.get("changes") or [] if isinstance(c, dict) and c.get("key") == "world_size"]
    last = changed[-1] if changed else meta.get("world_size", 1)
    return last if isinstance(last, int) and not isinstance(last, bool) and last >= 1 else 1


def record_changes(run_dir: Path, entries: list[tuple]) -> None:
    """Append ``(key, old, new, phase, step[, note])`` entries to RUN/meta.json's ``changes`` (a resume's overrides, a
    rate `sinkflow lr-find --write` set, a resume on another number of processes), each logged in one line with its
    note (what it implies): config.yaml holds the newest value, meta.json when it took effect."""
    if not entries:
        return
    path = Path(run_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        meta = {}
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict):  # damaged (cut short, overwritten): kept aside, never written over
        aside = path.with_name("meta.damaged.json")
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"meta.damaged.{n}.json")
        os.replace(path, aside)
        log.warning("%s was damaged (not a JSON object): kept as %s, and a new meta.json records the changes from "
                    "here; the seed, versions and command line it held are readable in that copy", path, aside.name)
        meta = {}
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    for key, old, new, phase, step, *note in entries:
        meta.setdefault("changes", []).append({"key": key, "from": old, "to": new, "phase": phase, "step": step,
                                               "time": when, **({"note": note[0]} if note and note[0] else {})})
        log.info("%s %r -> %r from phase %s %s%s", key, old, new, phase, _position(phase, step),
                 f": {note[0]}" if note and note[0] else "")
    atomic_write_text(path, json.dumps(meta, indent=2, default=str))


def _position(phase: str | None, step) -> str:
    """Where a change took effect, in its phase's unit: a resumed pool's ``step`` counts its built chunks (the unit
    of resume), and "world_size 2 -> 1 from phase pool step 1" read as a training step of a pool that builds batches
    (its stop line had said "after 2/4 batches"). meta.json keeps the number as ``step``."""
    if phase != "pool":
        return f"step {step}"
    return f"after {step} built chunk(s)" if step else "before its first chunk"


# What a run folder holds of its own state (the layout above, plus the records a run writes beside it). NSGF++'s
# nsf_states.npy (``nsgfpp.STATES_FILE``, nsgf.nsf_source=velocity) is read again by a resumed straight-flow or
# predictor phase, lr-find and doctor: `sample --out RUN/nsf_states.npy` replaced it with 5 samples of another shape
RUN_STATE = ("config.yaml", "meta.json", "meta.damaged.json", "checkpoints", "pool", "metrics.jsonl",
             "metrics.rewound.jsonl", "tb", "status.json", "data_split.json", ".lock", "nsf_states.npy")


def run_state_entry(run_dir: Path, path: Path) -> str | None:
    """The entry of ``RUN_STATE`` that ``path`` is or lies in, or None: `sample --out RUN/pool/x.npy` replaced the
    pool, and the resume after it failed on an array of another shape."""
    try:
        rel = Path(path).resolve().relative_to(Path(run_dir).resolve())
    except ValueError:
        return None
    return rel.parts[0] if rel.parts and rel.parts[0] in RUN_STATE else None


DATA_PATH_KEYS = ("data.path", "data.root", "data.source", "data.target")
# every path a run's config.yaml holds absolute: the data's, and the FID weights (eval from another folder found none)
PATH_KEYS = (*DATA_PATH_KEYS, "eval.inception_weights")


def claim_name(runs_dir: Path, base: str) -> str:
    """``base``, or the first of ``base-2``, ``base-3``, ... that names no folder in ``runs_dir`` yet, claimed by
    creating its folder (``mkdir`` fails for all but one of many processes): an automatic name's clock counts
    seconds, and a notebook's loop of short runs (a seed sweep) stopped at its second run with "run folder ... already
    exists; resume it", a folder the user never named; the jobs of an array started in the same second so too."""
    name, n = base, 1
    while True:
        try:
            (runs_dir / name).mkdir(parents=True)
            return name
        except FileExistsError:
            n += 1
            name = f"{base}-{n}"
        except OSError as exc:
            raise SinkflowError(f"cannot create the run folder {runs_dir / name} ({exc.strerror})",
                                "point experiment.runs_dir at a writable folder") from None


def absolute_data_paths(cfg: dict, keys) -> dict:
    """``cfg`` with the data paths among ``keys`` made absolute (``~`` expanded): an image folder, the data root, a
    point file named as source or target (a 2D or image set name stays a name). A run folder's config.yaml then
    means the same data from any working directory: `sinkflow eval/sample/train --resume` run from elsewhere found
    no `imgs/cif` and refused every override that could point them at it."""
    from sinkflow.data.points import POINT_SUFFIXES

    out = None
    for key in keys:
        section, name = key.split(".")
        value = cfg[section].get(name)
        if not isinstance(value, str) or not value:
            continue
        if name in ("source", "target") and not value.lower().endswith(POINT_SUFFIXES):
            continue
        absolute = os.path.abspath(os.path.expanduser(value))
        if absolute != value:
            out = out or {**cfg, section: dict(cfg[section])}
            out[section][name] = absolute
    return out or cfg


def check_writable(run_dir: Path) -> None:
    """Every folder of a run that training writes into takes a new file, or a one-line error before anything is
    written: a read-only checkpoints folder would otherwise fail at the phase's first checkpoint, after the work
    it was to keep (minutes to hours of it). A probe file is created and removed in the run folder and in every
    existing folder under ``checkpoints/`` and ``tb/`` (a finished pool is only read: it may stay read-only)."""
    run_dir = Path(run_dir)
    below = [p for sub in ("checkpoints", "tb") for p in [run_dir / sub, *(run_dir / sub).rglob("*")] if p.is_dir()]
    for folder in [run_dir, *sorted(below)]:
        if (why := write_refused(folder)) is not None:
            raise SinkflowError(f"cannot write into {folder} ({why}); nothing in the run was changed",
                                "make the run folder writable again (chmod -R u+w, a read-write mount), or copy it "
                                "to a writable disk and resume the copy")


def write_config(run_dir: Path, cfg: dict) -> None:
    """RUN/config.yaml, atomically, marked so that a copy cut short is refused (``config.dump_run_config``)."""
    atomic_write_text(Path(run_dir) / "config.yaml", config_mod.dump_run_config(cfg))


def read_config(run_dir: Path) -> dict:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        if (Path(run_dir) / "meta.json").is_file() or (Path(run_dir) / "checkpoints").is_dir():
            raise config_mod.lost_run_config(run_dir)
        if Path(run_dir).name == "config.yaml" and Path(run_dir).is_file():  # the run's file, not its folder
            raise SinkflowError(f"{run_dir} is a run's config file, not its folder",
                                f"pass the folder: {shlex.quote(str(Path(run_dir).parent))}")
        elsewhere = (" (under torchrun on several nodes: every node must see the run folder, on a filesystem they "
                     "all mount at the same path)" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "")
        raise SinkflowError(f"{run_dir} is not a sinkflow run folder (no config.yaml)",
                            f"pass the folder `sinkflow train` printed when it started{elsewhere}")
    # keys added to sinkflow after the run was made get their defaults; a bad value is named with its line
    return config_mod.read_run_file(path)


def build_phase_model(cfg: dict, key: str, shape: tuple[int, ...]) -> torch.nn.Module:
    """The (untrained) network ``model.<key>`` for samples of ``shape``. A kind names its keys ``model.<name>``
    (it does not know which phase's section it builds): its errors here name ``model.<key>.<name>``, the key a
    user sets."""
    from sinkflow.models import build_model

    model_cfg = dict(cfg["model"][key])
    try:
        return build_model(model_cfg.pop("kind"), model_cfg, tuple(shape))
    except SinkflowError as exc:
        section = re.compile(rf"\bmodel\.(?!{re.escape(key)}\.)")
        raise SinkflowError(*(section.sub(f"model.{key}.", m) if m else m for m in (exc.problem, exc.fix)),
                            every_rank=exc.every_rank) from None


def load_model_state(model: torch.nn.Module, state: dict, where: str, what: str = "model") -> None:
    """``load_state_dict`` after checking every entry (names, tensors, dtypes, shapes): one line naming the
    first bad one (``sinkflow.runtime.state_check``), never a traceback or a silent int64/bool cast."""
    check_weights(state, model.state_dict(), where, what)
    model.load_state_dict(state)
