"""Named hooks into the engine's loop (``sinkflow.engine.trainer.Trainer``), after Lightning's ``Callback``.

Everything that watches or steers a phase without being the phase (the progress bar, the health dashboard,
``bench``'s step timer, preflight's stop-and-resume probe, doctor's and lr-find's "stop before the first
step") is a ``Callback`` handed to the ``Trainer``; nothing patches the loop at run time. A method's
``TrainingStep`` is itself a ``Callback`` (it is called first), so a method can hook the same points.

Order of the hooks in one phase::

    on_setup                 model, optimizer, generator built (training phases); nothing loaded yet
    on_load_checkpoint       only when a step checkpoint was resumed, right after it was loaded
    on_phase_start           just before the first unit of work
      on_train_batch_start   per unit (a batch drawn, before the optimizer step; for a chunked task: a round)
      on_train_batch_end     per unit, after it (trainer.step already counts it); outputs: a training step's
                             (loss, grad_norm), 0-dim device tensors (reading one syncs), a chunked task's items done
      on_log                 on log steps: add entries to the metrics dict before it is written
      on_checkpoint          after a step checkpoint was written (every ckpt_every, and on a stop request)
    on_phase_end             after final.pt was written (not when the phase stopped early)
    on_exception             an exception (a stop by signal: ``Interrupted``) leaves the phase; it is re-raised
    teardown                 always, last (also after an exception or a stop)

A callback with state to keep across a resume returns it from ``state_dict()`` (plain values and tensors: it
goes into every step checkpoint under ``callbacks[state_key]``; anything else, a numpy number included, is refused
when the checkpoint is written: ``checkpointable_state``) and gets it back in ``load_state_dict``,
before ``on_load_checkpoint`` (a callback passed to the run gets it from the last finished phase's final.pt when a
resume starts the next phase afresh: a stop between two phases). To end a phase, a callback calls
``trainer.request_stop()`` (checkpoint, then
``Interrupted``, as on SIGTERM) or ``trainer.stop()`` (the loop ends after the current hook, nothing is written,
``fit()`` returns with ``trainer.stopped`` set: for a tool's own ``Trainer``; in a run, ``run_phases`` then stops
with a one-line error, as the phase has no ``final.pt``); under torchrun the ranks agree on either (one rank's
callback may decide alone). It never raises to stop the loop nor sets another object's attributes.

This module imports no other layer's (torch, tqdm, sinkflow.errors and runtime.dist only): methods subclass
``Callback`` without importing the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any

from tqdm.auto import tqdm

from sinkflow.errors import SinkflowError
from sinkflow.runtime import dist


class Callback:
    """Override the hooks you need; every hook gets the ``Trainer`` first. Defaults do nothing."""

    def on_setup(self, trainer) -> None: ...

    def on_load_checkpoint(self, trainer, state: dict) -> None: ...

    def on_phase_start(self, trainer) -> None: ...

    def on_train_batch_start(self, trainer, batch: Any) -> None: ...

    def on_train_batch_end(self, trainer, batch: Any, outputs: Any) -> None: ...

    def on_log(self, trainer, metrics: dict) -> None: ...

    def on_checkpoint(self, trainer) -> None: ...

    def on_phase_end(self, trainer) -> None: ...

    def on_exception(self, trainer, exception: BaseException) -> None: ...

    def teardown(self, trainer) -> None: ...

    # ---- state kept in the phase's step checkpoints ------------------------------------------------
    @property
    def state_key(self) -> str:
        """Where this callback's state lives in a checkpoint (one instance per class by default)."""
        return type(self).__qualname__

    def state_dict(self) -> dict:
        """State to restore on resume (empty: nothing is saved)."""
        return {}

    def load_state_dict(self, state: dict) -> None: ...


def checkpointable_state(cb: Callback) -> dict:
    """``cb.state_dict()``, refused in one line when a step checkpoint could not give it back: resume loads
    checkpoints with ``torch.load(weights_only=True)``, which rejects a numpy number (``np.mean`` of losses) or any
    other object; the run saved such a state without a word, and every resume then refused the run's own
    checkpoints as "holds objects other than tensors ... (loading it could run code)". Checked by the same loader,
    in memory (a callback's state is small)."""
    import io
    import re

    import torch

    state = cb.state_dict()
    if not state:
        return state
    fix = "keep tensors, Python numbers, strings, lists, tuples and dicts in it (float(x) for a numpy number)"
    buffer = io.BytesIO()
    try:  # a lambda or a local class cannot even be written: pickle's traceback from the middle of a checkpoint
        torch.save(state, buffer)
    except Exception as exc:  # AttributeError / PicklingError: "Can't pickle local object ..."
        raise SinkflowError(f"callback {cb.state_key}'s state_dict() holds an object a step checkpoint cannot "
                            f"write ({(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]})",
                            fix) from None
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError: "Weights only load failed ... Unsupported global: ..."
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        raise SinkflowError(f"callback {cb.state_key}'s state_dict() holds {'a ' + found[1] if found else 'an object'}"
                            ", which a step checkpoint cannot load back (resume reads them with torch.load "
                            "weights_only=True)", fix) from None
    return state


LEARNING_LOG = "sinkflow.learning"  # warnings that a run did not learn (NSGF++'s time predictor): ``quiet()`` mutes them


@contextlib.contextmanager
def quiet(chatter: bool = True):
    """No progress bars and no INFO chatter while a tool (preflight, doctor, lr-find) trains its tiny scratch runs:
    their bars (a 1e9-step loop stopped by the tool) and pool lines are not the user's. Warnings about the config
    still print; those that a run did not learn (``LEARNING_LOG``) do not: a 3-step scratch run never does.
    ``chatter=False`` mutes only those (bench: the bars and speed lines of its cut runs are what it reports on)."""
    env = os.environ.get("SINKFLOW_PROGRESS")
    muted = {LEARNING_LOG: logging.ERROR, **({"sinkflow": logging.WARNING} if chatter else {})}
    levels = {logging.getLogger(name): logging.getLogger(name).level for name in muted}
    for name, level in muted.items():
        logging.getLogger(name).setLevel(level)
    if chatter:
        os.environ["SINKFLOW_PROGRESS"] = "0"
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("SINKFLOW_PROGRESS", None)
        else:
            os.environ["SINKFLOW_PROGRESS"] = env
        for lg, level in levels.items():
            lg.setLevel(level)


# seconds between two progress lines where the console is not a terminal (a log file: nohup, SLURM, Kaggle's
# "Save & Run All", a container's log), the interval of `SINKFLOW_PROGRESS_EVERY`
PROGRESS_LINE_EVERY = 30.0


def progress_mode() -> str:
    """How the main process shows a phase's progress: ``SINKFLOW_PROGRESS`` = 0 (nothing), ``bar`` (tqdm),
    ``lines`` (a plain line every ``SINKFLOW_PROGRESS_EVERY`` seconds), or 1 (the default): a bar where it is drawn
    in place (a terminal, a notebook's widget), lines elsewhere (and in a Kaggle notebook's saved version, whose
    kernel draws widgets that no page shows). A bar in a log file is one line of ``\\r`` redraws, about 600 KB an
    hour of a phase, which ``tail -f`` and line-based log viewers show nothing of until it ends."""
    mode = os.environ.get("SINKFLOW_PROGRESS", "1").strip().lower()
    if mode in ("0", "bar", "lines"):
        return mode
    if os.environ.get("KAGGLE_KERNEL_RUN_TYPE") == "Batch":  # a Kaggle notebook's saved version ("Save & Run All"):
        return "lines"  # no page draws its widget, and its log, the streams alone, showed no progress at all
    from tqdm import autonotebook, std

    # autonotebook's tqdm is the notebook's widget inside a Jupyter kernel (with ipywidgets), else std's
    in_place = autonotebook.tqdm is not std.tqdm or (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    return "bar" if in_place else "lines"


def line_every() -> float:
    try:
        every = float(os.environ.get("SINKFLOW_PROGRESS_EVERY", PROGRESS_LINE_EVERY))
    except ValueError:
        return PROGRESS_LINE_EVERY
    return every if every >= 0 else PROGRESS_LINE_EVERY


class ProgressBar(Callback):
    """The phase's progress on the main process, over its units (steps; the pool's batches): a tqdm bar, or in a
    log file a plain line every ``SINKFLOW_PROGRESS_EVERY`` seconds and one when the phase ends (``progress_mode``)."""

    def __init__(self):
        self.bar = None
        self.lines: ProgressLines | None = None

    def on_phase_start(self, trainer) -> None:
        mode = progress_mode() if dist.current().is_main else "0"
        if mode == "lines":
            self.lines = ProgressLines(trainer.name, trainer.total, trainer.progress,
                                       "steps" if trainer.training else "batches", line_every())
            return
        self.bar = tqdm(total=trainer.total, initial=trainer.progress, desc=trainer.name, disable=mode == "0",
                        dynamic_ncols=True, mininterval=1.0, smoothing=0.1)

    def on_train_batch_end(self, trainer, batch, outputs) -> None:
        if self.lines is not None:
            self.lines.update(trainer.last_units)
        else:
            self.bar.update(trainer.last_units)

    def on_log(self, trainer, metrics: dict) -> None:
        if "loss" in metrics:
            if self.lines is not None:
                self.lines.loss = metrics["loss"]
            else:
                self.bar.set_postfix(loss=f"{metrics['loss']:.4g}")

    def teardown(self, trainer) -> None:
        if self.lines is not None:
            self.lines.close()
            self.lines = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def progress(items, desc: str, unit: str, enabled: bool = True, mode: str | None = None):
    """Iterate ``items`` (sized) showing progress as a phase does (``progress_mode``): a tqdm bar where it is drawn
    in place, a plain ``ProgressLines`` line every ``SINKFLOW_PROGRESS_EVERY`` seconds and at the end where the
    console is a log file, nothing with SINKFLOW_PROGRESS=0 or ``enabled=False``. For the tools' own loops (tune's
    samplers, sample's PNGs): they drew tqdm's bar into log files, one line of carriage-return redraws that
    ``tail -f`` shows nothing of until the loop ends. ``unit`` is plural (``"images"``). ``mode``: the
    ``progress_mode`` read before a ``quiet`` block, for a loop of the user's inside it (lr-find's sweep)."""
    mode = (mode or progress_mode()) if enabled else "0"
    if mode == "bar":
        yield from tqdm(items, desc=desc, unit=unit.rstrip("s"), dynamic_ncols=True, mininterval=1.0)
        return
    lines = ProgressLines(desc, len(items), 0, unit, line_every()) if mode == "lines" else None
    handed = False  # an item is out: the caller's loop body runs it
    try:
        for item in items:
            handed = True
            yield item
            handed = False
            if lines is not None:
                lines.update(1)
    finally:  # the last count also where the caller's loop stopped early (lr-find's sweep ends where it diverges),
        if lines is not None:  # the item it stopped on counted: its body ran (the diverging step was taken)
            lines.done += handed
            lines.close()


class ProgressLines:
    """Progress as whole lines on stderr, flushed: ``velocity: 1,200/20,000 steps (6.0%), 41.2 steps/s, elapsed
    00:29, ETA 07:36, loss 0.1234``; the rate is this process's (a resumed phase counts from where it resumed)."""

    def __init__(self, name: str, total: int, done: int, unit: str, every: float):
        self.name, self.total, self.done, self.unit, self.every = name, total, done, unit, every
        self.start_done, self.loss = done, None
        self.t0 = self.last = time.monotonic()
        self.said = done

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last >= self.every:
            self.say()

    def say(self) -> None:
        now = time.monotonic()
        elapsed = now - self.t0
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        left = max(self.total - self.done, 0)
        eta = tqdm.format_interval(left / rate) if rate > 0 else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        loss = f", loss {self.loss:.4g}" if isinstance(self.loss, (int, float)) else ""
        print(f"{self.name}: {self.done:,}/{self.total:,} {self.unit} ({pct:.1f}%), {rate:.3g} {self.unit}/s, "
              f"elapsed {tqdm.format_interval(elapsed)}, ETA {eta}{loss}", file=sys.stderr, flush=True)
        self.last, self.said = now, self.done

    def close(self) -> None:
        if self.done != self.said:  # the phase's last count (finished, stopped or failed)
            self.say()
