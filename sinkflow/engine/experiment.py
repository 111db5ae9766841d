"""Run an experiment: ``train_run`` (the one entry point of `sinkflow train` and ``sinkflow.train``) and
``run_phases`` (each unfinished phase through its ``Trainer``; finished phases are skipped)."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
import time
from typing import Iterable

import torch

from sinkflow import config as config_mod
from sinkflow.config import schema
from sinkflow import data, methods
from sinkflow.data import sample_shape
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import TrainingStep
from sinkflow.runtime import dist
from sinkflow.runtime.callbacks import Callback
from sinkflow.runtime.data_record import check_split, check_split_files, record_split
from sinkflow.runtime.lock import unlock_run
from sinkflow.runtime.rng import phase_generator
from sinkflow.runtime.run_folder import DATA_PATH_KEYS, RunFolder, absolute_data_paths, build_phase_model
from sinkflow.runtime.signals import Interrupted, graceful_stop, stop_requested
from sinkflow.runtime.state_check import check_final, check_step_state
from sinkflow.engine.trainer import Trainer

log = logging.getLogger("sinkflow")


def run_phases(run, phases, callbacks: Iterable[Callback] = (), deadline: float | None = None,
               report: bool = False, time_limit: float | None = None) -> None:
    """Each unfinished task through its own ``Trainer`` (``callbacks`` go to every one of them); past the
    ``time.monotonic()`` ``deadline`` (the time limit) the run stops as on SIGTERM: within a phase at its next step,
    between two phases before the next starts, and after the last only where a ``report`` would follow (it is
    skipped as asked; with none to skip, a finished run is finished: exit 0, not 124 and a resume to run). Every
    heartbeat records how the run was launched (processes, report, the session's ``time_limit`` in seconds), from
    which `sinkflow status` gives the resume command the CLI printed (``runtime.relaunch.resume_command``)."""
    callbacks = list(callbacks)
    finished: list[str] = []  # phases a resume skips: the caller's callbacks get the state they ended with
    last, pending = None, None  # pending: a stop agreed at the last phase's end (Trainer.stop_at_end)
    run.logger.record_launch(world=dist.current().world, per_node=dist.per_node(), no_report=not report,
                             time_limit=time_limit)
    with graceful_stop(deadline):
        for task in phases:
            if run.phase_done(task.name):
                log.info("phase %s already finished: skipped", task.name)
                finished.append(task.name)
                continue
            if finished and callbacks:
                restore_callback_states(run, finished, callbacks)
                finished = []
            if last is not None and (signum := stopping(pending)) is not None:
                run.logger.heartbeat(phase=last[0], step=last[1], state="stopped", signal=signum,
                                     **batch_fields(*last[2:]))  # not DEAD
                raise Interrupted(signum, *last)  # a phase just ended on the stop: the next is the resume's
            run.logger.heartbeat(phase=task.name, step=0, state="starting")
            trainer = None
            try:
                trainer = Trainer(run, task, callbacks)
                trainer.fit()
                if trainer.stopped:  # a callback's trainer.stop(): no final.pt, so neither a later phase (which may
                    # read this one's output) nor "finished" in status.json: the run went on and said FINISHED
                    raise SinkflowError(f"a callback ended phase '{task.name}' at step {trainer.progress} with "
                                        "trainer.stop(), which writes nothing: the phase is not finished",
                                        "call trainer.request_stop() to stop with a checkpoint to resume from "
                                        "(sinkflow train --resume RUN)", every_rank=True)  # under torchrun each
                    # rank's callback stops alike (the run's callbacks are every rank's): rank 0 says it, not each
            except Interrupted as exc:  # `sinkflow status` says STOPPED (checkpoint saved), not DEAD
                run.logger.heartbeat(phase=exc.phase, step=exc.step, state="stopped", signal=exc.signum,
                                     **batch_fields(exc.done, exc.of), **phase_total(trainer))
                raise
            except KeyboardInterrupt as exc:  # a second signal (StopNow), or a notebook's KeyboardInterrupt raised
                # in the loop (a callback's, a SIGALRM handler's): stopped at once, from the last checkpoint (status
                # said DEAD, "pid ... is another process now", of the kernel that lives on)
                run.logger.heartbeat(phase=task.name, step=getattr(trainer, "progress", None), state="stopped",
                                     signal=getattr(exc, "signum", None), at_once=True,
                                     **batch_fields(*task_batches(trainer)), **phase_total(trainer))
                raise
            except Exception as exc:  # `sinkflow status` says FAILED and why (a resume would fail the same way)
                step = getattr(exc, "step", None)  # the failing step where the error knows it (a non-finite one)
                run.logger.heartbeat(phase=task.name, step=step if isinstance(step, int) else
                                     getattr(trainer, "progress", None), state="failed",
                                     **batch_fields(*task_batches(trainer)), **phase_total(trainer),
                                     error=(f"{dist.PEER_LOST} (its own output says why)" if dist.peer_lost(exc)
                                            else " ".join(str(exc).split())[:500] or type(exc).__name__))
                raise
            last = (task.name, trainer.step, *task_batches(trainer))  # steps, or pool chunks and batches
            pending = trainer.stop_at_end
            del trainer  # the trainer (model, optimizer, buffers) is dropped here
            run.release()
        run.logger.heartbeat(phase="done", state="finished")
        run.logger.flush()
        signum = stopping(pending) if report else None  # every rank, or one would report alone
        if signum is not None and last is not None:  # a signal after the last step check: the report
            # (minutes on images) is skipped as asked; all is saved, and status says FINISHED
            raise Interrupted(signum, *last)


def restore_callback_states(run, finished: list[str], callbacks: list[Callback]) -> None:
    """A resume that starts a phase afresh after ``finished`` ones: the caller's callbacks get the state they had when
    the last finished training phase ended (its final.pt holds every callback's ``state_dict``). A stop between two
    phases (``request_stop`` or a signal at a phase's last step, a time limit) saved their state there alone, and the
    next phase has no step checkpoint to hand it back: a callback counting the run's steps restarted at 0. A phase
    resumed from its own step checkpoint then loads that checkpoint's, as before."""
    for name in reversed(finished):
        saved = run.final_state(name).get("callbacks")
        if saved is None:  # the pool's final.pt: no trainer state
            continue
        for cb in callbacks:
            if cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])
        return


def stopping(pending: int | None) -> int | None:
    """The stop the run makes between phases: one the last phase agreed at its end (a callback's ``request_stop`` at
    its last step or unit, which went unheard: the next phase started), else a signal's, agreed by every rank."""
    return pending if pending is not None else dist.agree_stop(stop_requested())


def batch_fields(done: int | None, of: int | None) -> dict:
    """A chunked phase's (the pool's) recorded batches for a stopped or failed heartbeat, as its bar counts them:
    its ``progress`` alone was shown as "pool  step 40" by status (a plain stop said "step 4", its chunks)."""
    return {"done": done, "of": of, "unit": "batches"} if of else {}


def phase_total(trainer) -> dict:
    """A training phase's steps in all, for a stopped or failed heartbeat: status said "velocity  step 5" of a
    failed run where a running one says "step 5/60 (8.3%)"."""
    return {"total": trainer.total} if trainer is not None and trainer.training else {}


def task_batches(trainer) -> tuple[int | None, int | None]:
    """A chunked task's (the pool's) batches done and in all; (None, None) for a training phase, or before the
    trainer was built."""
    if trainer is None or trainer.training:
        return None, None
    return trainer.task.progress_done, trainer.task.progress_total


FID_PACKAGES = ("torchmetrics", "torch_fidelity")  # FID's metric and its Inception-v3 (sinkflow.eval.images)


def check_run(cfg: dict, machine: bool = True) -> None:
    """The data and the method's limits (e.g. NSGF++: T <= 5, the pool's size), before any folder exists; with
    ``machine``, what this machine must hold too (the pool's free disk: ``Method.check_machine``)."""
    check_runs_outside_images(cfg)
    data.distributions(cfg)[1].check_test_n(cfg["eval"]["n"])  # a point file's held-out rows: the only test points
    method, shape = methods.of(cfg), data.sample_shape(cfg)
    method.check(cfg, shape)
    networks = [phase for phase in schema.METHOD_PHASES[method.name] if phase in cfg["model"]]
    for phase in networks:  # each network against the data's shape, allocating nothing
        with torch.device("meta"):  # (a UNet on 2D points, heads that do not divide its widths)
            build_phase_model(cfg, phase, shape)
    if machine:
        check_machine(cfg, shape)


def check_runs_outside_images(cfg: dict) -> None:
    """An image folder must not hold the run folders: every image under data.path is read, so a run's own plots
    (grid.png, trajectory_strip.png) became images of the set, and its eval and resume were refused as "images have
    different sizes" or "its data changed" (a next run trained on them). `sinkflow train folder data.path=.` did it."""
    path = cfg["data"].get("path")
    if not path or "folder" not in (cfg["data"].get("source"), cfg["data"].get("target")):
        return
    images = Path(path).expanduser().resolve()
    runs = Path(cfg["experiment"]["runs_dir"]).expanduser().resolve()
    if runs == images or images in runs.parents:
        raise SinkflowError(f"experiment.runs_dir={cfg['experiment']['runs_dir']} is inside data.path={path}: the "
                            "run's plots would be read as images of the set", "put the images in a folder of their "
                            "own, or set experiment.runs_dir to a folder outside data.path")


def check_machine(cfg: dict, shape: tuple[int, ...]) -> None:
    """What this machine must hold for the run, before any folder exists: room on the disk (``Method.check_machine``)
    and, where the report computes FID, its weights file, its packages and 2 held-out images. ``sinkflow train``
    refuses the run on it; preflight reports it as its own check (planning on a laptop for a rented GPU)."""
    methods.of(cfg).check_machine(cfg, shape)
    check_fid(cfg)


def check_fid(cfg: dict, resume=None, report: bool = True) -> None:
    """Where the report computes FID: its weights file, 2 held-out images to score and its packages (``check_machine``;
    a resume calls it alone, before its config.yaml is written: it skipped them, trained every phase left and was
    refused at the report, with the bad value kept in config.yaml, where `sinkflow eval` cannot change it): its fix
    then names the resume's commands."""
    try:
        _check_fid(cfg)
    except SinkflowError as e:
        if resume is None:
            raise
        other = "; or resume with --no-report to train on without the report" if report else ""
        raise SinkflowError(e.problem, f"{e.fix}, as `sinkflow train --resume {resume} key=value`{other}") from None


def _check_fid(cfg: dict) -> None:
    weights = cfg["eval"]["inception_weights"]  # refused after every phase had trained, at the report
    if weights and "eval.inception_weights" in schema.used(cfg):
        if not Path(weights).expanduser().is_file():
            raise SinkflowError(f"eval.inception_weights={weights} is not a file",
                                "point it at a local pt_inception-2015-12-05 weights file or set it to null")
        held = len(data.distributions(cfg)[1].test_images)  # the report scores min(eval.n, held) images
        if min(cfg["eval"]["n"], held) < 2:  # held_out's own refusal, after every phase had trained
            raise SinkflowError(f"FID of {min(cfg['eval']['n'], held)} image (eval.n={cfg['eval']['n']}, {held} "
                                "held-out): a Fréchet distance fits a covariance to each side's features, so it "
                                "needs at least 2", "use eval.n=2 or more with 2 or more held-out images (a "
                                "folder holds out every tenth), or set eval.inception_weights=null")
        missing = [m for m in FID_PACKAGES if importlib.util.find_spec(m) is None]
        if missing:  # the same report's "FID needs ...", after every phase had trained
            raise SinkflowError(f"eval.inception_weights is set but FID needs {' and '.join(missing)}, not "
                                "installed here", "pip install torchmetrics torch-fidelity, or set "
                                "eval.inception_weights=null")


def check_ranks_agree(cfg: dict, extra: dict | None = None) -> None:
    """Under torchrun: every rank runs this config (and ``extra``: the folder a resume continues), or every rank stops
    with one line naming the first differing key (``dist.check_same``). The keys the run reads, and where run folders
    go, as an absolute path: two nodes started in different folders refused a 2D run for a ``data.root`` it never
    reads, and put its run folders in two places without a word."""
    if not dist.current().enabled:  # one process: nothing to compare, no start-up cost
        return
    flat, read = config_mod.flatten(cfg), schema.used(cfg)
    runs_dir = str(Path(flat["experiment.runs_dir"]).expanduser().resolve())
    dist.check_same({**(extra or {}), **{k: v for k, v in flat.items() if k in read},
                     "experiment.runs_dir": runs_dir, dist.CWD: os.getcwd()})


def train_run(cfg: dict | None = None, *, resume: str | Path | None = None, overrides: list[str] | None = None,
              shorthands: dict | None = None, callbacks: Iterable[Callback] = (), device: str | None = None,
              on_open=None, then=None, preset: str | None = None, call: str | None = None,
              time_limit: float | None = None) -> RunFolder:
    """Train every unfinished phase of a resolved config ``cfg`` (``sinkflow.config.resolve``), or continue the
    run folder ``resume`` (with ``overrides`` / ``shorthands`` of keys it may still change); returns the run.

    Every check comes first: nothing is written into a run folder before ``RunFolder.start()`` (docs/reliability.md).
    ``on_open(run)`` is called once the folder is known (the CLI remembers it for its resume hint); a stop by
    signal raises ``Interrupted`` with ``run_dir`` set. ``then(run)`` runs after the last phase, while the run
    still holds its folder's lock and logger (the CLI's evaluation report, unless ``--no-report``). A ``preset``
    named beside ``resume`` must be the run's own; ``call``, the Python call that started a new run, goes into its
    meta.json (``RunFolder.create``). ``time_limit``: seconds from this call after which the run stops at the next
    step boundary with a checkpoint (``Interrupted`` with ``signals.TIME_LIMIT``), the report skipped, as on SIGTERM."""
    deadline = None if time_limit is None else time.monotonic() + time_limit
    if (cfg is None) == (resume is None):
        raise ValueError("train_run needs exactly one of cfg (a new run) or resume (a run folder)")
    info = dist.init(device or "auto")
    if resume is not None:
        run = dist.on_every(lambda: RunFolder.open(Path(resume), overrides, shorthands))  # frozen keys: no writes
        check_ranks_agree(run.cfg, {"--resume": str(Path(resume).resolve())})  # the overrides' result, every rank
        if preset is not None and config_mod.is_config_file(preset):  # its preset is what it inherits, not its name
            raise SinkflowError(f"cannot resume {resume} with the config file '{preset}': a resume reads the run's own "
                                "config.yaml, which the file made when the run started",
                                f"drop the file (`sinkflow train --resume {resume}`), giving any key to change as "
                                "key=value", every_rank=True)  # every rank's command is the same (checked above)
        if preset is not None and preset != run.cfg["experiment"]["preset"]:
            raise SinkflowError(f"cannot resume {resume} as preset '{preset}': it is a run of preset "
                                f"'{run.cfg['experiment']['preset']}'",
                                f"drop the preset name (`sinkflow train --resume {resume}`) or start a new run "
                                f"with `sinkflow train {preset}`", every_rank=True)
    else:
        check_ranks_agree(absolute_data_paths(cfg, DATA_PATH_KEYS))  # before any folder
        dist.on_every(lambda: check_run(cfg))  # every rank refuses alike: rank 0 says it once
        run = RunFolder.create(cfg, call=call)
    if on_open is not None:
        on_open(run)
    try:
        cfg = run.cfg
        if resume is not None:  # the pool checks its free disk when it opens, counting the blocks its arrays hold
            dist.on_every(lambda: (check_split_files(run, data.target_split_info(cfg)),  # changed images: refused
                                   check_run(cfg, machine=False)))  # before they are decoded
            if then is not None or "eval.inception_weights" in run.changes():  # the report's FID (or the new path)
                dist.on_every(lambda: check_fid(cfg, resume, report=then is not None))  # before config.yaml holds it
        if dist.current().enabled:  # rank 0 decodes an image set into its cache under data.root first, the other
            # ranks then read it (every rank decoded the same images at once: 8 GPUs, 8 decodes; a data error is
            # every rank's one line); alone, the call below is the only one
            dist.on_main(lambda: data.distributions(cfg))
        source, target = data.distributions(cfg)
        method = methods.of(cfg)
        phases = methods.phases(cfg, source, target)
        if resume is not None:
            dist.on_every(lambda: (verify(run, phases),  # finished phases' final.pt and the newest step checkpoint
                                   check_split(run, source, target)))  # (safe, this run's), the data's hashes
        run.start()  # the lock (one writer per run folder), the resumed config, orphaned temp files
        if info.is_main:
            record_split(run, source, target)
        if info.is_main:
            log.info("run folder: %s", run.dir)
            log.info("method %s", method.describe(cfg))
            unread = config_mod.unread_preset_keys(cfg)
            if unread and resume is None:  # keys for the preset's other methods: a note; anything else: a warning
                keys = ", ".join(unread[:4]) + (", ..." if len(unread) > 4 else "")
                if config_mod.read_by_other_methods(cfg, unread):
                    log.info("preset %s also holds %s for its other methods (--method); this %s run does not read "
                             "them", cfg["experiment"]["preset"], keys, method.name)
                else:
                    log.warning("preset %s sets %d key(s) that method %s does not read (%s): kept in config.yaml, "
                                "unused", cfg["experiment"]["preset"], len(unread), method.name, keys)
        try:
            run_phases(run, phases, callbacks, deadline, report=then is not None, time_limit=time_limit)
        except Interrupted as exc:
            exc.run_dir = run.dir
            raise
        if then is not None:
            then(run)
    finally:
        run.logger.close()
        unlock_run(run.dir)
    return run


def verify(run, phases) -> None:
    """Everything a resume will read, checked before anything in the run folder changes (docs/reliability.md).

    Every finished phase's ``final.pt`` loads, belongs to the run and holds weights of the configured
    model's names, shapes and dtypes; the first unfinished phase's newest step checkpoint holds everything
    the Trainer restores (weights, Adam moments, schedule, generator and RNG states); and no override changes
    a training key of a phase that has already finished (it would have no effect, so config.yaml would lie).
    Tells the run where it resumes and the model keys of the training phases still to train
    (``RunFolder.plan_resume``), for the change log ``RunFolder.start`` writes."""
    changed = run.changes()
    at, to_train, phase_keys = None, [], {}
    for task in phases:
        training = isinstance(task, TrainingStep)
        if training:
            phase_keys[task.name] = task.model_key
        content = (lambda state, where, task=task: check_final(state, _meta_model(run, task), where)) if training else None
        if run.phase_done(task.name, check=content):
            task.check_done(run)  # what later phases read of its output (the pool's arrays)
            if training:
                prefix = f"train.{task.model_key}."
                for key, (old, new) in changed.items():
                    if key.startswith(prefix) and key in run.shorthand_keys:  # `--train-iters`: the phases to come
                        run.keep_on_disk(key)
                        log.info("resume: %s stays %r (phase '%s' has finished; the shorthand reaches the phases "
                                 "still to train)", key, old, task.name)
                    elif key.startswith(prefix):
                        raise SinkflowError(
                            f"cannot resume {run.dir} with {key}={new!r}: phase '{task.name}' has finished (trained "
                            f"with {key}={old!r}), so the change would have no effect",
                            "drop that override, or start a new run with it")
            continue
        if training:
            to_train.append(task.model_key)
        if at is None:
            step = task.check_resume(run)  # what it left besides step checkpoints (a half-built pool: its chunks)
            if training:
                ckpts = run.checkpoints(task.name)
                latest = ckpts.latest()
                if latest is not None:
                    step = latest["step"]
                    iters = run.cfg["train"][task.model_key]["iters"]
                    if step > iters:  # the phase would end at once, its final.pt at `step`, config.yaml saying iters
                        raise SinkflowError(
                            f"cannot resume {run.dir} with train.{task.model_key}.iters={iters}: phase '{task.name}' "
                            f"is already at step {step}", f"set train.{task.model_key}.iters={step} or more (or "
                            "leave it as it was)")
                    generator = phase_generator(run.cfg["experiment"]["seed"], "train", task.name)
                    train = run.cfg["train"][task.model_key]
                    check_step_state(latest, _meta_model(run, task), generator, str(ckpts.steps()[-1][1]),
                                     ema=train["ema"] > 0, scaler=train["precision"] == "fp16")
            at = (task.name, step)
    run.plan_resume(at or ("done", None), to_train, phase_keys)


def _meta_model(run, task) -> torch.nn.Module:
    """The phase's network on the meta device: its names, shapes and dtypes without allocating it."""
    with torch.device("meta"):
        return build_phase_model(run.cfg, task.model_key, sample_shape(run.cfg))
