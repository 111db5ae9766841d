"""LR range test for any phase whose model computes its own loss: ``loss_fn(model, batch)``.

The LR grows exponentially from ``start_lr`` to ``end_lr`` over ``steps`` optimizer steps (one fresh
batch each). The loss is smoothed by a bias-corrected EMA (``beta``); a non-finite loss is recorded
as a gap and its step is skipped (no backward, no update); ``max_nan`` of them in a row, or a smoothed
loss above ``diverge`` times the best so far, end the sweep. A step float16's GradScaler skipped (Inf/NaN
gradients at its scale: ``UnappliedStep``, listed in ``skipped``) measured the weights as they are, so its loss is
smoothed and can end the sweep as diverged, but no update was taken at its rate: no suggestion comes from it (a run of
them trains nothing, weights frozen, and its flat curve had held the loss minimum), and it is no non-finite step (the
scale coming down from 2**16 skips the first steps of a fresh phase). Once the scale falls below 1 (Inf/NaN
gradients even unscaled, the loop's own stop) each step is a non-finite one. Model, optimizer (moments, step counts,
LRs), gradients and the caller's RNG states are restored afterwards, bit for bit.

Suggestions (all from the smoothed curve up to its minimum, slopes taken in log10-LR space):

* ``steepest``: the LR where the loss falls fastest per decade;
* ``min/10``: a tenth of the LR at the loss minimum (past it the loss is about to blow up);
* aggressive = the larger of the two (at most min/2), moderate = their geometric mean,
  conservative = the smaller of the two divided by 3.

Changing the number of processes: the runner multiplies ``train.<phase>.lr`` by ``lr_scale(rule,
world)`` (``train.<phase>.lr_scaling``): ``linear`` (x N, Goyal et al. for SGD at large batch),
``sqrt`` (x sqrt(N), the default: Adam's update size does not grow linearly with the batch), or
``none``. Run lr-find at the batch you will train with per process and write the per-1-process rate.

torch and numpy are imported where they are used: the CLI checks its arguments with ``check_sweep``,
``check_plot_path`` and ``write_target`` before any of them loads (a bad argument is refused in a moment).
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from sinkflow.errors import SinkflowError

if TYPE_CHECKING:
    import torch


class UnappliedStep(Exception):
    """A step whose update was not applied although its loss was finite (float16's GradScaler skipped it on Inf/NaN
    gradients at its scale); ``loss``: the loss it measured. ``lr_range_test`` smooths it (the loss of the weights as
    they are: a divergence shows in it) but suggests no rate from it, and does not count it as non-finite."""

    def __init__(self, loss: float):
        super().__init__(f"update not applied (loss {loss:.4g})")
        self.loss = loss


# decades between two rates of a sweep above which its picks are said to be coarse: the suggestions' slopes are taken
# over a quarter decade either side (``suggest``); the default sweep (100 steps over 1e-7..10) is 0.081 apart
COARSE = 0.25


@dataclass
class LRFindResult:
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # raw, NaN where non-finite
    smoothed: list[float] = field(default_factory=list)  # NaN where non-finite
    stop_reason: str = "end of range"
    suggestions: dict[str, float] = field(default_factory=dict)
    steepest: float | None = None
    min_loss_lr: float | None = None
    skipped: list[int] = field(default_factory=list)  # steps float16's GradScaler did not apply (UnappliedStep)
    replays: int | None = None  # steps that were replays of a captured CUDA graph (None: the step is not captured)
    span: float | None = None  # decades from the sweep's start rate to its end rate

    def summary(self) -> str:
        unapplied = (f"; {len(self.skipped)} of {len(self.lrs)} updates skipped by float16's GradScaler"
                     if self.skipped else "")
        if not self.suggestions:
            return f"no suggestion ({self.stop_reason}; {len(self.lrs)} steps{unapplied})"
        s = self.suggestions
        return (f"conservative {s['conservative']:.2e}  moderate {s['moderate']:.2e}  aggressive {s['aggressive']:.2e}"
                f"  (steepest {self.steepest:.2e}, loss minimum at {self.min_loss_lr:.2e}; stopped: {self.stop_reason}"
                f"{unapplied}){self.coarse()}")

    def coarse(self) -> str:
        """A note where the rates are more than ``COARSE`` decades apart. Why: `--steps 6` gave three picks to three
        digits from rates 1.6 decades apart (its steepest fall at its loss minimum), and with a step past the slopes'
        quarter-decade window and the EMA's memory (about 50 steps) many decades long, no pick is finer than a step."""
        if len(self.lrs) < 2:
            return ""
        apart = math.log10(self.lrs[1] / self.lrs[0])
        if apart <= COARSE:
            return ""
        wanted = f" to {math.ceil(self.span / COARSE - 1e-9) + 1} or more" if self.span else ""
        return (f"; coarse: the rates are {apart:.2g} decades apart, so no pick is finer than that: raise "
                f"--steps{wanted}")


def _snapshot(model, optimizer):
    import numpy as np
    import torch

    return {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
        "rng": (torch.get_rng_state(), np.random.get_state(), random.getstate(),
                torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None),
        "training": model.training,
    }


def _restore(model, optimizer, snap) -> None:
    import numpy as np
    import torch

    model.load_state_dict(snap["model"])
    optimizer.load_state_dict(snap["optimizer"])
    for p, g in zip(model.parameters(), snap["grads"]):
        p.grad = g
    t, n, r, c = snap["rng"]
    torch.set_rng_state(t)
    np.random.set_state(n)
    random.setstate(r)
    if c is not None:
        torch.cuda.set_rng_state_all(c)
    model.train(snap["training"])


def check_sweep(start_lr: float, end_lr: float, steps: int, diverge: float, flags: bool = False) -> None:
    """Refuse a sweep that cannot run or cannot stop sensibly, before any step (``flags``: name the CLI's
    ``--start-lr`` ... instead of the parameters). ``diverge`` <= 1 would end the sweep at the first noisy uptick."""
    def name(param: str) -> str:
        return "--" + param.replace("_", "-") if flags else param

    if not (math.isfinite(start_lr) and start_lr > 0):
        raise SinkflowError(f"{name('start_lr')} {start_lr:g} must be a positive learning rate",
                            f"e.g. {name('start_lr')} 1e-7 (the default)")
    if not math.isfinite(end_lr):  # "inf must be above 1e-07" named the wrong problem
        raise SinkflowError(f"{name('end_lr')} {end_lr:g} must be a finite learning rate",
                            f"e.g. {name('end_lr')} 10 (the default)")
    if not end_lr > start_lr:
        raise SinkflowError(f"{name('end_lr')} {end_lr:g} must be above {name('start_lr')} {start_lr:g} (the sweep "
                            "goes up)", f"e.g. {name('start_lr')} 1e-7 {name('end_lr')} 10 (the defaults)")
    if steps < 2:
        raise SinkflowError(f"{name('steps')} {steps} is too few for a sweep (it needs a first and a last rate)",
                            f"use {name('steps')} 2 or more (default 100)")
    if not (math.isfinite(diverge) and diverge > 1):
        raise SinkflowError(f"{name('diverge')} {diverge:g} must be above 1 (the sweep stops when the smoothed loss "
                            "exceeds this many times its best)", f"e.g. {name('diverge')} 4 (the default)")


def lr_range_test(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable | None,
                  batch_fn: Callable, start_lr: float = 1e-7, end_lr: float = 10.0, steps: int = 100,
                  beta: float = 0.98, diverge: float = 4.0, max_nan: int = 3, restore: bool = True,
                  step_fn: Callable | None = None, train_step: Callable | None = None,
                  progress: tuple[str, str] | None = None) -> LRFindResult:
    """Exponential LR sweep; ``batch_fn(i)`` gives step i's batch; ``step_fn(loss)`` may replace
    backward + ``optimizer.step()`` (e.g. with a GradScaler). ``train_step(batch) -> loss`` replaces the
    whole step (the engine's ``Trainer.train_step``: accumulation, clipping, precision...); a non-finite step
    raises ``NonFiniteStep`` before it is applied and is recorded as a gap; a finite step it did not apply raises
    ``UnappliedStep`` (smoothed, no suggestion from it, no count towards ``max_nan``). ``progress``: (name, a
    ``runtime.callbacks.progress_mode``) to show the steps as a phase's are (a CPU sweep of mnist's UNet is minutes)."""
    from sinkflow.runtime.callbacks import progress as shown

    check_sweep(start_lr, end_lr, steps, diverge)
    res = LRFindResult(span=math.log10(end_lr / start_lr))
    # the copy only where this function restores it: ``phase_lr_find`` restores the trainer's whole state itself, and
    # a second copy of the model, its gradients and Adam's moments (three times the weights) held the card's memory
    snap = _snapshot(model, optimizer) if restore else None
    mult = (end_lr / start_lr) ** (1.0 / (steps - 1))
    avg, k, best, nan_run = 0.0, 0, math.inf, 0
    gap_from = None  # the rate of the first step not applied since the last applied one: where the trouble began
    model.train()
    try:
        name, mode = progress or ("lr-find", "0")
        for i in shown(range(steps), name, "steps", mode=mode):
            lr, applied = start_lr * mult**i, True
            for g in optimizer.param_groups:
                g["lr"] = lr
            if train_step is not None:
                from sinkflow.engine.trainer import NonFiniteStep

                try:
                    value, loss = float(train_step(batch_fn(i))), None
                except NonFiniteStep:
                    value = math.nan
                except UnappliedStep as skip:
                    value, loss, applied = skip.loss, None, False
                    gap_from = lr if gap_from is None else gap_from
                    res.skipped.append(i)
            else:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model, batch_fn(i))
                value = float(loss.detach())
            res.lrs.append(lr)
            if not math.isfinite(value):
                gap_from = lr if gap_from is None else gap_from
                res.losses.append(math.nan)
                res.smoothed.append(math.nan)
                nan_run += 1
                if nan_run >= max_nan:  # named from the first step not applied: "at lr" the third named a rate
                    # past the one where the weights went bad
                    res.stop_reason = (f"{max_nan} non-finite steps in a row; no update applied from lr "
                                       f"{gap_from:.2e} to {lr:.2e}")
                    break
                continue
            if applied:  # a skipped step continues a run of steps not applied
                nan_run, gap_from = 0, None
            if loss is None:
                pass  # train_step took the step
            elif step_fn is None:
                loss.backward()
                optimizer.step()
            else:
                step_fn(loss)
            k += 1
            avg = beta * avg + (1 - beta) * value
            smooth = avg / (1 - beta**k)
            res.losses.append(value)
            res.smoothed.append(smooth)
            best = min(best, smooth)
            if k > 5 and smooth > diverge * best:
                res.stop_reason = f"diverged at lr {lr:.2e} (smoothed loss {smooth:.3g} > {diverge:g} x best {best:.3g})"
                break
    finally:
        if restore:
            _restore(model, optimizer, snap)
    suggest(res)
    return res


def suggest(res: LRFindResult) -> None:
    """Fill ``res.suggestions`` from the smoothed curve (see the module docstring)."""
    import numpy as np

    lrs = np.array(res.lrs)
    sm = np.array(res.smoothed, dtype=float)
    ok = np.isfinite(sm)
    ok[res.skipped] = False  # no update at its rate: a frozen run's flat curve held the minimum
    if ok.sum() < 5:
        return
    lrs, sm = lrs[ok], sm[ok]
    skip = min(5, len(sm) // 10)  # the EMA's first points are noise
    i_min = skip + int(np.argmin(sm[skip:]))
    res.min_loss_lr = float(lrs[i_min])
    if i_min - skip < 2:
        return
    x, y = np.log10(lrs[skip : i_min + 1]), sm[skip : i_min + 1]
    w = max(1, int(round(0.25 / max(np.diff(x).mean(), 1e-9))))  # slope over +-1/4 decade: EMA noise cancels
    idx = np.arange(len(x))
    a, b = np.clip(idx - w, 0, len(x) - 1), np.clip(idx + w, 0, len(x) - 1)
    slope = (y[b] - y[a]) / np.maximum(x[b] - x[a], 1e-12)
    res.steepest = float(lrs[skip + int(np.argmin(slope))])
    tenth = res.min_loss_lr / 10
    hi = min(max(res.steepest, tenth), res.min_loss_lr / 2)
    lo = min(res.steepest, tenth)
    res.suggestions = {"conservative": lo / 3, "moderate": math.sqrt(lo * hi), "aggressive": hi}


def check_plot_path(path: Path, flag: str = "--out") -> None:
    """Refuse a plot file matplotlib cannot write (a suffix it does not know, a folder) before the sweep, not
    after it; the formats are matplotlib's own list."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    formats = FigureCanvasBase.get_supported_filetypes()
    cli = f"{flag} " if flag.startswith("--") else ""
    if path.suffix[1:].lower() not in formats:
        raise SinkflowError(f"{flag} {path} does not end in an image format matplotlib writes",
                            f"use one of .{', .'.join(sorted(formats))}, e.g. {cli}lr_find.png")
    if path.is_dir():
        raise SinkflowError(f"{flag} {path} is a folder", f"name a file, e.g. {cli}{path / 'lr_find.png'}")


def plot(res: LRFindResult, path: Path, title: str = "") -> Path:
    check_plot_path(path, "plot path")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(res.lrs, res.losses, color="0.75", lw=1, label="loss")
    ax.plot(res.lrs, res.smoothed, color="C0", lw=2, label="smoothed (EMA, bias-corrected)")
    if res.skipped:
        ax.plot([res.lrs[i] for i in res.skipped], [res.losses[i] for i in res.skipped], "x", color="C3", ms=4,
                label="update skipped (float16 GradScaler)")
    for (name, lr), c in zip(res.suggestions.items(), ("C2", "C1", "C3")):
        ax.axvline(lr, color=c, ls="--", lw=1, label=f"{name} {lr:.1e}")
    ax.set_xscale("log")
    finite = [v for v in res.smoothed if math.isfinite(v)]
    if finite:
        lo, hi = min(finite), max(finite[: max(3, len(finite) // 2)])
        ax.set_ylim(lo - 0.1 * (hi - lo + 1e-12), hi + 0.5 * (hi - lo + 1e-12))
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss")
    ax.set_title(title or "LR range test")
    ax.legend(fontsize=8)
    fig.tight_layout()
    from sinkflow.eval.plots import save_figure

    return save_figure(fig, path, dpi=120)


def checked_update(trainer, batch):
    """``trainer.checked_step(batch)``'s loss, and under float16 whether GradScaler applied the update (one read of
    Adam's step count): a skipped one is ``UnappliedStep``, or, with the scale below 1, non-finite (``NonFiniteStep``
    naming the precision key), as the loop's ``Trainer.raise_if_non_finite`` stops on it. For the tools that take
    single steps and read each loss (lr-find's sweep, doctor's overfit rules): a skipped step's loss is the weights'
    as they were, not a step's result, and doctor counted it as one (a flat loss read as a broken loop)."""
    from sinkflow.engine.finite import optimizer_steps

    before = optimizer_steps(trainer.optimizer) if trainer.scaler.is_enabled() else 0
    loss = trainer.checked_step(batch)
    if trainer.scaler.is_enabled() and optimizer_steps(trainer.optimizer) == before:
        scale = trainer.scaler.get_scale()
        if scale < 1.0:
            trainer.stop_non_finite(f"float16 loss scale {scale:.2g} (Inf/NaN gradients even unscaled)",
                                    trainer.step + 1, f"set train.{trainer.task.model_key}.precision=bf16 (or fp32), "
                                    "or lower the learning rate")
        raise UnappliedStep(float(loss))
    return loss


def phase_lr_find(trainer, progress_mode: str = "0", **kwargs) -> LRFindResult:
    """``lr_range_test`` on a ready Trainer (``sinkflow.tools.phases.ready_trainer``) through its own
    ``train_step`` (accumulation, clipping, autocast, GradScaler, channels_last, EMA: the step its loop takes),
    on its own batches; the trainer's whole state (model, optimizer, scheduler, scaler, EMA, generator, RNG,
    step) is restored afterwards from its ``state_dict``, and the gradients, which it does not hold: the sweep's
    last step left its own on every parameter (one more copy of the weights on the device after the sweep).
    ``progress_mode``: how its steps are shown (``runtime.callbacks.progress_mode``; "0": not at all)."""
    saved = copy.deepcopy({"step": trainer.step, **trainer.state_dict()})
    grads = [None if p.grad is None else p.grad.detach().clone() for p in trainer.model.parameters()]  # usually none
    batches = [trainer.batch]

    def batch_fn(i):
        if i < len(batches):
            return batches[i]
        return trainer.draw_batch(trainer.cfg["batch_size"])

    graph = trainer.step_graph if trainer.captures_steps else None
    replayed = graph.replays if graph is not None else 0
    try:  # a step the device skipped is a gap (NonFiniteStep), and the next one is applied
        res = lr_range_test(trainer.model, trainer.optimizer, None, batch_fn,
                            train_step=lambda batch: checked_update(trainer, batch), restore=False,
                            progress=(f"lr-find {trainer.name}", progress_mode), **kwargs)
    finally:
        trainer.load_state_dict(saved, "the state before lr-find")
        for p, g in zip(trainer.model.parameters(), grads):
            p.grad = g
    if graph is not None:
        res.replays = graph.replays - replayed
    return res


def step_path(trainer, res: LRFindResult) -> str:
    """The step the sweep's rates were measured through: precision, compiled or not, the step graph (and on CUDA how
    many steps were replays of the captured step). Why: the rate belongs to that path (digits' velocity phase on the
    CPU: float16 went non-finite from 1.15e-01, float32 diverged at 3.27), and a log of a sweep on a card said
    neither, so whether it had run the CUDA default (fp16, the whole step one graph) was nowhere to be read."""
    key = trainer.task.model_key
    precision = {"fp16": "fp16 (autocast, GradScaler)", "bf16": "bf16 (autocast)"}.get(trainer.precision, "fp32")
    compiled = "eager" if trainer.compile_mode is None else f"compiled ({trainer.compile_mode})"
    if trainer.step_graph is None:
        graph = "no step graph"
    elif res.replays is None:
        graph = "the step graph's path run eagerly (nothing is captured on a CPU)"
    else:
        graph = f"the whole step one CUDA graph ({res.replays} of {len(res.lrs)} steps replays of it)"
    return (f"{trainer.name} on {trainer.device.type}: {precision}, {compiled}, {graph} "
            f"(train.{key}.precision / compile / graph)")


def write_target(target: Path, flag: str = "--write") -> tuple[Path, bool]:
    """(path, is a run folder) for ``--write``: a run folder (it holds config.yaml; ``RUN/config.yaml`` means
    ``RUN``, so the run's lock and checks apply) or a YAML config file (a name ending in .yaml/.yml). Anything
    else is refused, so a typo never leaves a stray YAML file under the name typed."""
    target = Path(target)
    if target.name == "config.yaml" and target.is_file() and (target.parent / "meta.json").is_file():
        target = target.parent  # a run folder's own config file: written as the run, never around its checks
    if target.is_dir():
        if not (target / "config.yaml").is_file():
            raise SinkflowError(f"{flag} {target} is a folder but not a sinkflow run folder (no config.yaml)",
                                "pass the run folder `sinkflow train` printed when it started, or a .yaml file")
        return target, True
    if target.suffix.lower() not in (".yaml", ".yml"):
        raise SinkflowError(f"{flag} {target} is neither a run folder nor a YAML config file (.yaml)",
                            "pass the run folder `sinkflow train` printed when it started (it holds config.yaml), "
                            "or a file name ending in .yaml")
    from sinkflow.data.atomic_write import write_refused  # here: the arguments are checked before torch loads

    why = None  # before the sweep: `--write /proc/new.yaml` failed after it, the plot written
    if target.exists():
        try:
            open(target, "a").close()  # opened for appending, nothing written: its bytes and time stay
        except OSError as exc:
            why = exc.strerror or str(exc)
    else:
        why = write_refused(target.parent)
    if why is not None:
        raise SinkflowError(f"{flag} {target} cannot be written ({why})", "name a .yaml file in a folder you can write")
    return target, False


def refuse_other_recipe(target: Path, swept_cfg: dict, model_key: str) -> None:
    """Refuse to ``--write`` a rate into a run or YAML file whose recipe for the phase is not the sweep's: a method
    without the phase (`lr-find flow-digits --write` a NSGF run wrote train.flow.lr, which no phase reads), other
    data, another network, another batch (the best rate moves with it: a larger batch's gradient is less noisy). A
    YAML file not yet written has nothing to compare; its own errors are the config reader's."""
    from sinkflow import config as config_mod
    from sinkflow.config import schema
    from sinkflow.runtime.run_folder import DATA_PATH_KEYS, absolute_data_paths, read_config

    target, is_run = write_target(target)
    if not (is_run or target.is_file()):
        return
    theirs = read_config(target) if is_run else config_mod.load_config_file(str(target))
    fix = (f"sweep the run itself: sinkflow lr-find {target} --write {target}" if is_run else
           f"sweep with its recipe: sinkflow lr-find {target} --write {target}")
    key = f"train.{model_key}.lr"
    if key not in schema.used(theirs):
        raise SinkflowError(f"--write {target}: it trains no phase that reads {key} (method "
                            f"{theirs['experiment']['method']}), so the rate would go unread", fix)
    batch = f"train.{model_key}.batch_size"
    shaping = ("experiment.method", "data.", f"model.{model_key}.", batch)
    mine, other = (config_mod.flatten(absolute_data_paths(c, DATA_PATH_KEYS)) for c in (swept_cfg, theirs))
    for k in sorted({*mine, *other}, key=lambda k: (k != batch, k)):
        if k.startswith(shaping) and k not in ("data.root", "data.download") and mine.get(k) != other.get(k):
            why = "the best rate moves with the batch" if k == batch else "a rate is measured for one recipe"
            raise SinkflowError(f"--write {target}: the sweep runs {k}={mine.get(k)!r}, {target} has "
                                f"{other.get(k)!r} ({why})", fix)


def refuse_finished_phase(run_dir: Path, key: str, phase: str | None = None) -> None:
    """Refuse to write ``key`` (``train.<model>.lr``) into a run whose phase has finished: it trained with the rate
    config.yaml holds, a new one would have no effect and make config.yaml lie; ``train --resume`` refuses the
    same change (``sinkflow.engine.experiment.verify``). ``phase`` defaults to the model key (a phase's name, as
    ``TrainingStep`` defaults it)."""
    from sinkflow import config as config_mod
    from sinkflow.runtime.run_folder import read_config

    cfg = read_config(run_dir)
    phase = phase or key.split(".")[1]
    if (Path(run_dir) / "checkpoints" / phase / "final.pt").is_file():
        old = config_mod.get(cfg, key)
        raise SinkflowError(f"cannot write {key} to {run_dir}: phase '{phase}' has finished (trained with "
                            f"{key}={old!r}), so the change would have no effect",
                            f"drop --write, or start a new run with {key}=RATE (the rates are printed without it)")


def write_lr(target: Path, key: str, lr: float, phase: str | None = None, swept: dict | None = None) -> Path:
    """Write ``key=lr`` into a run folder's config.yaml (type-checked, under the run's lock, refused when the
    phase has finished: ``refuse_finished_phase``) or a YAML config file (``write_target``). A config file that does
    not exist yet is written whole: ``swept`` (the config the sweep ran) with the rate, so `sinkflow train FILE`
    trains the recipe the rate was measured on (the rate alone trained the schema's defaults, another recipe)."""
    import yaml

    from sinkflow import config as config_mod
    from sinkflow.runtime.run_folder import read_config

    target, is_run = write_target(target, "write target")
    if is_run:
        from sinkflow.runtime.checkpoint import PhaseCheckpoints
        from sinkflow.runtime.lock import run_lock
        from sinkflow.runtime.run_folder import record_changes, write_config

        with run_lock(target):  # not while a `sinkflow train` writes the same run
            refuse_finished_phase(target, key, phase)  # again: a train may have finished it during the sweep
            cfg = read_config(target)
            old = config_mod.get(cfg, key)
            config_mod.set_key(cfg, key, float(lr))
            write_config(target, cfg)
            phase = phase or key.split(".")[1]
            steps = PhaseCheckpoints(target / "checkpoints" / phase).steps()  # where a resume continues it
            record_changes(target, [(key, old, float(lr), phase, steps[-1][0] if steps else 0)])
        return target / "config.yaml"
    if swept is not None and not target.exists():
        tree = copy.deepcopy(swept)
        config_mod.set_key(tree, key, float(lr))
        tree["experiment"]["name"] = None  # swept from a run: a run of this file gets a folder of its own
        target.write_text(config_mod.dump(tree))
        return target
    fix = "fix it, or write to a new .yaml file"
    tree = config_mod.parse_yaml(config_mod.read_yaml_text(target, str(target), fix), str(target), fix) \
        if target.is_file() else {}
    node = tree = tree or {}
    if not isinstance(tree, dict):
        raise SinkflowError(f"{target} does not hold a config tree", "write to a YAML file of key: value sections")
    from sinkflow.data.atomic_write import atomic_write_text

    text = config_mod.read_yaml_text(target, str(target), fix) if target.is_file() else ""
    span = _scalar_span(text, key)
    if span is not None:  # the value's own characters replaced: the file's comments, layout and line ends stay
        atomic_write_text(target, text[:span[0]] + f"{float(lr):.6g}" + text[span[1]:])
        return target
    if text and key not in config_mod.flatten(tree):  # appended as one dotted key, which the config reader takes:
        newline = "\r\n" if "\r\n" in text else "\n"  # rewriting the file whole dropped every comment of it
        end = "" if text.endswith(("\n", "\r")) else newline
        atomic_write_text(target, f"{text}{end}{key}: {float(lr):.6g}  # sinkflow lr-find --write{newline}")
        return target
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = float(lr)
    atomic_write_text(target, yaml.safe_dump(tree, sort_keys=False))
    return target


def _scalar_span(text: str, key: str) -> tuple[int, int] | None:
    """Where ``key``'s scalar value is written in the YAML ``text`` (start, end character offsets), or None. A file
    from `sinkflow config PRESET > my.yaml` is commented: rewriting it whole dropped all 87 lines of comments."""
    import yaml

    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    for part in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        node = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
    if not isinstance(node, yaml.ScalarNode) or node.style is not None:  # quoted or block: rewrite it whole
        return None
    return node.start_mark.index, node.end_mark.index
