"""A CUDA out-of-memory error at run time, as one line: where, the planner's estimate, the fix.

The planner (``sinkflow preflight --fit``) sizes a run before it starts; at run time another process on
the card, fragmentation or a larger evaluation batch can still exhaust it. Every command's OOM reaches
``sinkflow.cli.main``, which prints ``oom_line``: the phase and step (the Trainer attaches them to the
exception), the planner's estimate for that phase beside the card's memory, the checkpoint a resume
continues from, and the change that fits.

Why a stop and not Composer-style automatic micro-batch halving: a halved micro-batch with doubled
``accum`` changes the summation order of every later step, so the run would no longer match its
``config.yaml`` nor resume bit for bit; and an OOM caused by another process on the card comes back at the
next allocation anyway. The stop keeps the last checkpoint, and the fix is one override on resume
(``train.*`` keys may change on resume; the change is recorded in ``meta.json``).
"""

from __future__ import annotations

import shlex
from pathlib import Path


def _estimate(run_dir: str | None, phase: str, training: bool) -> str:
    """"the planner estimates X for this phase on a card of Y" (or why there is no estimate)."""
    if not run_dir:
        return "no planner estimate (no run folder)"
    try:
        import torch

        from sinkflow.runtime.autocast import bf16_tensor_cores
        from sinkflow.runtime.run_folder import read_config
        from sinkflow.tools import memory_plan

        cfg = read_config(Path(run_dir))
        mems = memory_plan.estimate(cfg, bf16=torch.cuda.is_available() and bf16_tensor_cores(torch.device("cuda")))
        pm = next((m for m in mems if m.phase == phase), None) or next(m for m in mems if m.kind == "sample")
        card = ""
        if torch.cuda.is_available():
            card = f" of the card's {memory_plan.fmt_bytes(torch.cuda.get_device_properties(0).total_memory)}"
        return f"the planner estimates {memory_plan.fmt_bytes(pm.total)} for {pm.phase}{card}"
    except Exception as exc:  # the estimate is advice: its own failure must not hide the OOM line
        return f"no planner estimate ({type(exc).__name__})"


def oom_line(exc: BaseException, command: str, run_dir: str | None, preset: str | None = None,
             resume: str | None = None) -> str:
    """The one line; ``resume``: the command that continues the run as it was launched (the CLI's
    ``resume_as_launched``: torchrun with its process count, ``--no-report``), else a plain ``sinkflow train``."""
    where = getattr(exc, "sinkflow_where", None) or {}
    phase = where.get("phase") or command
    training = bool(where.get("training"))
    at = f" at step {where['step']}" if where.get("step") is not None and where.get("phase") else ""
    estimate = _estimate(run_dir, phase, training)
    preflight = f"`sinkflow preflight {preset or 'PRESET'} --gpu-mem GiB --fit`"
    if training:
        key = f"train.{phase}"
        # accum splits batch_size into micro-batches (Trainer._update): doubling it halves what is on the card
        # at once and keeps the batch; halving batch_size as well would halve the batch the run trains on
        fix = (f"resume with double {key}.accum ({key}.batch_size stays the batch; each micro-batch halves), "
               f"or run {preflight} for settings that fit")
    elif phase == "pool":
        fix = f"resume with pool.in_flight=1, or run {preflight} (smaller Sinkhorn batch, more pool batches)"
    else:
        fix = "lower sample.batch_size (samples per network call), e.g. sample.batch_size=100"
    kept = where.get("kept") or ("the finished pool chunks are kept" if phase == "pool" else "")
    kept = f"; {kept}" if kept else ""
    resume = resume or f"sinkflow train --resume {shlex.quote(str(run_dir))}"
    resume = f" (`{resume}`)" if where.get("phase") and run_dir else ""
    return f"CUDA out of memory in {phase}{at} ({estimate}){kept}; {fix}{resume}"
