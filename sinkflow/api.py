"""The Python API: the whole pipeline in two calls, or its parts in your own training loop.

    run = sinkflow.train("moons", train_iters=2000)         # same presets, keys, checks and engine as `sinkflow train`
    x = run.sample(1024, steps=10)                          # (1024, 2) samples from the trained model

The parts (``sinkhorn_velocity``, ``simulate_sinkhorn_flow``, ``w2``, ``build_model``, ``euler``, the
distributions and the methods' tasks) are the same objects the CLI uses, re-exported here; the README and
``examples/`` show them in a loop of your own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch

from sinkflow import methods
from sinkflow.config import schema
from sinkflow.config.checks import float_tensor, is_whole, shown
from sinkflow.errors import SinkflowError, require

log = logging.getLogger(__name__)


class Report(str):
    """``Run.evaluate()``'s table: a ``str``, shown as its lines where a notebook shows a cell's last value (IPython's
    ``_repr_pretty_``), which showed ``'W2 on moons ...\\n steps   NFE ...'`` on one line, quoted, its line breaks as
    ``\\n``. ``repr`` is a string's, as elsewhere."""

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        for i, line in enumerate(str(self).splitlines()):  # as IPython prints a multi-line repr
            if i:
                printer.break_()
            printer.text(line)


class Run:
    """A trained (or training) run folder: its config, its finished models, and sampling."""

    def __init__(self, run):
        self._run = run

    @property
    def dir(self) -> Path:
        return self._run.dir

    @property
    def cfg(self) -> dict:
        return self._run.cfg

    def model(self, phase: str | None = None) -> torch.nn.Module:
        """The frozen network a finished phase produced (EMA weights when the phase kept them); None: the method's
        first network (velocity; a flow's flow). A name that is not one of the method's network phases is refused
        as such: "has not finished" would send the user to `train --resume`, which never makes it."""
        method = methods.of(self.cfg).name
        phases = schema.METHOD_REGISTRY[method].phases  # the method's phases in order, as `sinkflow status`
        networks = [p for p in phases if p in schema.MODEL]  # those that train a network (model.<phase>)
        phase = networks[0] if phase is None else phase
        if phase not in networks:
            problem = (f"phase {phase!r} of method {method} trains no network" if phase in phases else
                       f"method {method} has no network phase {phase!r}")
            raise SinkflowError(problem, f"its networks: {', '.join(networks)}")
        from sinkflow.tools.data import sampling_data

        # the data's shape, no data set; building the network drew its init from the caller's torch stream
        with _cpu_default_device(), sampling_data(self.cfg, self.dir, draws=False), _float32_default(), _callers_rng():
            return self._run.model(phase)

    @torch.no_grad()
    def sample(self, n: int | None = None, steps: int | None = None, seed: int = 0,
               x0: torch.Tensor | None = None, qmc: bool | None = None, settings: dict | None = None) -> torch.Tensor:
        """``n`` samples (CPU float32 tensor shaped like the data) with ``steps`` integration steps (a whole number
        >= 1; None: the method's own, e.g. sample.steps; NSF steps for NSGF++), from ``x0`` or a source draw seeded by
        ``seed`` (a whole number in [0, 2**63 - 1], as `sample --seed`):
        i.i.d. by default, randomised QMC with ``qmc=True`` (None: ``sample.qmc``), as `sinkflow sample` draws.

        ``x0``: your own source draw, a tensor or numpy array shaped ``(n, *sample_shape)`` of any floating dtype
        (cast to float32, the dtype its networks were trained in, and moved to the run's device in chunks of
        ``sample.batch_size``, as a seeded draw is: a large x0 fits the card the evaluation fits); ``n`` may then be left out
        (it is ``len(x0)``), and if given must agree with it. Numbers may be numpy's. Everything is checked before
        any network runs, so a bad ``x0`` is one line naming the expected shape rather than a torch error from
        inside a network (or, for ``n`` != ``len(x0)``, ``len(x0)`` samples without a word). Samples that come out NaN
        or Inf are refused in one line naming the likely cause (float16's range, where the networks ran in fp16:
        ``sample.precision=fp16``, or ``auto`` for a UNet on a CUDA card; or a diverged model). A run copied without
        its data set (images, or a point-file target) samples all the same (``tools.data.sampling_data``).

        ``settings``: ``sample.*`` keys for this call only, as `sinkflow sample RUN sample.temperature=0.7` takes
        them (``{"temperature": 0.7}`` for a flow, ``{"time_warp": 0.5}``): checked as the command checks them, the
        run's config.yaml unchanged."""
        from sinkflow.tools.data import sampling_data

        run = self
        if settings:
            from sinkflow.tools.trained import with_sample_overrides
            from sinkflow.config.render import scalar

            require(isinstance(settings, dict), f"settings={shown(settings)} must be a dict of sample.* keys",
                    "e.g. settings={'temperature': 0.7}")
            overrides = [f"sample.{key}={scalar(value)}" for key, value in settings.items()]
            run = Run(with_sample_overrides(self._run, overrides, "sample", str(self.dir)))
        with _released([run._run], "sample"), _cpu_default_device(), sampling_data(run.cfg, run.dir), \
                _float32_default(), _callers_rng():
            return run._sample(n, steps, seed, x0, qmc)

    def _sample(self, n, steps, seed, x0, qmc) -> torch.Tensor:
        from sinkflow.data import sample_shape
        from sinkflow.data.base import check_sample_size

        method = methods.of(self.cfg)
        steps = _count("steps", steps, 10, "default", schema.MAX_EULER_STEPS)  # as `sample --steps`: 0 is no default
        method.check_steps(steps, "steps=")
        require(is_whole(seed, minimum=-(2**63)), f"seed={shown(seed)} must be a whole number",
                "e.g. seed=0 (numpy integers count)")  # np.int64 overflowed in the stream's hash, 1.5 was torch's error
        # `sample --seed`'s and experiment.seed's range: the streams are seeded modulo 2**63, so seed=-1 drew what
        # seed=2**63 - 1 draws and seed=2**63 what seed=0 draws (two seeds, the same samples)
        require(0 <= seed < 2**63, f"seed={shown(seed)} must be in [0, {2**63 - 1}]", "e.g. seed=0 (the default)")
        require(qmc is None or isinstance(qmc, (bool, np.bool_)), f"qmc={shown(qmc)} must be True, False or None",
                "e.g. qmc=True, or leave it out (None) for the run's sample.qmc")  # "yes" was taken as true
        if x0 is None:
            from sinkflow.data.memory import check_sample_memory
            from sinkflow.eval.points import generate

            if n is None:
                raise SinkflowError("sample() needs n or x0", "e.g. run.sample(1024), or run.sample(x0=noise)")
            check_sample_size(n)
            check_sample_memory(int(n), self.cfg, "n")  # as `sinkflow sample --n`: not an allocator's error
            qmc = self.cfg["sample"]["qmc"] if qmc is None else bool(qmc)
            return generate(self._run, int(n), steps or method.default_steps(self.cfg), int(seed), qmc=qmc)[0]
        if n is not None:
            check_sample_size(n)
        shape = tuple(sample_shape(self.cfg))
        rows = "n" if n is None else int(n)
        expected = f"({', '.join(map(str, (rows, *shape)))})"
        x0 = float_tensor(x0, "x0")
        require(x0.ndim >= 1 and tuple(x0.shape[1:]) == shape,
                f"x0 has shape {tuple(x0.shape)} but this run samples from {expected}",
                f"pass x0 shaped {expected}: one source draw of the run's sample shape per sample")
        require(x0.shape[0] >= 1, "x0 holds no samples", f"pass x0 shaped {expected} with at least one row")
        require(bool(torch.isfinite(x0).all()), f"x0 holds {int((~torch.isfinite(x0)).sum())} NaN or infinite "
                "value(s)", "pass finite source noise (it returned NaN samples in silence)")
        beyond = int((~torch.isfinite(x0.to(torch.float32))).sum())  # 1e300 in float64: inf in the networks' float32
        require(not beyond, f"x0 holds {beyond} value(s) beyond float32's range (|x| > 3.4e38), the dtype its "
                "networks compute in", "pass source noise of the run's scale (a sample was called a diverged model)")
        require(n is None or n == x0.shape[0], f"sample(n={rows}) but x0 holds {x0.shape[0]} samples",
                f"pass x0 shaped {expected}, or leave n out to sample one per row of x0")
        from sinkflow.eval.points import sample_chunks

        return sample_chunks(self._run, x0.detach().to(dtype=torch.float32), steps)[0]  # as `generate`: in chunks

    def evaluate(self, seeds: int | None = None, n: int | None = None, split: str = "test") -> Report:
        """The scores `sinkflow eval` prints (W2 table, or image / flow metrics; ``seeds`` / ``n`` / ``split`` as its
        --seeds / --n / --split: ``"val"`` scores an image run against its validation split), appended to
        metrics.jsonl as it does. The run's figures are left as training wrote them (it rewrote
        samples.png and trajectories.png, on a run opened "read only"). Checked as the command checks its flags,
        before any work: a whole number >= 1 each (0 meant the default in silence), ``n`` within the split and this
        machine's memory, and the count of every metric (``requested_evaluation``: the command's checks, in one
        place). A run folder that cannot be written is scored all the same, with a warning that the record was
        skipped, as the command does."""
        from sinkflow.eval.report import evaluate

        seeds, n = _count("seeds", seeds, 5, "eval.seeds"), _count("n", n, 1024, "eval.n")
        with _released([self._run], "eval"), _cpu_default_device(), _callers_rng(), _float32_default():
            try:
                text = evaluate(self._run, seeds=seeds, n=n, split=split, flags=("n", "split"))
            finally:  # as `sinkflow eval` ends: the record's TensorBoard events written out, its writer thread ended
                self._run.logger.close()
        if self._run.logger.failed is not None:
            from sinkflow.tools.trained import unrecorded

            log.warning("%s", unrecorded(self.dir / "metrics.jsonl", self._run.logger.failed))
        return Report(text)

    def scores(self) -> dict:
        """The latest evaluation's numbers as a dict (metrics.jsonl's last ``eval`` record, as ``evaluate``, `sinkflow
        eval` or the report after training wrote it; ``evaluate`` returns the printed table): keys carry the steps,
        e.g. ``w2_100``, ``w2_std_100`` and ``nfe_100`` for points, ``fd_cnn_2`` or ``t_hat_mean_2`` for images;
        ``split: val`` and ``sample`` say when they were scored on the validation split or with other sampling
        settings, ``precision`` when the networks were sampled in half precision (``sample.precision: auto`` on a CUDA
        card). {} before any."""
        from sinkflow.tools.status import tail_jsonl

        evals = [r for r in tail_jsonl(self.dir / "metrics.jsonl") if r.get("phase") == "eval"]
        if not evals:
            return {}
        own = {k: v for k, v in evals[-1].items() if k not in ("time", "phase", "step")}
        # an evaluation by an older sinkflow wrote a flow's bits/dim in records of their own before its sample
        # scores, all at one step: the records just before, at that step and with keys none of the later ones has
        for record in reversed(evals[:-1]):
            keys = {k for k in record if k not in ("time", "phase", "step")}
            if record.get("step") != evals[-1].get("step") or keys & own.keys():
                break
            own = {**{k: record[k] for k in keys}, **own}
        return own

    def __repr__(self) -> str:
        return f"sinkflow.Run({str(self.dir)!r})"


def train(preset: str = "8gaussians-moons", *, runs_dir: str | Path = "runs", name: str | None = None,
          device: str = "auto", time_limit: str | float | None = None, callbacks=(), **overrides) -> Run:
    """Train every phase of ``preset`` exactly as `sinkflow train` does and return the finished ``Run``.

    ``overrides``: shorthands (``train_iters=2000``, ``batch_size``, ``lr``, ``seed``, ``method="otcfm"``, every
    ``sinkflow.config.SHORTHANDS`` name) or dotted config keys passed as a dict (``**{"pool.batches": 64}``);
    the same resolution, checks and one-line errors as the CLI (``SinkflowError``), through the same engine
    entry point (``sinkflow.engine.experiment.train_run``), no argument parsing. The run folder is
    ``runs_dir/name`` (default: preset, method and time). ``time_limit`` ("8h30m", "90m" or seconds): past it the
    run stops at the next step with a checkpoint and raises ``sinkflow.Interrupted`` (its ``run_dir`` is the folder
    ``resume`` continues), as `sinkflow train --time-limit` does. ``callbacks``: your own
    ``sinkflow.runtime.callbacks.Callback`` objects, run after the engine's in every phase (docs/architecture.md,
    "Callback"): the hooks the CLI's tools use; their ``state_dict()`` rides in the step checkpoints.
    """
    from sinkflow import config, data
    from sinkflow.config.render import scalar
    from sinkflow.engine.experiment import train_run

    data.reread_images()  # images added to a folder since the last call: this run's data (a CLI run's is its own)
    preset, runs_dir = _path(preset, "preset"), _path(runs_dir, "runs_dir")  # a .yaml file may be a Path
    seconds, device, callbacks = _seconds(time_limit), _plain(device), _callbacks(callbacks)
    short, dotted = _overrides(overrides, {"device": device, "name": name})  # name None: preset, method and time
    cfg = config.resolve(preset, [f"experiment.runs_dir={scalar(str(runs_dir))}", *dotted], short)
    # meta.json records this call: the process's argv is the script's or the notebook kernel's
    call = _call_text(preset, {"runs_dir": str(runs_dir), "name": name, "device": device, **overrides})
    opened = []  # the run, once its folder is known (an out-of-memory line names it)
    with _released(opened), _cpu_default_device(), _callers_rng(), _float32_default(), _autograd(), \
            _absolute_run_dir(seconds):
        return open_run(train_run(cfg, device=device, call=call, time_limit=seconds, callbacks=callbacks,
                                  on_open=opened.append).dir)


def resume(path: str | Path, *, device: str = "auto", time_limit: str | float | None = None, callbacks=(),
           **overrides) -> Run:
    """Continue the run folder ``path`` exactly as `sinkflow train --resume` does (finished phases skipped, the
    same checks before anything is written) and return the finished ``Run``: the next session of a run that
    ``train(..., time_limit=...)`` stopped. ``overrides``: the keys a resume may still change, as in ``train``;
    ``callbacks``: as in ``train`` (a callback's saved state is handed back to it)."""
    from sinkflow import data
    from sinkflow.engine.experiment import train_run

    data.reread_images()  # as train: the files as they are now, which the run's record is checked against
    seconds, device, callbacks = _seconds(time_limit), _plain(device), _callbacks(callbacks)
    short, dotted = _overrides(overrides, {"device": None if device == "auto" else device}, ("device", "time_limit"))
    opened = []
    with _released(opened), _cpu_default_device(), _callers_rng(), _float32_default(), _autograd(), \
            _absolute_run_dir(seconds):
        return open_run(train_run(resume=Path(_path(path, "path")), overrides=dotted, shorthands=short,
                                  device=device, time_limit=seconds, callbacks=callbacks, on_open=opened.append).dir)


@contextlib.contextmanager
def _released(opened: list, command: str = "train"):
    """A run's error lets go of the run: a notebook keeps the last error (``sys.last_value``, for ``%debug``), and
    through its traceback's frames the failed phase's network, optimizer and batches, on the GPU, until the next
    error. After a CUDA out-of-memory error the retry with the fix (a smaller batch) found the card still holding
    them. The frames of a ``SinkflowError``, an ``Interrupted``, a second interrupt's ``StopNow`` and an out-of-memory
    error drop their variables (the traceback still prints; a bug's error keeps them, for ``%debug``). An out-of-memory
    error is the CLI's one line (``tools.oom``), naming the resume call, where it was torch's message (``Run.sample`` /
    ``evaluate``'s: the sampling batch to lower), and ``StopNow`` says what the command says of it, where it was a
    bare KeyboardInterrupt. ``opened``: ``train_run``'s run, or the run sampled (``command``)."""
    from sinkflow.runtime.signals import Interrupted, StopNow

    callers = sys.exc_info()[1]  # the error a call inside an ``except`` block chains: the caller's, left as it is
    try:
        yield
    except (SinkflowError, Interrupted) as exc:
        _drop_locals(exc, callers)
        raise
    except StopNow as exc:
        _drop_locals(exc, callers)
        where = str(Path(opened[0].dir).resolve()) if opened and command == "train" else None
        exc.args = (f"stopped at once by a second signal: the checkpoints written before are intact; continue it "
                    f"with sinkflow.resume({where!r})" if where else "stopped at once by a second signal",)
        raise
    except torch.OutOfMemoryError as exc:
        from sinkflow.tools.oom import oom_line

        _drop_locals(exc, callers)
        run = opened[0] if opened else None
        where = str(Path(run.dir).resolve()) if run is not None else None
        preset = run.cfg["experiment"]["preset"] if run is not None else None
        resume = _oom_resume(exc, run, where) if run is not None and command == "train" else None
        raise SinkflowError(oom_line(exc, command, where, preset, resume)) from None


def _oom_resume(exc: BaseException, run, where: str) -> str:
    """The call that continues a run stopped by an out-of-memory error, with ``tools.oom``'s fix as its override."""
    at = getattr(exc, "sinkflow_where", None) or {}
    train = run.cfg["train"].get(at.get("phase"))
    if at.get("training") and isinstance(train, dict) and "accum" in train:
        return f"sinkflow.resume({where!r}, **{{'train.{at['phase']}.accum': {2 * int(train['accum'])}}})"
    if at.get("phase") == "pool":
        return f"sinkflow.resume({where!r}, **{{'pool.in_flight': 1}})"
    return f"sinkflow.resume({where!r})"


def _drop_locals(exc: BaseException, callers: BaseException | None = None) -> None:
    """Clear the variables of the finished frames in ``exc``'s traceback and in those of the errors it chains, up to
    ``callers`` (the error being handled where the call was made) and what it chains: those frames are the caller's
    (a call inside an ``except`` block chains its error as the context), which the walk emptied for ``%debug``."""
    import traceback

    todo, seen = [exc], set()
    kept = [callers]
    while kept:  # the caller's errors: never cleared
        other = kept.pop()
        if other is not None and id(other) not in seen:
            seen.add(id(other))
            kept += [other.__cause__, other.__context__]
    while todo:
        exc = todo.pop()
        if exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            traceback.clear_frames(exc.__traceback__)
            todo += [exc.__cause__, exc.__context__]


@contextlib.contextmanager
def _absolute_run_dir(time_limit: float | None = None):
    """``Interrupted.run_dir`` absolute, as a ``Run``'s folder is: it was the run folder as the run named it
    (``runs/NAME``), and a notebook that changed directory (``os.chdir``, ``%cd``) before ``resume(e.run_dir)`` was
    told there is no run folder there. Its message ends with the call that continues the run (with the call's
    ``time_limit``), as the command's line ends with its `--resume` command: a notebook's interrupted cell said
    "checkpoint saved" alone."""
    from sinkflow.runtime.signals import Interrupted, format_duration

    try:
        yield
    except Interrupted as exc:
        if getattr(exc, "run_dir", None) is not None:
            exc.run_dir = Path(exc.run_dir).resolve()
            limit = "" if time_limit is None else f", time_limit={format_duration(time_limit)!r}"
            exc.args = (f"{exc.args[0]}; continue it with sinkflow.resume({str(exc.run_dir)!r}{limit})",)
        raise


@contextlib.contextmanager
def _callers_rng():
    """The caller's global RNG streams (random, numpy, torch) left as they were: a run seeds them with
    experiment.seed, as a script's run does, an evaluation draws from them, and the first ``Run.sample`` or
    ``Run.model`` of a folder built its networks with torch's stream (their init, then replaced by the saved
    weights); a notebook's own draws after the call came out otherwise."""
    from sinkflow.runtime.checkpoint import rng_state, set_rng_state

    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


@contextlib.contextmanager
def _float32_default():
    """torch's default dtype float32 for the call, as in a `sinkflow` command, and the caller's again after it: under a
    notebook's ``torch.set_default_dtype(torch.float64)`` the networks were built and trained in float64 (a float32
    session then refused their checkpoints), and a run trained in float32 could not be sampled or evaluated there
    (its final.pt "is not what this run expects", with the advice to delete it)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)


@contextlib.contextmanager
def _cpu_default_device():
    """torch's default device the CPU for the call, as in a `sinkflow` command, and the caller's again after it: under a
    notebook's ``torch.set_default_device("cuda")`` (or inside ``with torch.device(...)``) the tensors sinkflow makes
    without naming a device went there, beside CPU generators and data, and training and sampling failed in torch
    (a generator "of another device", "Tensor.item() cannot be called on meta tensors"). Where nothing was set (the
    usual case) nothing is done: torch's device mode costs a Python call on every torch function."""
    device = torch.empty(0).device  # the factory default (torch.get_default_device is torch >= 2.3)
    if device.type == "cpu":
        yield
        return
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    if context is not None:  # torch.set_default_device's: cleared for the call, set again after it
        torch.set_default_device(None)
        # and the None that leaves behind dropped: torch 2.4 / 2.5's get_default_device failed on it ("'NoneType' object
        # has no attribute 'device'"), and torchmetrics' FID calls it: an image run's evaluation failed in the call
        del torch._GLOBAL_DEVICE_CONTEXT.device_context
    inner = torch.empty(0).device.type != "cpu"  # a `with torch.device(...)` of the caller's: a CPU one inside it
    try:
        with torch.device("cpu") if inner else contextlib.nullcontext():
            yield
    finally:
        if context is not None:
            torch.set_default_device(context.device)


@contextlib.contextmanager
def _autograd():
    """Autograd on for training, as in a command, whatever the caller's mode: under a notebook's
    ``torch.set_grad_enabled(False)`` (or inside ``torch.no_grad()`` / ``torch.inference_mode()``) training failed at its
    first backward ("element 0 of tensors does not require grad"), after the run folder and the pool were made."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def _path(value, name: str) -> str:
    """``value`` as a path string: a str or a ``pathlib.Path``, else one line (``open_run(5)`` was os.fspath's
    TypeError, ``train(5)`` an AttributeError from the preset lookup)."""
    require(isinstance(value, (str, os.PathLike)), f"{name}={shown(value)} is {type(value).__name__}, not a path "
            "or name", f"pass {name} as a str or pathlib.Path")
    require(str(os.fspath(value)).strip() != "", f"{name} is empty (an unset variable?)",  # a run's path "" was
            f"pass {name}, e.g. {'a preset name' if name == 'preset' else repr('runs/NAME')}")  # the working folder
    return os.fspath(value)


def _callbacks(value) -> list:
    """``callbacks=`` as a list of ``Callback`` objects, refused in one line before a run folder is made: one callback
    not in a list ("'C' object is not iterable") or an object that is no Callback ("has no attribute 'teardown'")
    was a traceback from inside the engine, with the new run folder already written. None is none, as every other
    optional argument's None is its default (a wrapper's ``def fit(callbacks=None)`` passed on was refused)."""
    from sinkflow.runtime.callbacks import Callback

    if value is None:
        return []
    require(not isinstance(value, (Callback, str, bytes)) and hasattr(value, "__iter__"),
            f"callbacks={shown(value)} is not a list of callbacks", "pass them in a list, e.g. callbacks=[cb]")
    value = list(value)
    bad = next((cb for cb in value if not isinstance(cb, Callback)), None)
    require(bad is None, f"callbacks holds {shown(bad)}, a {type(bad).__name__}, not a "
            "sinkflow.runtime.callbacks.Callback", "subclass Callback and override the hooks you need")
    return value


def _seconds(time_limit: str | float | None) -> float | None:
    from sinkflow.runtime.signals import parse_duration

    return None if time_limit is None else parse_duration(time_limit)


def _overrides(overrides: dict, short: dict, own: tuple[str, ...] = ("runs_dir", "name", "device", "time_limit")
               ) -> tuple[dict, list[str]]:
    """Keyword overrides as (shorthands, dotted ``key=value`` texts): a shorthand name (``train_iters``) or a dotted
    key passed as a dict (``**{"pool.batches": 64}``), else one line naming both forms and the call's ``own``
    keyword arguments (the list left out runs_dir and time_limit, which the examples use)."""
    from sinkflow import config

    short, dotted = dict(short), []
    for key, value in overrides.items():
        if key in config.SHORTHANDS:
            short[key] = _plain(value)  # np.int64(5) / a 0-d tensor, as dotted keys take them
        elif "." in key:
            _check_not_points(key, value)
            dotted.append(f"{key}={_override_text(key, value)}")
        else:
            raise SinkflowError(f"unknown override {key!r}",
                                f"use a dotted config key as a dict, e.g. **{{'pool.batches': 4}}, or one of "
                                f"{', '.join([*own, *(k for k in config.SHORTHANDS if k not in own)])}")
    return short, dotted


def _check_not_points(key: str, value) -> None:
    """``data.source`` / ``data.target`` given the points themselves (a notebook's array), refused in one line that
    says how to pass them: an array was "a config cannot hold ... pass a list", and a list of rows became a spec named
    by its text, an OSError "File name too long" quoting every number."""
    if key in ("data.source", "data.target") and isinstance(value, (np.ndarray, torch.Tensor, list, tuple)):
        raise SinkflowError(f"{key}={shown(value)} holds points, but it takes a data set's name or a point file's path",
                            f"save them first, e.g. numpy.save('points.npy', points), and pass "
                            f"**{{'{key}': 'points.npy'}} (an (N, D) array; docs/data.md)")


def _call_text(preset: str, given: dict) -> str:
    """``sinkflow.train('moons', train_iters=3, **{'pool.eta': 1.0})``: the call as written, defaults left out."""
    defaults = {"runs_dir": "runs", "name": None, "device": "auto"}
    given = {k: _plain(v) for k, v in given.items() if k not in defaults or v != defaults[k]}
    args = [repr(preset)] + [f"{k}={v!r}" for k, v in given.items() if k.isidentifier()]
    dotted = {k: v for k, v in given.items() if not k.isidentifier()}
    return f"sinkflow.train({', '.join(args + ([f'**{dotted!r}'] if dotted else []))})"


def _count(name: str, value, example: int, default: str, most: int | None = None) -> int | None:
    """A count argument as an int (None: the run's ``default``), refused in one line unless a whole number >= 1 (and
    <= ``most``), as the commands refuse their count flags (0 meant the default in silence, 2.5 was a TypeError)."""
    require(value is None or (is_whole(value) and int(value) >= 1),
            f"{name}={shown(value)} must be a whole number >= 1",
            f"e.g. {name}={example}, or leave it out (None) for the run's {default}")
    if value is not None and most is not None and int(value) > most:
        raise SinkflowError(f"{name}={shown(value)} is more than {most:,}", f"use {name}={most:,} or fewer")
    return None if value is None else int(value)


def _plain(value):
    """``value`` as the YAML a config holds: a path as its string, a ``torch.device`` as its name, a numpy or 0-d torch
    number as the Python one, a tuple or list item by item (``Path("pts.npy")`` and ``np.int64(50)`` were yaml
    tracebacks, ``device=torch.device("cpu")`` "--device cpu: ... expects str but got device")."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, torch.device):
        return str(value)
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _override_text(key: str, value) -> str:
    """A dotted override's ``key=value`` text, or one line naming the key when the value is nothing a config holds."""
    import yaml

    from sinkflow.config.render import scalar

    try:
        return scalar(_plain(value))
    except yaml.YAMLError:
        raise SinkflowError(f"override {key} is of type {type(value).__name__}, which a config cannot hold",
                            "pass a number, a string, a bool, None or a list of them") from None


def open_run(path: str | Path, device: str | None = None) -> Run:
    """Reopen a run folder: sample from it or evaluate it (an evaluation appends its scores to metrics.jsonl, as
    `sinkflow eval` does; nothing else in the folder is written). As the command, a folder that cannot be written
    (a read-only mount, a Kaggle input) is scored all the same, with a warning that the record was skipped.
    ``device`` ("cpu", "cuda:1", a ``torch.device``; None: the run's experiment.device), as `sinkflow sample
    --device`: where its networks run, config.yaml unchanged (a run trained with device="cuda" could not be
    opened on a machine without CUDA: "use --device cpu", which open_run did not take)."""
    from sinkflow.tools.trained import open_trained

    # a notebook's os.chdir: still this run
    return Run(open_trained(Path(_path(path, "path")).resolve(), _plain(device), log_best_effort=True))
