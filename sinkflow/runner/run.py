"""A run folder: the resolved config, provenance, checkpoints, logs, and the phases' outputs.

Layout::

    RUN/config.yaml        resolved config tree (what `--resume` re-reads)
    RUN/meta.json          seed, package versions, git hash, command line
    RUN/checkpoints/PHASE/step_XXXXXXXX.pt, final.pt
    RUN/pool/              the NSGF trajectory pool (numpy .npy, memmap-able)
    RUN/metrics.jsonl, RUN/tb/, RUN/status.json
"""

from __future__ import annotations

import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from sinkflow import config as config_mod
from sinkflow.errors import SinkflowError
from sinkflow.runner import dist
from sinkflow.runner.checkpoint import PhaseCheckpoints, load
from sinkflow.runner.metrics import MetricsLogger

# Keys whose change makes old checkpoints or the pool meaningless: refused on resume.
SHAPE_KEYS = ("model.", "data.source", "data.target", "data.image_size", "data.channels", "experiment.method",
              "pool.batch_size", "pool.steps", "pool.batches")
# ... except these, which change how a model is computed, not what its checkpoint holds.
RESUME_SAFE = ("model.flow.memory", "model.flow.drift_tol", "model.flow.checkpoint_segments")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SinkflowError(f"experiment.device={name} but CUDA is not available here", "use --device cpu or auto")
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


class Run:
    """Everything a phase needs: config, device, folder, logger, checkpoints, finished phases' models."""

    def __init__(self, run_dir: Path, cfg: dict):
        self.dir = Path(run_dir)
        self.cfg = cfg
        self.dist = dist.current()
        self.device = dist.device_for(self.dist, resolve_device(cfg["experiment"]["device"]))
        self.logger = MetricsLogger(self.dir, enabled=self.dist.is_main)
        self._models: dict[str, torch.nn.Module] = {}

    # ---- creation and resume -------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: dict) -> "Run":
        exp = cfg["experiment"]
        name = exp["name"] or f"{exp['preset']}-{exp['method']}-{time.strftime('%Y%m%d-%H%M%S')}"
        name = dist.broadcast_object(name)  # rank 0's clock names the folder for every rank
        run_dir = Path(exp["runs_dir"]) / name
        if dist.broadcast_object((run_dir / "config.yaml").exists()):  # every rank refuses, none waits
            raise SinkflowError(f"run folder {run_dir} already exists",
                                f"resume it with `sinkflow train --resume {run_dir}` or pick another experiment.name")
        if dist.current().is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(config_mod.dump(cfg))
            meta = {"seed": exp["seed"], "created": time.strftime("%Y-%m-%d %H:%M:%S"), "git": _git_hash(),
                    "versions": _versions(), "argv": sys.argv, "world_size": dist.current().world}
            (run_dir / "meta.json").write_text(json.dumps(meta, indent=2))
        dist.barrier()
        return cls(run_dir, cfg)

    @classmethod
    def open(cls, run_dir: Path, overrides: list[str] | None = None, shorthands: dict | None = None) -> "Run":
        """Re-open a run folder, applying overrides that do not change any shape."""
        cfg = read_config(run_dir)
        new = config_mod.apply_overrides(config_mod.apply_shorthands(cfg, shorthands or {}), overrides or [])
        config_mod.validate(new)
        old_flat, new_flat = config_mod.flatten(cfg), config_mod.flatten(new)
        changed = [k for k in new_flat if new_flat[k] != old_flat.get(k) and k.startswith(SHAPE_KEYS)
                   and k not in RESUME_SAFE]
        if changed:
            k = changed[0]
            raise SinkflowError(
                f"cannot resume {run_dir} with {k}={new_flat[k]!r}: the run was trained with {k}={old_flat.get(k)!r}",
                "drop that override to resume, or start a new run",
            )
        if new != cfg and dist.current().is_main:
            (Path(run_dir) / "config.yaml").write_text(config_mod.dump(new))
        return cls(run_dir, new)

    # ---- phases --------------------------------------------------------------------------------
    def checkpoints(self, phase: str) -> PhaseCheckpoints:
        return PhaseCheckpoints(self.dir / "checkpoints" / phase, keep=self.cfg["checkpoint"]["keep"])

    def phase_done(self, phase: str) -> bool:
        return self.checkpoints(phase).final_path.is_file()

    def final_state(self, phase: str) -> dict:
        path = self.checkpoints(phase).final_path
        if not path.is_file():
            raise SinkflowError(f"phase '{phase}' of {self.dir} has not finished",
                                f"finish it with `sinkflow train --resume {self.dir}`")
        return load(path)

    def model(self, phase: str) -> torch.nn.Module:
        """The frozen, eval-mode model a finished phase produced (its EMA weights when it kept one)."""
        if phase not in self._models:
            from sinkflow.runner.phase import build_phase_model

            state = self.final_state(phase)
            model = build_phase_model(self, phase)
            weights = state.get("ema") or state["model"]
            load_model_state(model, weights, f"{self.checkpoints(phase).final_path}")
            model.to(self.device).eval().requires_grad_(False)
            self._models[phase] = model
        return self._models[phase]

    def release(self) -> None:
        """Free what a finished phase held before the next one starts."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def read_config(run_dir: Path) -> dict:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise SinkflowError(f"{run_dir} is not a sinkflow run folder (no config.yaml)",
                            "pass the folder `sinkflow train` printed when it started")
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        raise SinkflowError(f"{path} is not valid YAML", "restore it from the run's first lines of output") from None
    base = config_mod.load_preset(cfg.get("experiment", {}).get("preset") or "_base")
    unknown = set(config_mod.flatten(cfg)) - set(config_mod.flatten(base))
    if unknown:
        raise SinkflowError(f"{path} has unknown key '{sorted(unknown)[0]}'", "remove it or start a new run")
    return config_mod.merge(base, cfg)  # keys added to sinkflow after the run was made get their defaults


def load_model_state(model: torch.nn.Module, state: dict, where: str) -> None:
    """``load_state_dict`` whose shape mismatch is a one-line error naming the first bad tensor."""
    own = model.state_dict()
    for key, value in state.items():
        if key in own and own[key].shape != value.shape:
            raise SinkflowError(
                f"checkpoint {where} holds {key} of shape {tuple(value.shape)} but the configured model needs "
                f"{tuple(own[key].shape)}", "resume with the model config the run was trained with")
    missing = set(own) - set(state)
    extra = set(state) - set(own)
    if missing or extra:
        key = sorted(missing or extra)[0]
        raise SinkflowError(f"checkpoint {where} does not match the configured model ({'missing' if missing else 'unexpected'} {key})",
                            "resume with the model config the run was trained with")
    model.load_state_dict(state)
