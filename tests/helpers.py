"""Shared tiny-budget settings: real shapes, minimal iteration counts."""

import os
import subprocess
import sys
from pathlib import Path

TINY_2D = ["pool.batches=2", "pool.steps=4", "pool.batch_size=32", "pool.chunk=1", "--train-iters", "6",
           "train.velocity.ckpt_every=3", "train.velocity.log_every=2", "eval.n=64", "eval.seeds=2",
           "eval.steps=[2, 4]", "--device", "cpu"]


def tiny_2d(method: str) -> list[str]:
    """TINY_2D without the overrides ``method`` does not read (FM / OT-CFM: no pool): setting a key the run
    does not read is an error (sinkflow.config.check_read)."""
    from sinkflow import config
    from sinkflow.config import schema

    used = schema.used(config.resolve("moons", [], {"method": method}))
    return [o for o in TINY_2D if "=" not in o or o.partition("=")[0] in used]


def cli(*args, cwd, timeout=300, env=None):
    """Run `python -m sinkflow ...` in a subprocess (for kills and exit codes)."""
    full_env = {**os.environ, "SINKFLOW_PROGRESS": "0", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "sinkflow", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def error_line(rc: int, err: str, *needles: str, alone: bool = False) -> str:
    """The one ``sinkflow: error:`` line of a refused command: exit 2, no traceback, every needle in that line.
    Progress logs may precede it; ``alone``: nothing else on stderr."""
    assert rc == 2, err
    lines = [line for line in err.splitlines() if (line.strip() if alone else "error" in line.lower())]
    assert len(lines) == 1 and lines[0].startswith("sinkflow: error: "), err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run_main(capsys, *argv) -> tuple[int, str]:
    """``sinkflow.cli.main(argv)`` in this process: (exit code, stderr). argparse's own errors exit through
    SystemExit (one line, by sinkflow.cli.Parser): their code is returned the same way."""
    from sinkflow.cli import main

    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def snapshot(folder: Path) -> dict:
    """Every saved file under a run folder with its size and mtime: to prove nothing was overwritten.
    status.json is left out: it is the heartbeat, rewritten by every attempt (that is its job)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name != "status.json"}


def bytes_snapshot(folder: Path) -> dict:
    """Every file and folder under a run folder with its bytes (status.json and .lock included): a refused
    command must leave the run folder byte-identical."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else "dir")
            for p in sorted(Path(folder).rglob("*"))}


def mnist_t10k_dir() -> Path | None:
    """The real MNIST t10k files (official IDX .gz): $SINKFLOW_MNIST_DIR, else a ``shared/data/mnist-t10k``
    folder above this checkout (the main checkout and every worktree sit beside ``shared``), else None (a
    user's checkout: the real-data tests skip)."""
    env = os.environ.get("SINKFLOW_MNIST_DIR")
    candidates = [Path(env)] if env else [p / "shared" / "data" / "mnist-t10k" for p in Path(__file__).resolve().parents]
    for cand in candidates:
        if (cand / "t10k-images-idx3-ubyte.gz").is_file() and (cand / "t10k-labels-idx1-ubyte.gz").is_file():
            return cand
    return None


def link_t10k(root: Path) -> Path:
    """``root/MNIST/raw`` with links to the real t10k .gz files (the t10k-only layout); returns root."""
    src = mnist_t10k_dir()
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (raw / name).symlink_to(src / name)
    return root


def nan_gradient_phase(cfg, bad_call, ot_pairs=False, poison="gradient", persist=False):
    """A velocity phase poisoned on call ``bad_call`` (``persist``: and every later call): ``poison="gradient"``
    keeps the loss finite but makes its gradients NaN (sqrt at 0: value 0, gradient inf * 0 = NaN);
    ``poison="loss"`` makes the loss itself NaN; ``poison="nan_term"`` adds a NaN without parameters: the loss is NaN,
    its gradients finite."""
    import torch

    from sinkflow import methods
    from sinkflow.methods.flow_matching import InterpolantStep, velocity_loss

    source, target = methods.distributions(cfg)
    calls = []

    class Poisoned(InterpolantStep):
        def loss(self, model, batch):
            calls.append(1)
            value = velocity_loss(model, batch)
            if len(calls) == bad_call or (persist and len(calls) > bad_call):
                if poison == "loss":
                    return value * float("nan")
                if poison == "nan_term":
                    return value + torch.tensor(float("nan"), device=value.device)
                value = value + torch.sqrt(0.0 * sum(p.sum() for p in model.parameters()))
            return value

    return Poisoned("velocity", source, target, ot_pairs=ot_pairs)


def read_only(path: Path, recursive: bool = False):
    """Make ``path`` (and with ``recursive`` everything below it) refuse writes for real, even for root: chmod for a
    plain user, the immutable attribute (``chattr +i``) for root where the filesystem and capabilities allow it.
    Returns the function that undoes it, or None where neither works (the caller skips or simulates)."""
    paths = [path, *Path(path).rglob("*")] if recursive else [path]
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in paths}
        for p in reversed(paths):  # children before their folder
            p.chmod(0o555 if p.is_dir() else 0o444)
        return lambda: [p.chmod(m) for p, m in modes.items()]
    flag = ["-R"] if recursive else []
    if subprocess.run(["chattr", *flag, "+i", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["chattr", *flag, "-i", str(path)], capture_output=True)
        return None
    return lambda: subprocess.run(["chattr", *flag, "-i", str(path)], check=True)


def train_in(cwd: Path, *runs: list) -> Path:
    """Train each argv of ``runs`` (`sinkflow train` arguments) in-process with ``cwd`` as the working directory
    (module- and session-scoped fixtures cannot use monkeypatch.chdir); returns ``cwd / "runs"``."""
    from sinkflow.cli import main

    old = os.getcwd()
    os.chdir(cwd)
    try:
        for argv in runs:
            assert main(["train", *argv]) == 0, argv
    finally:
        os.chdir(old)
    return Path(cwd) / "runs"


def plant_compile_failure(monkeypatch) -> None:
    """A machine that cannot compile (no Triton for the card, no C compiler), on this CPU: ``torch.compile`` returns
    a module whose first call raises dynamo's error, and ``compile: auto`` is made to resolve to compile here."""
    import torch
    from torch._dynamo.exc import TorchDynamoException

    from sinkflow.engine import fast_path

    class CannotCompile(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args):
            raise TorchDynamoException("backend='inductor' raised: no working C compiler")

    monkeypatch.setattr(torch, "compile", lambda module, **kw: CannotCompile(module))
    real = fast_path.resolve
    monkeypatch.setattr(fast_path, "resolve", lambda tcfg, *a, **k: {**real(tcfg, *a, **k), "compile": True}
                        if tcfg["compile"] == "auto" else real(tcfg, *a, **k))


def plant_capture_failure(monkeypatch) -> None:
    """A network whose training step a CUDA graph cannot hold, on this CPU: ``graph: auto`` is made to resolve to the
    step graph here, and the step graph's first step after its warm-up (where a card captures) fails as a capture
    does: the step runs up to the optimizer (the scaler has unscaled the gradients), whose call raises CUDA's capture
    error, and no update is applied."""
    from sinkflow.engine import fast_path
    from sinkflow.engine.step_graph import WARMUP, CaptureFailed, StepGraph

    real_call, real_resolve = StepGraph.__call__, fast_path.resolve

    def capturing(self, batch, step):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls != WARMUP + 1:
            return real_call(self, batch, step)

        def not_permitted(*args, **kwargs):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        self.optimizer.step = not_permitted
        try:
            real_call(self, batch, step)
        except RuntimeError as exc:
            raise CaptureFailed.of(self.phase, exc) from exc  # the line StepGraph._capture raises
        finally:
            del self.optimizer.step

    monkeypatch.setattr(StepGraph, "__call__", capturing)
    monkeypatch.setattr(fast_path, "resolve", lambda tcfg, *a, **k: {**real_resolve(tcfg, *a, **k), "graph": "step"}
                        if tcfg.get("graph") == "auto" else real_resolve(tcfg, *a, **k))
