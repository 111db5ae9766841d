"""What a method is: a ``Method`` (phases, sampling, evaluation, a description) whose phases are tasks
the engine runs (``sinkflow.engine.trainer.Trainer``).

Two kinds of task:

- ``TrainingStep``: says only how to draw a batch and compute a loss (and names its config sections);
  the Trainer owns model, optimizer, LR schedule, precision, EMA, DDP, checkpoints, signals and logging.
- ``ChunkedTask``: work whose unit is a chunk whose progress is persisted by the task itself (the NSGF
  trajectory pool); the Trainer gives it the same resume / heartbeat / stop / final-checkpoint protocol.

Both are ``Callback`` s, so a method can hook the same points of the loop as any tool. This module
imports no engine, evaluation or tool code: those layers sit above methods and are handed in.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from sinkflow.config import schema
from sinkflow.config.schema import METHOD_REGISTRY
from sinkflow.errors import SinkflowError, human_bytes
from sinkflow.methods.ode import compile_failure_line, compile_failures, compiled_for_sampling
from sinkflow.runtime.autocast import FAST_KINDS, autocast, sampling_precision
from sinkflow.runtime.callbacks import Callback


class Task(Callback):
    """One resumable phase of a method. ``name`` is its checkpoint folder (``RUN/checkpoints/<name>``)."""

    name: str = "phase"

    def open(self, run) -> None:
        """Prepare what the task needs from the run folder, once, when it really runs (before setup)."""

    def check_done(self, run) -> None:
        """A resume of a run whose task has finished: check what later tasks will read of its output (beyond its
        final.pt), before the run folder is touched. Raise a one-line SinkflowError to refuse."""

    def check_resume(self, run) -> int:
        """A resume that will continue this unfinished task: check what it left on disk (beyond its step
        checkpoints) before the run folder is touched, and return where it continues (a chunked task's finished
        units; 0 otherwise: a training phase's step is its checkpoint's). Raise a one-line SinkflowError to refuse."""
        return 0

    def callbacks(self) -> list[Callback]:
        """Extra hook objects the method runs with this task (besides the task itself)."""
        return []

    def config_sections(self) -> tuple[str, ...]:
        """Config prefixes this task reads: preflight checks that every override reaches some task."""
        return (f"{self.name}.",)


class TrainingStep(Task):
    """A training phase: minimise ``loss(model, batch)`` over batches from ``batch(generator, n, device)``.

    ``batch`` draws the *global* batch's randomness from the phase generator and returns only this rank's
    shard (``dist.shard``), so one process and N processes see the same global batch. ``model_key`` names the
    config sections ``train.<key>`` and ``model.<key>`` (the phase's name by default). ``learning_check``: the
    engine warns at the end when the loss did not fall (``sinkflow.engine.learning``); a task with a sharper check
    of its own turns it off.
    """

    learning_check = True

    def __init__(self, name: str, model_key: str | None = None, init_from: str | None = None):
        self.name = name
        self.model_key = model_key or name
        self.init_from = init_from

    def initial_weights(self, run) -> dict | None:
        """The weights the phase starts from in place of a fresh init: with ``init_from``, that finished phase's
        network (its EMA weights where it kept them; NSGF++'s ``nsgf.nsf_init: velocity``), else None. The Trainer
        loads them before the EMA copy and the optimizer see the model; a phase resumed from its own checkpoint does
        not ask for them."""
        if self.init_from is None:
            return None
        state = run.final_state(self.init_from)
        return state["ema"] if state.get("ema") is not None else state["model"]

    def frozen(self) -> tuple[str, ...]:
        """The finished phases whose networks this phase holds on the device while it trains (their weights count
        in its memory plan); default none."""
        return ()

    def batch(self, generator: torch.Generator, n: int, device) -> Any:
        raise NotImplementedError

    def draw(self, generator: torch.Generator, n: int, device) -> Any:
        """The part of ``batch`` that reads ``generator``; ``prepare`` finishes it, and ``prepare(draw(...))`` is
        ``batch(...)``. A task splits the two where the rest is heavy and reads no generator (OT-CFM's exact plan),
        so the prefetcher can finish one batch while it draws the next. Default: all of ``batch``."""
        return self.batch(generator, n, device)

    def prepare(self, drawn: Any, device) -> Any:
        """The batch from what ``draw`` returned (no randomness); default: ``drawn`` itself."""
        return drawn

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def config_sections(self) -> tuple[str, ...]:
        return (f"train.{self.model_key}.", f"model.{self.model_key}.")


class ChunkedTask(Task):
    """Work done unit by unit whose progress the task persists itself (``progress.json`` for the pool).

    The Trainer calls ``open(run)``, then while ``not finished()``: ``next_unit()``, ``run_unit(unit)``
    (returns how many progress-bar items it did), and finally ``final_state()`` for ``final.pt``.
    ``position`` / ``total`` count finished / all units (heartbeat, ``Interrupted``); ``progress_done``
    / ``progress_total`` count progress-bar items. A stop request is honoured between units.
    """

    position: int = 0
    total: int = 0
    progress_done: int = 0
    progress_total: int = 0

    def finished(self) -> bool:
        raise NotImplementedError

    def next_unit(self) -> Any:
        raise NotImplementedError

    def run_unit(self, unit: Any) -> int:
        raise NotImplementedError

    def final_state(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        """Release what ``open`` held (memory maps...), before ``final.pt`` is written."""

    # ---- what the planner and preflight ask of a task, so they never name one ----------------------------

    def memory(self, cfg: dict, shape: tuple[int, ...]) -> dict | None:
        """Peak device bytes of one unit by term, plus what the task stores: ``{"terms": {name: bytes},
        "host_bytes": n, "disk_bytes": n, "note": str}``; None: not estimated."""
        return None

    def fit_memory(self, cfg: dict, shape: tuple[int, ...], device_bytes: int) -> tuple[dict, list[str]]:
        """(overrides, reasons) that keep one unit within ``device_bytes`` and the stored output within its
        RAM budget, computing the same thing; ({}, []) when nothing can be changed."""
        return {}, []

    def output(self, run) -> Any:
        """A copy of what the finished units wrote so far (preflight checks a resume keeps it); None: nothing."""
        return None


class RunNets:
    """``nets[phase]``: a run's finished, frozen network of that phase (loaded on first use), wrapped by
    ``compiled_for_sampling`` if ``compiled`` (a new wrapper per call is free: dynamo caches the compiled
    code per forward function, guarded on shapes, so only a new batch shape compiles again; measured on CPU)."""

    def __init__(self, run, compiled: bool = False):
        self.run, self.compiled = run, compiled

    def __getitem__(self, phase: str) -> torch.nn.Module:
        model = self.run.model(phase)
        return compiled_for_sampling(model, self.run.device) if self.compiled else model


class Method:
    """A generative method: its phases, how it samples, evaluates and describes itself.

    Required: ``phases`` and ``sample_nets`` (and a ``name``, the registry key). ``evaluate`` / ``plots`` get the
    evaluation layer as ``ev`` (``sinkflow.eval.report``), so a method never imports it; their defaults are
    the standard sample-based evaluation. Everything a caller may ask a method is a method of this class:
    callers never test a method's name nor probe for optional functions.
    """

    name: str = ""
    takes_steps = True  # sampling integrates a path in Euler steps (`sample --steps`); a flow inverts once
    steps_are = "steps"  # what `sample --steps` counts, as its output says it (NSGF++: its straight flow's)
    clamps_samples = False  # sample_nets returns values as integrated (a flow maps its samples into the pixel range)
    # The paper's own W2 numbers for this method, {task (preset): {euler_steps: w2}}, and the label the report
    # prints them under; a method the paper has no numbers for keeps both empty and reports none.
    paper: dict = {}
    paper_label: str = ""

    def paper_w2(self, task: str, steps: int) -> float | None:
        """The paper's W2 for this method on ``task`` at ``steps`` Euler steps, or None (never raises)."""
        return (self.paper.get(task) or {}).get(steps)

    def check_steps(self, steps, flag: str = "--steps") -> None:
        """Refuse a number of sampling steps for a method that samples without steps (the CLI's ``--steps`` and the
        API's ``steps=`` alike: the API ignored it in silence)."""
        if steps is not None and not self.takes_steps:
            raise SinkflowError(f"{flag} does not apply to a {self.name} run: it samples in one inverse pass",
                                f"drop {flag.rstrip('=')} (sample.temperature sets how far from the mode it draws)")

    def check(self, cfg: dict, sample_shape: tuple[int, ...]) -> None:
        """Refuse, before any work, a config this method cannot run (one line naming the key). The config alone
        decides: the same answer on every machine (the memory plan and preflight rely on it)."""

    def check_machine(self, cfg: dict, sample_shape: tuple[int, ...]) -> None:
        """Refuse, before any work, a run this machine cannot hold (its checkpoints, and a trajectory pool, larger
        than the free disk under ``experiment.runs_dir``). Preflight reports it as its own check: planning on a
        laptop for a rented GPU, the laptop's disk is not the run's."""
        check_disk_room({"checkpoints": checkpoint_bytes(cfg, sample_shape)},
                        Path(cfg["experiment"]["runs_dir"]).expanduser(),
                        "lower checkpoint.keep, or point experiment.runs_dir at a larger disk")

    def phases(self, cfg: dict, source, target) -> list[Task]:
        raise NotImplementedError

    def sample(self, run, x0: torch.Tensor, steps: int | None = None, record: bool = False) -> tuple:
        """``(x, info)`` from a run's finished models: ``sample_nets`` with the run's networks and config,
        compiled where ``sample.compile`` is set and under bf16 / fp16 autocast where ``sample.precision`` says so,
        when this method reads those keys (the Euler samplers: their state and updates stay float32, the networks'
        outputs are cast back before each step)."""
        compiled = bool(run.cfg["sample"].get("compile")) and "sample.compile" in METHOD_REGISTRY[self.name].reads
        try:
            with autocast(run.device.type, self.sample_precision(run.cfg, run.device)):
                return self.sample_nets(RunNets(run, compiled), run.cfg, x0, steps, record)
        except compile_failures() as exc:  # dynamo's traceback, pages of it, where training says one line
            if not compiled:
                raise
            raise SinkflowError(f"torch.compile failed while sampling: {compile_failure_line(exc)}",
                                "set sample.compile=false to sample eager") from exc

    def sample_precision(self, cfg: dict, device: torch.device | str, bf16: bool | None = None) -> str:
        """The precision ``sample`` runs the networks in on ``device``: ``sample.precision`` where this method reads
        it (``auto``: fp32 on a CPU; on a CUDA card the sampled network's training precision where it was set, else
        fp16 for a UNet on a card with bf16 tensor cores, ``runtime.autocast.sampling_precision``; ``bf16`` says
        whether the card has them, for a plan without the card), else fp32."""
        spec = METHOD_REGISTRY[self.name]
        if "sample.precision" not in spec.reads:
            return "fp32"
        # the network the decision is about: the first of the method's sampled networks the fast path was measured
        # on (NSGF++: its velocity UNet, not the time predictor), else its first (a method's own phase names: a
        # plugin's network need not be called velocity)
        nets = [p for p in spec.phases if p in cfg.get("model", {})]
        key = next((p for p in nets if cfg["model"][p]["kind"] in FAST_KINDS), nets[0] if nets else None)
        if key is None:
            return sampling_precision(cfg["sample"]["precision"], "", device, bf16)
        trained = cfg.get("train", {}).get(key, {}).get("precision", "auto")
        return sampling_precision(cfg["sample"]["precision"], cfg["model"][key]["kind"], device, bf16, trained)

    def sample_nets(self, nets, cfg: dict, x0: torch.Tensor, steps: int | None = None, record: bool = False) -> tuple:
        """``(x, info)`` from networks you hold: ``nets[phase]`` is the network of a training phase (a dict of
        your own modules, or a run's), ``cfg`` the config they were trained with. ``info["nfe"]`` is counted by
        instrumentation, ``info["path"]`` holds the states if ``record``."""
        raise NotImplementedError

    def default_steps(self, cfg: dict) -> int:
        """Sampling steps when the caller gives none."""
        return cfg["sample"]["steps"]

    def eval_steps(self, cfg: dict) -> list[int]:
        """Step counts the evaluation reports."""
        return list(cfg["eval"]["steps"])

    def evaluate(self, run, ev, seeds: int | None = None, n: int | None = None, split: str = "test") -> str:
        """The report ``sinkflow eval`` prints; ``ev`` is the evaluation layer. ``split="val"``: against an image
        run's validation split (``sinkflow eval --split val``), for choices that must not read the test split."""
        return ev.standard_evaluation(run, self, seeds=seeds, n=n, split=split)

    def plots(self, run, ev) -> list[Path]:
        """The figures ``sinkflow train`` writes into the run folder when it finishes."""
        return ev.standard_plots(run, self)

    def describe(self, cfg: dict) -> str:
        """One line: what this method trains and how it samples."""
        return self.name

    def sample_draws(self, cfg: dict) -> int:
        """The most samples this method's own work beside the evaluation pushes through its networks in one go (in
        chunks of ``sample.batch_size``), which the memory plan's sampling chunk counts; default 0: none."""
        return 0

    def scratch_overrides(self, cfg: dict) -> list[str]:
        """Overrides of this method's own keys that keep a tool's scratch run (doctor, lr-find, bench: a few steps
        of each phase) from spending minutes on work the tool never looks at; default none. The tools cut the shared
        sections (``train.*``, ``pool.*``) themselves."""
        return []

    # ---- `sinkflow tune`: the sampler's settings it compares (asked of the method, never by its name) ----------
    def sampler_settings(self, cfg: dict) -> tuple[int, dict]:
        """(network evaluations, ``sample.*`` settings) of the run's own sampler; default: an Euler sampler's."""
        s = cfg["sample"]
        return s["steps"], {"steps": s["steps"], "time_warp": s["time_warp"]}

    def sampler_candidates(self, cfg: dict, total: int) -> list[dict] | None:
        """The ``sample.*`` settings ``sinkflow tune`` tries at ``total`` network evaluations (a one-line
        SinkflowError for a budget this sampler cannot spend); None: nothing to choose. Default: the grid warps of
        ``total`` Euler steps, for a method that reads ``sample.steps`` and ``sample.time_warp``."""
        reads = METHOD_REGISTRY[self.name].reads
        if not all(k in reads or "sample" in reads for k in ("sample.steps", "sample.time_warp")):
            return None
        return [{"steps": total, "time_warp": w} for w in EULER_WARPS]


# sample.time_warp values `sinkflow tune` tries on an Euler grid (1: uniform, the paper's; < 1: short early steps and a
# long last one)
EULER_WARPS = (0.35, 0.5, 0.75, 1.0)

# A checkpoint's bytes beyond its tensors' (a torch.save zip): per tensor its zip records, alignment and pickle entry
# (measured 300-470 B on sinkflow's MLPs and UNets), and per file the RNG, generator, schedule and scaler states
CHECKPOINT_ENTRY, CHECKPOINT_REST = 512, 64 * 1024


def checkpoint_bytes(cfg: dict, sample_shape: tuple[int, ...]) -> int:
    """Disk the training phases' checkpoints take at most (the networks built on the meta device, allocating
    nothing): per phase its ``final.pt`` and ``checkpoint.keep`` step files (fewer in a phase too short to write them,
    counting one written at a stop), each the model's state, Adam's two moments of every trainable parameter,
    with ``train.<phase>.ema`` the averaged copy, and the file format's own bytes. Every phase's stay: a finished run holds them all."""
    from sinkflow.runtime.run_folder import build_phase_model

    keep, total = max(1, cfg["checkpoint"]["keep"]), 0
    for phase in schema.METHOD_PHASES[cfg["experiment"]["method"]]:
        if phase not in cfg["model"]:  # the pool: its arrays are counted apart, its final.pt is a few KiB
            continue
        with torch.device("meta"):
            model = build_phase_model(cfg, phase, sample_shape)
        train, copies = cfg["train"][phase], 2 if cfg["train"][phase]["ema"] > 0 else 1
        state = model.state_dict().values()
        trained = [p for p in model.parameters() if p.requires_grad]
        data = copies * sum(t.numel() * t.element_size() for t in state) + 2 * sum(p.numel() * p.element_size()
                                                                                  for p in trained)
        entries = copies * len(state) + 3 * len(trained)  # Adam's step counts too; each entry a record in the zip
        files = min(keep, train["iters"] // train["ckpt_every"] + 1) + 1
        total += files * (data + CHECKPOINT_ENTRY * entries + CHECKPOINT_REST)
    return total


def check_disk_room(needs: dict[str, int], folder: Path, fix: str, held: int = 0) -> None:
    """Refuse, before any work, what the disk under ``folder`` cannot hold: ``needs``, bytes by what the run writes
    there, less the ``held`` bytes some of it already reserves (a resumed pool build). Creates nothing: a folder
    not made yet is on the disk of its nearest existing parent."""
    need = sum(needs.values())
    free = shutil.disk_usage(next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())).free
    if need > free + held:
        alone = len(needs) == 1 and "checkpoints" not in needs  # the pool alone (a resumed build) says so
        what = next(iter(needs)) if alone else "the run"
        parts = "" if alone else ": " + ", ".join(f"{k} {human_bytes(v)}" for k, v in needs.items())
        raise SinkflowError(f"{what} needs {human_bytes(need - held)} {'more ' if held else ''}of disk "
                            f"but the disk has only {human_bytes(free)} ({folder}{parts})", fix)
