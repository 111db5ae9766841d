"""Preflight: everything that can be known on a CPU before a GPU is rented.

For one preset (plus the user's overrides and shorthands) it

1. checks that every shorthand and override reaches the phases it names (the resolved section each
   phase reads is compared with what the flags asked for; an override of a section no phase reads
   is an error),
2. runs every phase of the method with tiny counts but the real data shapes and model config, on CPU,
   in a temporary run folder: each phase is stopped once after its first step / chunk (the real
   SIGTERM path, requested by a callback: checkpoint, ``Interrupted``), resumed by a fresh Trainer, and the resumed state
   (step, weights, optimizer moments, generator) is compared with the state the interrupted phase held,
3. samples and evaluates the tiny run through the real report code,
4. estimates the peak GPU memory of every phase for the *real* config (``sinkflow.tools.memory_plan``) and,
   for a named card, proposes (and with ``fit`` applies) the change that makes it fit.

The tiny sizes are applied through the shorthands themselves (``--train-iters`` ...), so a shorthand
that misses a phase shows up as that phase starting with its real iteration count (caught at setup,
before it can hang for hours).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shlex
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sinkflow import config as config_mod
from sinkflow import data, methods
from sinkflow.config import schema
from sinkflow.engine.experiment import check_machine, check_run
from sinkflow.errors import SinkflowError
from sinkflow.runtime import callbacks
from sinkflow.runtime.callbacks import Callback
from sinkflow.runtime.scratch import scratch_dir
from sinkflow.tools.phases import quiet_cut

log = logging.getLogger("sinkflow")

TINY_ITERS = 3
TINY_POOL_BATCHES = 2
TINY_SINKHORN_BATCH = 8
TINY_EVAL_N = 16


@dataclass
class Check:
    name: str
    phase: str
    ok: bool | None  # None = skipped
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    preset: str
    checks: list[Check] = field(default_factory=list)
    memory: list = field(default_factory=list)
    data_note: str | None = None
    fit_overrides: list[str] = field(default_factory=list)
    fit_reasons: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def add(self, name, phase, ok, detail="", seconds=0.0) -> Check:
        c = Check(name, phase, ok, detail, seconds)
        self.checks.append(c)
        return c


class _Unreached(Exception):
    """A phase started with a value its flags should have changed."""


# ---- config: tiny sizes and reach checks -------------------------------------------------------

def _train_sections(tree: dict) -> list[str]:
    return list(tree.get("train", {}))


def tiny_shorthands(real: dict) -> dict:
    accum = max([real["train"][k]["accum"] for k in _train_sections(real)] or [1])
    return {"train_iters": TINY_ITERS, "batch_size": 4 * accum, "pool_batches": TINY_POOL_BATCHES,
            "sinkhorn_batch": TINY_SINKHORN_BATCH, "device": "cpu"}


def tiny_overrides(real: dict, runs_dir: Path, name: str) -> list[str]:
    flat = config_mod.flatten(real)
    out = [f"experiment.runs_dir={runs_dir}", f"experiment.name={name}"]
    want = {"pool.chunk": 1, "pool.in_flight": 1, "pool.steps": min(real["pool"]["steps"], 3), "checkpoint.keep": 2,
            "eval.n": TINY_EVAL_N, "eval.class_n": TINY_EVAL_N, "eval.seeds": 1, "eval.steps": "[2]",
            "sample.steps": 2, "sample.nsf_steps": 2, "pool.storage": real["pool"]["storage"]}
    for sec in _train_sections(real):
        want.update({f"train.{sec}.log_every": 1, f"train.{sec}.ckpt_every": 1000, f"train.{sec}.hist_every": 2})
        want.update(o.split("=", 1) for o in quiet_cut(real, sec, TINY_ITERS))  # no warnings about the cut
    for key, value in want.items():
        if key in flat:
            out.append(f"{key}={value}")
    return out


def tiny_config(real: dict, runs_dir: Path, name: str) -> tuple[dict, dict]:
    """(tiny tree, the shorthand values it was built with): the real tree, shrunk through the shorthands."""
    sh = tiny_shorthands(real)
    tree = config_mod.apply_shorthands(real, sh)
    tree = config_mod.apply_overrides(tree, tiny_overrides(real, runs_dir, name))
    config_mod.validate(tree)
    return tree, sh


def machine_check(report: Report, real: dict, shape: tuple[int, ...]) -> None:
    """What ``sinkflow train`` would refuse on this machine (``experiment.check_machine``: a pool larger than the free
    disk, FID's weights file or packages missing), as its own check that does not stop the rest: planning on a laptop
    for a rented GPU, the laptop's disk is not the run's."""
    try:
        check_machine(real, shape)
    except SinkflowError as exc:
        report.add("this machine", "config", False, f"{_short(exc)} (train here would refuse it; preflight on the "
                   "machine that will train)")
        return
    fid = real["eval"]["inception_weights"] and "eval.inception_weights" in schema.used(real)
    report.add("this machine", "config", True, f"room for the run under {real['experiment']['runs_dir']}"
               + ("; FID's weights and packages here" if fid else ""))


def length_check(report: Report, real: dict, phases) -> None:
    """Settings of the real run that its own length is too short for (``trainer.too_short``: a warm-up that never
    ends, an EMA that keeps its start), one failed check each with the fix; the tiny runs never show them."""
    from sinkflow.engine.trainer import too_short
    from sinkflow.methods.base import TrainingStep

    steps = {ph.name: ph.model_key for ph in phases if isinstance(ph, TrainingStep)}
    bad = {name: too_short(real["train"][key], key) for name, key in steps.items()}
    for name, lines in bad.items():
        if lines:
            report.add("settings fit the run's length", name, False, "; ".join(lines))
    if steps and not any(bad.values()):
        report.add("settings fit the run's length", "config", True, "warm-up and EMA of " + ", ".join(steps))


def bf16_check(report: Report, real: dict, card: str) -> None:
    """An explicit ``precision=bf16`` (a training phase's, or ``sample.precision``) on a card without bf16 tensor
    cores (a T4: compute capability 7.5) gets none of the speed it is chosen for; the plan above halved its
    activations in silence. Reported only when it applies."""
    from sinkflow.tools import memory_plan

    if card not in memory_plan.GPUS or memory_plan.card_bf16(card):
        return
    read = schema.used(real)
    keys = [f"train.{k}.precision" for k in _train_sections(real)
            if f"train.{k}.precision" in read and real["train"][k]["precision"] == "bf16"]
    fixes = ["use fp16 (its tensor cores; training scales the loss) or fp32 (a training phase's precision=auto is "
             "fp32 on this card)"] if keys else []
    if "sample.precision" in read and real["sample"]["precision"] == "bf16":
        keys.append("sample.precision")
        # sample.precision: auto follows the sampled network's set train.<phase>.precision on a CUDA card: not always
        # fp32 there
        auto = methods.of(real).sample_precision({**real, "sample": {**real["sample"], "precision": "auto"}}, "cuda",
                                                 bf16=False)
        fixes.append("for sample.precision, use fp16 (its tensor cores)" + (
            f" or auto ({auto} here)" if auto != "bf16" else " or fp32"))
    if keys:
        report.add(f"precision on {card}", "config", False,
                   f"{', '.join(k + '=bf16' for k in keys)}: a {card} has no bf16 tensor cores, so bf16 brings none of "
                   f"its speed there; {'; '.join(fixes)}")


def reach_checks(report: Report, real: dict, phases, overrides: list[str], shorthands: dict) -> None:
    """Every shorthand reached every phase it concerns; every override names a section some phase reads."""
    from sinkflow.methods.base import TrainingStep

    flat = config_mod.flatten(real)
    train_phases = [p for p in phases if isinstance(p, TrainingStep)]
    for name, value in (shorthands or {}).items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        patterns = config_mod.SHORTHANDS[name]
        hit = {k for pattern in patterns for k in config_mod.expand_key(real, pattern)}
        train_leaves = sorted({p.split(".")[-1] for p in patterns if p.startswith("train.")})
        for leaf in train_leaves:  # a training shorthand concerns every training phase
            for ph in train_phases:
                key = f"train.{ph.model_key}.{leaf}"
                if key not in hit:
                    report.add(f"{flag} reaches phase", ph.name, False,
                               f"{flag} does not set {key} (phase {ph.name} would use {flat.get(key)!r}); "
                               f"add it to sinkflow.config.SHORTHANDS['{name}']")
                elif flat[key] != config_mod.coerce(key, flat[key], value) and not any(
                        o.split("=", 1)[0].strip() == key for o in overrides):
                    report.add(f"{flag} reaches phase", ph.name, False, f"{key}={flat[key]!r}, asked {value!r}")
                else:
                    report.add(f"{flag} reaches phase", ph.name, True, f"{key}={flat[key]!r}")
        if not train_leaves:
            ok = bool(hit) and all(flat[k] == config_mod.coerce(k, flat[k], value) for k in hit)
            report.add(f"{flag} applied", "config", ok, ", ".join(f"{k}={flat[k]!r}" for k in sorted(hit)) or "no key")
    read = [s for ph in phases for s in ph.config_sections()]
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        if key.startswith(("train.", "model.", "pool.")):
            ok = any(key.startswith(s) for s in read)
            report.add("override reaches a phase", "config", ok,
                       f"{key}" + ("" if ok else f" is read by no phase of method {methods.of(real).name} "
                                   f"(phases: {', '.join(p.name for p in phases)}); drop it or change the method"))


# ---- the tiny run --------------------------------------------------------------------------------

def _equal(a, b) -> bool:
    """Deep equality of nested state dicts with tensors (bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _live_state(trainer) -> dict:
    """What a resumed phase must have restored, read from the live objects (not from its own state_dict). The
    generator: where the next batch not trained on is drawn from; with batches drawn ahead (``prefetch: always``)
    the generator itself is past them, and every such preflight failed with "phase generator not restored". The
    GradScaler (fp16): its scale and growth count are what fp16 adds to a resume, and the tiny run pays for fp16 on
    the CPU (``_precision_note``) to check that path, so it is compared too ({} when fp16 is off)."""
    return {"step": trainer.step, "model": copy.deepcopy(trainer.model.state_dict()),
            "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
            "generator": trainer.generator_state().clone(),
            "scaler": trainer.scaler.state_dict() if trainer.scaler.is_enabled() else {}}


def _diff_state(before: dict, after: dict) -> list[str]:
    bad = []
    if before["step"] != after["step"]:
        bad.append(f"step {after['step']} != {before['step']}")
    if not _equal(before["model"], after["model"]):
        bad.append("weights differ")
    if not _equal(before["optimizer"]["state"], after["optimizer"]["state"]):
        n0, n1 = len(before["optimizer"]["state"]), len(after["optimizer"]["state"])
        bad.append(f"optimizer state not restored ({n1} of {n0} parameter states, moments differ)")
    if not torch.equal(before["generator"], after["generator"]):
        bad.append("phase generator not restored")
    if before["scaler"] != after["scaler"]:
        bad.append(f"GradScaler not restored (scale {after['scaler'].get('scale')} != {before['scaler'].get('scale')}, "
                   f"growth count {after['scaler'].get('_growth_tracker')} != "
                   f"{before['scaler'].get('_growth_tracker')})")
    return bad


def _precision_note(trainer) -> str:
    """Said beside a phase that the tiny run trained in fp16 on the CPU, where float16 has no fast kernels (a step of
    mnist's UNet at batch 4 10x fp32's, of cifar10's 55x: docs/preflight.md). It is kept: fp16 (autocast, GradScaler,
    the scaler in the checkpoint) is the path the card runs, which preflight exists to have run once with the real
    shapes; a CPU precision in its place would leave that path unrun. The note says where the time went."""
    if trainer.precision != "fp16" or trainer.device.type != "cpu":
        return ""
    return (f"; in fp16 as train.{trainer.task.model_key}.precision sets: autocast + GradScaler, the card's path, "
            "several times slower than fp32 on a CPU")


def _short(exc: BaseException) -> str:
    if isinstance(exc, SinkflowError):
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"


class _SetupGuard(Callback):
    """Before its loop (right after setup), each training phase checks that the tiny shorthands reached it."""

    def __init__(self, expected: dict):
        self.expected = expected

    def on_setup(self, trainer) -> None:
        wrong = [f"train.{trainer.task.model_key}.{k}={trainer.cfg[k]!r} (flag asked {v!r})"
                 for k, v in self.expected.items() if trainer.cfg.get(k) != v]
        if wrong:
            raise _Unreached("; ".join(wrong))


class _StopAfterFirstUnit(Callback):
    """Request a stop after the first step / chunk round: the real SIGTERM path (checkpoint, Interrupted)."""

    def on_train_batch_end(self, trainer, batch, outputs) -> None:
        trainer.request_stop(signal.SIGTERM)


class _CaptureResume(Callback):
    """The live state right after a resumed phase loaded its checkpoint."""

    def __init__(self):
        self.state: dict = {}

    def on_load_checkpoint(self, trainer, state) -> None:
        self.state.update(_live_state(trainer))


def _written_rows(a) -> np.ndarray:
    """Which rows of a chunked task's output hold something (unfinished units' rows are zero)."""
    return np.abs(np.asarray(a, dtype=np.float32).reshape(len(a), -1)).sum(1) > 0


def _interrupt_and_resume(report: Report, run, index: int, build, guard: Callback) -> None:
    """Run phase ``index`` with a stop requested after its first step/chunk, then resume it fresh."""
    from sinkflow.methods.base import ChunkedTask, TrainingStep
    from sinkflow.runtime import signals
    from sinkflow.engine.trainer import Trainer

    ph = build()[index]
    name = ph.name
    t0 = time.perf_counter()
    trainer = Trainer(run, ph, [guard, _StopAfterFirstUnit()])
    try:
        trainer.fit()
        stopped = False
    except signals.Interrupted:
        stopped = True
    if not stopped:
        report.add("stops on SIGTERM", name, False, "the phase ran to the end although a stop was requested")
        return
    before = _live_state(trainer) if isinstance(ph, TrainingStep) else None
    written = ph.output(run) if isinstance(ph, ChunkedTask) else None
    del ph, trainer
    fresh = build()[index]
    captured = _CaptureResume()
    trainer = Trainer(run, fresh, [guard, captured])
    trainer.fit()
    dt = time.perf_counter() - t0
    if isinstance(fresh, TrainingStep):
        if not captured.state:
            report.add("kill and resume", name, False, "the resumed phase did not load its checkpoint", dt)
            return
        bad = _diff_state(before, captured.state)
        if not run.phase_done(name):
            bad.append("no final.pt after the resumed run")
        elif (st := run.checkpoints(name).final())["step"] != trainer.cfg["iters"]:
            bad.append(f"final step {st['step']} != train.{fresh.model_key}.iters={trainer.cfg['iters']}")
        report.add("kill and resume", name, not bad,
                   "; ".join(bad) or f"stopped at step {before['step']}, resumed step/weights/Adam moments/generator"
                   f"{'/GradScaler' if before['scaler'] else ''} identical, finished {trainer.cfg['iters']} steps"
                   + _precision_note(trainer), dt)
    elif written is not None:
        after, done = fresh.output(run), _written_rows(written)
        kept = bool(done.any()) and np.array_equal(after[done], written[done])
        filled = bool(_written_rows(after[~done]).all())
        ok = kept and filled and run.phase_done(name)
        report.add("kill and resume", name, ok,
                   f"stopped after unit 1, resumed: the {int(done.sum())} rows written before kept, the other "
                   f"{int((~done).sum())} built" if ok else
                   f"rows written before kept={kept}, rest built={filled}, done={run.phase_done(name)}", dt)
    else:
        report.add("kill and resume", name, run.phase_done(name), "resumed and finished", dt)


def run_tiny(report: Report, real: dict, workdir: Path) -> None:
    """Every phase with tiny counts and real shapes, each stopped and resumed once; then sample and evaluate."""
    from sinkflow.methods.base import TrainingStep
    from sinkflow.runtime.run_folder import RunFolder

    tiny, sh = tiny_config(real, workdir / "runs", "preflight")
    expected = {"iters": sh["train_iters"], "batch_size": sh["batch_size"]}
    run = RunFolder.create(tiny)
    source, target = data.distributions(tiny)
    method = methods.of(tiny)

    def build():
        return methods.phases(tiny, source, target)

    phases = build()
    failed = None
    guard = _SetupGuard(expected)
    for i, ph in enumerate(phases):
        if failed:
            report.add("runs", ph.name, None, f"skipped: phase {failed} failed")
            continue
        t0 = time.perf_counter()
        try:
            _interrupt_and_resume(report, run, i, build, guard)
        except _Unreached as exc:
            report.add("shorthands reach phase", ph.name, False, f"{exc}: the phase would run with its real "
                       "value; add the key to sinkflow.config.SHORTHANDS")
            failed = ph.name
            continue
        except Exception as exc:  # the point of preflight: report, do not crash
            shape = f" (data shape {tuple(target.shape)})"
            report.add("runs", ph.name, False, _short(exc) + shape, time.perf_counter() - t0)
            failed = ph.name
            continue
        if isinstance(ph, TrainingStep):
            report.add("shorthands reach phase", ph.name, True,
                       ", ".join(f"{k}={v}" for k, v in expected.items()))
        run.release()
    if failed:
        report.add("sample and evaluate", "eval", None, f"skipped: phase {failed} failed")
        return
    t0 = time.perf_counter()
    try:
        from sinkflow.eval.points import generate

        n = tiny["eval"]["n"]
        x, info = generate(run, n, 2, seed=0)
        bad = []
        if tuple(x.shape) != (n, *target.shape):
            bad.append(f"samples have shape {tuple(x.shape)}, expected {(n, *target.shape)}")
        if info.get("nfe", 0) < 1:
            bad.append(f"NFE counted {info.get('nfe')}")
        report.add("sample", "eval", not bad, "; ".join(bad) or f"{n} samples, {info['nfe']} network evaluations",
                   time.perf_counter() - t0)
        t0 = time.perf_counter()
        from sinkflow.eval.report import final_report

        text = final_report(run).strip().splitlines()
        wrote = text[-1].count(",") + 1 if text and text[-1].startswith("wrote") else 0
        report.add("evaluate + plots", "eval", True, f"{len(text) - 1} report lines, {wrote} plot file(s)",
                   time.perf_counter() - t0)
    except Exception as exc:
        report.add("sample and evaluate", "eval", False, _short(exc), time.perf_counter() - t0)
    finally:
        run.logger.close()


# ---- the whole preflight -----------------------------------------------------------------------

def preflight(preset: str, overrides: list[str] | None = None, shorthands: dict | None = None,
              gpu: tuple[str, int] | None = None, world: int = 1, workdir: Path | None = None,
              memory: bool = True, run_dir: Path | None = None) -> Report:
    """Run every check for one preset; never raises for a failing check (they are in the report). ``run_dir``: the
    run folder whose ``config.yaml`` ``preset`` is, planned for its resume: its finished phases leave the memory
    verdict and the fit (``memory_plan.finished_in``), and a fit that changes a key the run's artifacts froze
    (``identity.check_frozen``: the pool's batch once the pool is on disk) is refused, as ``train --resume`` would
    refuse it. The tiny run still runs every phase (it runs in a scratch folder, never in ``run_dir``)."""
    from sinkflow.tools import memory_plan
    from sinkflow.tools.data import real_or_synthetic

    t_start = time.perf_counter()
    overrides, shorthands = list(overrides or []), dict(shorthands or {})
    report = Report(preset)
    try:
        real = config_mod.resolve(preset, overrides, shorthands)
    except SinkflowError as exc:
        report.add("config resolves", "config", False, str(exc))
        return report
    report.add("config resolves", "config", True, f"method {methods.of(real).name}")
    tmp = scratch_dir("preflight") if workdir is None else None
    workdir = Path(tmp.name if tmp else workdir)
    torch_threads = torch.get_num_threads()
    quiet = contextlib.ExitStack()
    quiet.enter_context(callbacks.quiet())
    try:
        try:  # data not on this machine: synthetic images of its shape; data here but damaged: a failed check
            reason = quiet.enter_context(real_or_synthetic(real))
        except SinkflowError as exc:
            report.add("data reads", "config", False, _short(exc))
            return report
        report.data_note = reason and f"synthetic {real['data']['target']} images of the real shape ({reason})"
        try:
            check_run(real, machine=False)  # what `sinkflow train` refuses before its folder exists
            source, target = data.distributions(real)
            phases = methods.phases(real, source, target)
        except Exception as exc:
            report.add("phases build", "config", False, _short(exc))
            return report
        report.add("phases build", "config", True, ", ".join(p.name for p in phases) +
                   f"; data shape {tuple(target.shape)}")
        machine_check(report, real, tuple(target.shape))
        length_check(report, real, phases)
        reach_checks(report, real, phases, overrides, shorthands)
        run_tiny(report, real, workdir)
        if memory:
            t0 = time.perf_counter()
            try:
                report.memory = memory_plan.estimate(real, world=world, bf16=memory_plan.card_bf16(
                    gpu[0] if gpu is not None else None))
                done = ""
                if run_dir is not None:
                    report.memory = memory_plan.finished_in(report.memory, run_dir)
                    done = f", {sum(m.kind == 'done' for m in report.memory)} finished in {run_dir}"
                report.add("memory estimate", "all", True, f"{len(report.memory)} phases{done}",
                           time.perf_counter() - t0)
            except Exception as exc:
                report.add("memory estimate", "all", False, _short(exc), time.perf_counter() - t0)
            if gpu is not None and report.memory:
                label, total = gpu
                over = memory_plan.over_budget(real, report.memory, total)
                report.fit_overrides, report.fit_reasons = memory_plan.propose_fit(
                    real, report.memory, total, world, memory_plan.card_bf16(label), card=label)
                if run_dir is not None and report.fit_overrides:
                    from sinkflow.runtime.identity import check_frozen

                    try:  # what `train --resume RUN <fit>` would refuse
                        check_frozen(real, config_mod.apply_overrides(real, report.fit_overrides), run_dir)
                    except SinkflowError as exc:
                        report.fit_reasons.append(f"a resume cannot take this fit: {exc}")
                        report.fit_overrides = []
                report.add(f"fits {label}", "all", not over,
                           f"too large: {', '.join(over)}" if over else "every phase fits")
                bf16_check(report, real, label)
    finally:
        quiet.close()
        torch.set_num_threads(torch_threads)
        if tmp is not None:
            tmp.cleanup()
    report.seconds = time.perf_counter() - t_start
    return report


def format_report(report: Report) -> str:
    lines = [f"preflight {report.preset}" + (f"  [data: {report.data_note}]" if report.data_note else "")]
    w = max([len(c.name) for c in report.checks] + [10])
    p = max([len(c.phase) for c in report.checks] + [5])
    for c in report.checks:
        mark = {True: "PASS", False: "FAIL", None: "skip"}[c.ok]
        secs = f"{c.seconds:5.1f}s" if c.seconds else "      "
        lines.append(f"  {mark}  {c.phase:<{p}}  {c.name:<{w}}  {secs}  {c.detail}")
    n_fail = sum(c.ok is False for c in report.checks)
    lines.append(f"  {'OK' if report.ok else 'FAILED'}: {sum(c.ok is True for c in report.checks)} passed, "
                 f"{n_fail} failed, {sum(c.ok is None for c in report.checks)} skipped in {report.seconds:.1f}s")
    return "\n".join(lines)


def fit_command(preset: str, overrides: list[str], shorthands: dict, fit: list[str], run_dir: Path | None = None
                ) -> str:
    """The ``sinkflow train`` command with the fit applied, each argument shell-quoted (a value with a space or
    brackets pastes as one argument); for a run folder (``run_dir``), its resume with the fit."""
    if run_dir is not None:
        return shlex.join(["sinkflow", "train", "--resume", str(run_dir), *fit])
    flags = [a for k, v in (shorthands or {}).items() if v is not None for a in (f"--{k.replace('_', '-')}", str(v))]
    fixed = {f.split("=", 1)[0] for f in fit}
    kept = [o for o in overrides if o.split("=", 1)[0].strip() not in fixed]  # the fit's value replaces them
    return shlex.join(["sinkflow", "train", preset, *kept, *fit, *flags])

