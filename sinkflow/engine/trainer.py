"""The engine: one ``Trainer`` runs one phase (a method's task) to its ``final.pt``.

For a ``TrainingStep`` the Trainer owns the model, its Adam optimizer, LR schedule, optional EMA and
autocast, DDP, the phase's own random generator, the loop, logging, step checkpoints and signals. Everything
it needs to continue bit-for-bit (weights, optimizer, scheduler, scaler, EMA, step, generator and global
RNG states) is in every step checkpoint. For a ``ChunkedTask`` (the pool) it runs the task's units with the
same protocol: resume where the task's own progress says, heartbeat after every unit, stop between units on
SIGTERM/SIGINT (or ``request_stop``), and write ``final.pt`` at the end.

Tools watch and steer the loop through ``Callback`` hooks (``sinkflow.runtime.callbacks``), never by
patching it. The network of a training phase is built from ``model.<key>`` and the sample shape, which
the caller may pass in (``shape``); by default it comes from the data section (``sinkflow.data``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Callable, Iterable

import torch

from sinkflow.data import sample_shape
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import TrainingStep
from sinkflow.methods.ode import compile_failure_line, compile_failures
from sinkflow.runtime import dist
from sinkflow.runtime.autocast import autocast
from sinkflow.runtime.callbacks import Callback, ProgressBar, checkpointable_state
from sinkflow.runtime.checkpoint import rng_state, set_rng_state
from sinkflow.runtime.metrics import HEARTBEAT_EVERY_S
from sinkflow.engine import fast_path
from sinkflow.engine.divergence import DivergenceGuard
from sinkflow.engine.learning import LearningCheck
from sinkflow.engine.ema import EMA, START_SHARE, first_step_share, largest_decay
from sinkflow.engine.grad_sync import GradSync
from sinkflow.engine.finite import NonFiniteGuard, optimizer_steps, skip_with_scaler, skips_on_device
from sinkflow.engine.health import Health
from sinkflow.engine.prefetch import BatchPrefetcher, use_prefetch
from sinkflow.engine.step_graph import CaptureFailed, StepGraph
from sinkflow.runtime.rng import draws_dropout, phase_generator, seed_everything, stream_seed
from sinkflow.runtime.run_folder import build_phase_model, load_model_state
from sinkflow.runtime.signals import QUIET, REQUESTED, Interrupted, stop_requested
from sinkflow.runtime.state_check import check_step_state

log = logging.getLogger(__name__)

AGREE_EVERY_S = 5.0  # under DDP, seconds of steps between two agreements on a stop (a collective each)


def adam_kernel(device: torch.device) -> dict:
    """Adam's kernel for ``device``: fused wherever this torch has it (CUDA; the CPU from torch 2.4), else foreach.

    Fused is one kernel per step and takes the non-finite flag as ``found_inf``, so a step needs no host sync
    (``sinkflow.engine.finite``). On the CPU it is faster too (the 2D MLP's Adam step 2.2x, the whole step
    1.03-1.10x: ``benchmarks/cpu_step.py``), and the CPU test suite then runs the GPU's optimizer path: while the
    CPU ran foreach, a cache keyed on the version counter, which fused Adam does not move, broke invertible flows
    on GPUs only (``InvertibleLayer.drop_cache``)."""
    cpu_fused = torch.torch_version.TorchVersion(torch.__version__) >= "2.4"
    fused = device.type == "cuda" or (device.type == "cpu" and cpu_fused)
    return {"fused": True} if fused else {"foreach": True}


class Trainer:
    """Runs ``task`` in ``run``: ``Trainer(run, task, callbacks).fit()``.

    The default callbacks (a progress bar; for training phases the health dashboard, the divergence guard and the
    check that the loss fell) come after the task's own and before ``callbacks``. ``model`` replaces the network
    built from the config (benchmarks).
    """

    def __init__(self, run, task, callbacks: Iterable[Callback] = (), *, shape: tuple[int, ...] | None = None,
                 model: torch.nn.Module | None = None):
        self.run, self.task, self.name = run, task, task.name
        self.training = isinstance(task, TrainingStep)
        defaults: list[Callback] = [ProgressBar()]
        if self.training:
            defaults += [Health(), DivergenceGuard(), *([LearningCheck()] if task.learning_check else [])]
        self.callbacks: list[Callback] = [task, *task.callbacks(), *defaults, *callbacks]
        self.device = run.device
        self.info = dist.current()
        self._shape, self._model = shape, model
        # the phase's train section, its ``auto`` speed settings decided for this device and network
        self.cfg: dict = fast_path.resolve(run.cfg["train"][task.model_key],
                                           run.cfg["model"].get(task.model_key, {}).get("kind", ""), run.device,
                                           self.info.world) if self.training else {}
        # `compile: auto` falls back to eager if compiling fails; an explicit `compile: true` stops instead
        self.compile_auto = self.training and run.cfg["train"][task.model_key].get("compile") == "auto"
        # likewise `graph: auto` goes on without the step graph where its capture fails (`graph: step` stops)
        self.graph_auto = self.training and run.cfg["train"][task.model_key].get("graph") == "auto"
        self._compile_proven = False
        self.model = self.ddp_model = self.optimizer = self.scheduler = self.scaler = self.ema = None
        self.step_graph: StepGraph | None = None  # train.<phase>.graph=step: the whole step as one CUDA graph
        self.params: list[torch.nn.Parameter] = []
        self.generator: torch.Generator | None = None
        self.ckpts = None
        self.batches: BatchPrefetcher | None = None  # the loop's batch source (made ahead where enabled)
        self.guard: NonFiniteGuard | None = None
        self.step = 0
        self.last_units = 0  # progress-bar items the last unit did
        self.batch: Any = None  # the batch of the current (last) step, for callbacks and tools
        self.stopped = False  # ``stop()`` ended the phase early (no final.pt)
        self._stop: int | None = None
        # a stop agreed at the phase's last step or unit: the phase ends (final.pt) and run_phases stops the run before
        # the next one, as on a signal; a callback's request_stop, unlike a signal's flag, is this trainer's alone
        self.stop_at_end: int | None = None
        # under DDP, when the ranks next agree on a stop (``_agree_stop``): the step, and the clock and step of the
        # last agreement that set it (set where the training loop starts)
        self._next_agree, self._agreed = 0, (0.0, 0)

    # ---- construction ---------------------------------------------------------------------------
    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is None:
            self._shape = sample_shape(self.run.cfg)
        return self._shape

    def setup(self) -> None:
        """Build the model, optimizer, scheduler, EMA, scaler, DDP wrapper and generator of a training phase."""
        run, cfg, key = self.run, self.cfg, self.task.model_key
        seed = run.cfg["experiment"]["seed"]
        seed_everything(int(phase_generator(seed, "init", self.name).initial_seed()))  # same init on every rank
        model = self._model if self._model is not None else build_phase_model(run.cfg, key, self.shape)
        # a warm start from a finished phase (checked alike in the config's own check); a phase resumed from its own
        # step checkpoint does not read it: that checkpoint replaces the weights (150 MB for the CIFAR-10 UNet)
        resumed = self.task.init_from is not None and bool(run.checkpoints(self.name).steps())
        start = None if resumed else self.task.initial_weights(run)
        if start is not None:
            load_model_state(model, start, str(run.checkpoints(self.task.init_from).final_path), "initial weights")
        self.model = model.to(run.device)
        # under DDP every rank left the shared init with the same global RNG state, so each drew the same dropout
        # masks (a resume restored rank 0's on all): each rank's masks come from a stream of its own, seeded at every
        # step from (seed, phase, rank, step), so a resume at any step draws what the uninterrupted run drew
        self.rank_dropout = self.info.world > 1 and draws_dropout(model)
        self.channels_last = use_channels_last(cfg, run.device, self.shape)
        if self.channels_last:  # NHWC convolutions (tensor cores) for 4-D image batches
            self.model = self.model.to(memory_format=torch.channels_last)
        self.model.train()
        lr = cfg["lr"] * dist.lr_scale(cfg["lr_scaling"], self.info.world)
        # one list, walked every step by the grad clip: model.parameters() recurses through every submodule each time
        # (149 tensors of the mnist UNet: 2.1 ms a step on the H100 host, GIL waits included, by cProfile)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0,
                                          **adam_kernel(run.device))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(cfg.get("schedule", "constant"), cfg["warmup"], cfg["iters"], key))
        if self.info.is_main:
            for line in too_short(cfg, key):
                log.warning("%s", line)
        self.ema = None
        if cfg["ema"] > 0:
            self.ema = EMA(self.model, cfg["ema"], cfg["ema_warmup"])
        self.precision = cfg["precision"]
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise SinkflowError(f"train.{key}.precision={self.precision!r} is not one of fp32, bf16, fp16",
                                f"set train.{key}.precision=bf16")
        self.scaler = torch.amp.GradScaler(run.device.type, enabled=self.precision == "fp16")
        # fp16: GradScaler skips steps with Inf/NaN gradients by design, so only the loss is guarded
        self.guard = NonFiniteGuard(run.device, check_grad=not self.scaler.is_enabled())
        self.skip_on_device = skips_on_device(self.optimizer)  # no per-step read of the loss (sinkflow.engine.finite)
        self.ddp_model = self.model
        # under torchrun the gradients are averaged by DDP's hooks during the backward, or, where the step is
        # captured, by one all-reduce between the backward's graph and the update's (grad_sync.py: a graph cannot
        # hold DDP's hooks); over any process group, one of one process too (gpu_checks.py's split_step)
        self.grad_sync = None
        if dist.grouped() and cfg.get("graph", "none") == "step":
            self.grad_sync = GradSync(self.model)
            self.grad_sync.start()
        elif self.info.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp_model = DDP(self.model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
        # compiling costs tens of seconds before the first step (fast_path: auto = a UNet on CUDA). A CUDA-graph
        # mode (reduce-overhead, max-autotune) replays one captured graph per step; each step then starts with
        # cudagraph_mark_step_begin.
        self.compile_mode = cfg.get("compile_mode", "default") if cfg.get("compile", False) else None
        self.eager_model = self.ddp_model
        if self.compile_mode is not None:
            self.ddp_model = torch.compile(self.ddp_model, mode=self.compile_mode)
        self.step_graph = None
        if cfg.get("graph", "none") == "step":
            check_step_graph(cfg, key, self.compile_mode, self.skip_on_device)
            parts = None if self.grad_sync is None else (lambda batch, step: self._backward(batch), self.grad_sync,
                                                          self._apply)
            self.step_graph = StepGraph(self._update, self.optimizer, run.device, self.name, parts)
        self.generator = phase_generator(seed, "train", self.name)
        self.step = 0
        if self.info.is_main:
            log.info("%s", self.speed_settings())
            kind = run.cfg["model"].get(key, {}).get("kind", "")
            asked = run.cfg["train"][key]
            for hint in (fast_path.fp16_hint(asked, kind, run.device, key),
                         fast_path.cpu_fp16_hint(self.precision, run.device, key, kind),
                         fast_path.ddp_graph_hint(asked, kind, run.device, self.info.world, key)):
                if hint:
                    log.info("%s", hint)

    def speed_settings(self) -> str:
        """The fast-path choices this phase runs with, printed at its start (each one key away)."""
        key, kernel = self.task.model_key, "fused" if self.optimizer.defaults.get("fused") else "foreach"
        ahead = use_prefetch(self.cfg.get("prefetch", "auto"), self.device)
        mode = self.compile_mode
        compiled = "eager" if mode is None else "compiled" if mode == "default" else f"compiled ({mode})"
        graph = "" if self.step_graph is None else (
            ", the step the backward's and the update's CUDA graphs with the gradients' all-reduce between them"
            if self.step_graph.captures and self.grad_sync is not None else
            ", the whole step one CUDA graph" if self.step_graph.captures else ", the step graph's path run eagerly")
        return (f"{self.name} on {self.device.type}: {self.precision}, {kernel} Adam, "
                f"{'channels_last' if self.channels_last else 'NCHW' if len(self.shape) == 3 else 'plain layout'}, "
                f"{compiled}{graph}, batches drawn {'ahead (two in the making)' if ahead else 'inline'} "
                f"(train.{key}.precision / channels_last / compile / graph / prefetch)")

    @property
    def captures_steps(self) -> bool:
        """Are this phase's steps CUDA-graph replays (no Python runs inside them: forward hooks do not fire)?"""
        return self.step_graph is not None and self.step_graph.captures

    def generator_state(self) -> torch.Tensor:
        """The phase generator's state before the first batch not yet trained on: where a resume draws from. With
        batches drawn ahead (``prefetch``) the live generator is already past the batches in the making."""
        return self.batches.generator_state() if self.batches is not None else self.generator.get_state()

    def state_dict(self) -> dict:
        return {
            "phase": self.name,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
            "ema_state": self.ema.state_dict() if self.ema is not None else None,
            "generator": self.generator_state(),
            "rng": rng_state(),
            "world_size": self.info.world,
            "callbacks": {cb.state_key: st for cb in self.callbacks if (st := checkpointable_state(cb))},
            "train": dict(self.run.cfg["train"][self.task.model_key]),  # what it trained with (a hand edit is told)
            "resolved": self.resolved(),  # what its ``auto`` keys were on the machine that trained it (a resume says)
        }

    def resolved(self) -> dict:
        """The speed settings this phase trains with on this machine, its ``auto`` keys made concrete
        (``fast_path.resolve``): a step checkpoint keeps them, so a resume elsewhere can say what changed. The compile
        mode and the graph as resolved, not what is left after a failed compile's or capture's fall-back
        (``train_step``, ``_step``): a resume sets up compiled and captured and falls back at its first steps, after
        the comparison, so "off" read as a change on every resume of a machine that cannot compile."""
        compiled = self.cfg.get("compile_mode", "default") if self.cfg.get("compile", False) else None
        return {"device": self.device.type, "precision": self.precision,
                "graph": self.cfg.get("graph", "none"), "compile": compiled or "off"}

    def resolved_change(self, saved: Any, step: int) -> str | None:
        """One line where this machine resolves the phase's speed settings otherwise than the one that wrote the step
        ``step`` checkpoint (``saved``: its ``resolved`` entry): a run trained on a GPU (``precision: auto`` = fp16
        with its loss scale, ``graph: auto`` = the step graph) and resumed on a CPU or a T4 printed only its new
        settings, the change itself unsaid (config.yaml holds ``auto`` both times, so no key changed). None where
        nothing changed, or the checkpoint predates the record; where every change is a set key's on the same device
        (the resume's override or a hand edit, each said in its own line), only a loss-scale note, if any."""
        if not isinstance(saved, dict):
            return None
        now = self.resolved()
        keys = [k for k in ("precision", "graph", "compile") if k in saved and saved[k] != now[k]]
        if not keys:
            return None

        def words(settings: dict) -> str:
            shown = [f"{k} {settings.get(k)}" for k in ("graph", "compile") if k in keys]
            return ", ".join([str(settings.get("precision")), *shown]) + f" on {settings.get('device', '?')}"

        scale = ""
        if saved.get("precision") == "fp16" and now["precision"] != "fp16":
            scale = "; fp16's loss scale is set aside"
        elif now["precision"] == "fp16" and saved.get("precision") != "fp16":
            scale = "; fp16's loss scale starts afresh"
        key = self.task.model_key
        tcfg = self.run.cfg["train"][key]  # compile's mode is auto's too where compile_mode is (compile: true)
        edited = {k for k in keys if tcfg.get(k) != "auto" and (k != "compile" or tcfg.get("compile_mode") != "auto")}
        if edited == set(keys) and saved.get("device") == now["device"]:  # each change a set key's, said already as
            # the resume's override or config.yaml's edit (RunFolder.record_hand_edits): only what it implies is new
            return f"{self.name}: {scale[2:]}" if scale else None
        autos = " / ".join(k for k in keys if k not in edited)
        why = "" if edited == set(keys) else f" (train.{key}.{autos}: auto, decided per machine and process count)"
        return f"{self.name}: trained to step {step} in {words(saved)}; resumes in {words(now)}{why}{scale}"

    def load_state_dict(self, state: dict, where: str) -> None:
        check_step_state(state, self.model, self.generator, where, ema=self.ema is not None,
                         scaler=self.scaler.is_enabled())
        load_model_state(self.model, state["model"], where)
        # the kernel is this device's choice, not the checkpoint's, and it is named before the load: torch places each
        # `step` count by the *saved* groups' flags (``Optimizer._process_value_according_to_param_policy``), so a
        # foreach checkpoint (a CPU run on torch < 2.4, or before 2026-11-26) kept them on the CPU under fused CUDA
        # Adam, whose kernel reads them on the device; with fused named, torch puts them on the param's device
        kernel = {"fused": self.optimizer.defaults["fused"], "foreach": self.optimizer.defaults["foreach"]}
        saved = {**state["optimizer"], "param_groups": [{**g, **kernel} for g in state["optimizer"]["param_groups"]]}
        try:
            self.optimizer.load_state_dict(saved)
            self.scheduler.load_state_dict(state["scheduler"])
            if state["scaler"] or not self.scaler.is_enabled():  # fp16 switched on at resume: a fresh scaler
                self.scaler.load_state_dict(state["scaler"])
            if self.ema is not None and state.get("ema_state") is not None:
                self.ema.load_state_dict(state["ema_state"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise SinkflowError(f"checkpoint {where} does not match this phase's optimizer ({exc})",
                                "resume with the config the run was trained with") from None
        if self.step_graph is not None:  # a captured step writes the optimizer state it was recorded with
            self.step_graph.invalidate()
        # the logging window's losses (a checkpoint from before 2026-11-27, or a damaged entry: a fresh window; it
        # only shapes the next logged mean)
        window = state.get("log_window")
        total, count = (window.get("loss_sum"), window.get("count")) if isinstance(window, dict) else (None, None)
        fine = isinstance(total, float) and math.isfinite(total) and type(count) is int and count >= 0
        self.loss_sum = torch.tensor(total if fine else 0.0, device=self.device)
        self.loss_count = count if fine else 0
        # the learning rate the config asks for now (train.*.lr, lr_scaling, world size) replaces the restored
        # one for real: the optimizer and the schedule follow it (RunFolder.start records the change in meta.json)
        # (and a changed schedule / warmup / iters takes effect at this step, not one step late)
        base = self.cfg["lr"] * dist.lr_scale(self.cfg["lr_scaling"], self.info.world)
        wanted = [base * fn(self.scheduler.last_epoch) for fn in self.scheduler.lr_lambdas]
        groups = self.optimizer.param_groups
        if any(b != base for b in self.scheduler.base_lrs) or [g["lr"] for g in groups] != wanted:
            for group, lr in zip(groups, wanted):
                group["initial_lr"], group["lr"] = base, lr
            self.scheduler.base_lrs = [base for _ in self.scheduler.base_lrs]
            # a new schedule at the same position: lr = base * factor(step), through the scheduler's own API
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.scheduler.lr_lambdas,
                                                               last_epoch=self.scheduler.last_epoch - 1)
        self.generator.set_state(state["generator"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        saved = state.get("callbacks") or {}
        for cb in self.callbacks:
            if cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])

    # ---- one optimizer step ---------------------------------------------------------------------
    def draw_batch(self, n: int | None = None) -> Any:
        """The next batch from the phase generator: ``n`` global rows (default: batch_size per process)."""
        n = self.cfg["batch_size"] * self.info.world if n is None else n  # batch_size is per process (dist.py)
        return self.task.batch(self.generator, n, self.device)

    def train_step(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step (with accumulation); returns (loss, grad-norm) as 0-dim device tensors.

        Nothing here waits for the device: the non-finite guard (``sinkflow.engine.finite``) decides on the
        device whether the update is applied. Where the optimizer cannot take that decision (one without a
        ``found_inf`` input, e.g. foreach Adam) the guard is read at once, before the update.

        The first step of a compiled phase compiles (forward and backward, before the optimizer step). If that
        fails (no Triton for this card, no C compiler, an unsupported op): with ``compile: auto`` the phase goes
        on eager, saying so once; with ``compile: true`` it stops with the fix. Every caller (the loop, doctor,
        lr-find) gets this, and no update was applied either way."""
        if self.compile_mode is None or self._compile_proven:
            return self._step(batch)
        try:
            out = self._step(batch)
        except compile_failures() as exc:
            what = compile_failure_line(exc)
            key = self.task.model_key
            if not self.compile_auto:  # every rank compiles alike (one config, check_same): rank 0 says it once
                raise SinkflowError(f"torch.compile failed in phase '{self.name}': {what}",
                                    f"set train.{key}.compile=false to train eager", every_rank=True) from exc
            if self.info.is_main:  # each rank's warning was its own line
                log.warning("%s: torch.compile failed (%s); training eager instead (set train.%s.compile=false to "
                            "skip the attempt)", self.name, what, key)
            self.ddp_model, self.compile_mode = self.eager_model, None
            out = self._step(batch)
        self._compile_proven = True
        return out

    def _step(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step_graph is not None:
            try:
                out = self.step_graph(batch, self.step + 1)
            except CaptureFailed as exc:
                if not self.graph_auto:
                    raise
                self._drop_step_graph(exc)
                out = self._update(batch, self.step + 1)
        else:
            out = self._update(batch, self.step + 1)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        return out

    def _drop_step_graph(self, exc: CaptureFailed) -> None:
        """``graph: auto``'s fall-back when the capture failed (a user's network that reads a value on the host, an op
        a CUDA graph cannot hold): say it once and go on with the plain step, as ``compile: auto`` does. Nothing the
        capture recorded ran, so no update was applied; what it left on the host is set back: the gradients it
        allocated in the graph's pool, and GradScaler's record that this step's gradients were unscaled already
        (its next ``unscale_`` would refuse), dropped from the same scaler as its own ``update`` drops it (its scale,
        untouched by the unrun capture, stays). Not a fresh scaler in its place: a caller holding ``trainer.scaler``
        across the step (doctor's ``applied_step``) read the old one's scale and took a skipped step for applied."""
        if self.info.is_main:
            log.warning("%s: %s; training without the step graph (set train.%s.graph=none to skip the attempt)",
                        self.name, exc.problem, self.task.model_key)
        self.step_graph.release()
        self.step_graph = None
        if self.scaler.is_enabled():  # a defaultdict: the next unscale_ finds a fresh READY record
            self.scaler._per_optimizer_states.pop(id(self.optimizer), None)

    @torch.no_grad()
    def probe_forward(self, batch: Any) -> torch.Tensor:
        """The phase's loss on ``batch`` through the eager model, no gradient, under the phase's autocast: what
        ``Health``'s activation hooks watch when the step itself is a CUDA-graph replay (no Python runs inside), and
        what ``LearningCheck`` compares. In eval mode: dropout off, so the probe draws
        no random numbers and the training that follows is unchanged (sinkflow's networks have no batch statistics
        that eval mode would swap). Every module's own mode comes back afterwards: ``model.train(flag)`` would set the
        root's on all, flipping a submodule a user's network keeps in eval (a frozen, pretrained encoder) to train."""
        if self.channels_last:
            batch = to_channels_last(batch)
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with self._autocast():
                return self.task.loss(self.model, batch).float()
        finally:
            for module, training in modes:  # Module.train's own assignment, one module at a time
                module.training = training

    def _autocast(self, cache: bool = True) -> torch.autocast:
        """The phase's autocast (``precision``: bf16 / fp16; fp32 = disabled)."""
        return autocast(self.device.type, self.precision, cache)

    def _update(self, batch: Any, step: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, clip, the non-finite guard and the optimizer for step ``step`` (1-based): what a
        step graph captures (no host reads where the optimizer skips on the device). Under torchrun with a captured
        step the gradients are averaged between the backward and the rest (``grad_sync``), where the graph splits."""
        total = self._backward(batch)
        if self.grad_sync is not None:
            self.grad_sync(total)
        return self._apply(step, total)

    def _backward(self, batch: Any) -> torch.Tensor:
        """The loss's backward over the step's micro-batches (gradients accumulated; DDP all-reduces with the last):
        their summed loss as a 0-dim float32 device tensor."""
        micro = split_batch(batch, self.cfg["accum"])
        self.optimizer.zero_grad(set_to_none=True)
        if self.compile_mode not in (None, *fast_path.GRAPHLESS_MODES):  # CUDA graphs: a new iteration, the last
            # step's outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        total = torch.zeros((), device=self.device)
        cache = self.step_graph is None  # a cached weight cast would outlive a capture
        for i, part in enumerate(micro):
            if self.channels_last:
                part = to_channels_last(part)
            sync = i == len(micro) - 1 or not self.info.enabled or self.grad_sync is not None
            ctx = self.ddp_model.no_sync() if not sync else contextlib.nullcontext()
            with ctx, self._autocast(cache):
                loss = self.task.loss(self.ddp_model, part) / len(micro)
            self.scaler.scale(loss).backward()
            total = total + loss.detach().float()
        return total

    def _apply(self, step: int | torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, clip, the non-finite guard and the optimizer on the step's gradients: (loss, grad norm)."""
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg["grad_clip"]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf"))
        if self.skip_on_device:  # the fused kernel leaves weights and moments untouched where the flag is set
            # a torchrun job's captured step: the loss's check came over the ranks with the gradients (no collective
            # inside the update's graph)
            agreed = None if self.grad_sync is None else self.grad_sync.loss_bad
            flag = self.guard.update(step, total, grad_norm, agreed)
            if self.scaler.is_enabled():  # fp16: GradScaler hands the kernel its own Inf/NaN-gradient flag, the
                skip_with_scaler(self.scaler, self.optimizer, flag)  # guard's or-ed into it
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.found_inf = flag
                try:
                    self.scaler.step(self.optimizer)
                finally:
                    del self.optimizer.found_inf
        else:
            failure = self.guard.check_now(total, grad_norm)
            if failure is not None:  # never apply it: the weights (and the next checkpoint) would be NaN
                self.stop_non_finite(failure, int(step))
            self.scaler.step(self.optimizer)
        self.scaler.update()
        return total, grad_norm

    def raise_if_non_finite(self) -> None:
        """Stop (one sync) if a step the device skipped was non-finite; its update was not applied. Under float16
        also if GradScaler's scale fell below 1: the gradients are Inf/NaN even unscaled, so it skips every update
        and halves the scale again (a run that would go on without learning, its loss flat)."""
        if self.skip_on_device:
            failure = self.guard.failure()
            if failure is not None:
                self.stop_non_finite(*failure)
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0  # one more read, on the same step
        if scale < 1.0:
            skipped = self.step - optimizer_steps(self.optimizer)
            self.stop_non_finite(f"float16 loss scale {scale:.2g} ({skipped} of {self.step} "
                                 "updates skipped: Inf/NaN gradients even unscaled)", self.step,
                                 f"set train.{self.task.model_key}.precision=bf16 (or fp32), or lower the learning "
                                 f"rate")

    def checked_step(self, batch) -> torch.Tensor:
        """``train_step(batch)``'s loss, for a tool that takes single steps and goes on past a non-finite one (lr-find,
        doctor's overfit rules): ``NonFiniteStep`` if the device skipped the step just taken (one read), the guard's
        record then cleared. The loop keeps the record sticky until its next check stops the run; a sweep that went
        on past it trained nothing more (lr-find recorded every later loss as if applied, and a step with NaN
        gradients as a point, where foreach Adam's host check raises and the next step applies; doctor blamed the
        wiring, "the loop is broken")."""
        loss = self.train_step(batch)[0]
        if self.skip_on_device:
            failure = self.guard.failure()
            if failure is not None:
                self.guard.clear()
                self.stop_non_finite(*failure)
        return loss

    def stop_non_finite(self, what: str, step: int, fix: str = "lower the learning rate (sinkflow lr-find), set a "
                        "grad_clip, or check the data") -> None:
        """Stop with a non-finite step unapplied, saying which checkpoint a resume would use."""
        kept = self.ckpts.last_good() if self.ckpts is not None else "no checkpoint was written"
        raise NonFiniteStep(f"{what} in phase '{self.name}' at step {step}; the step was not applied and "
                            f"{kept}", fix, step=step, what=what)

    # ---- the loop -------------------------------------------------------------------------------
    def request_stop(self, signum: int = REQUESTED) -> None:
        """Stop at the next unit boundary exactly as on a signal: checkpoint, then ``Interrupted``, which says it was
        this request (a SIGTERM's exit status; ``signum`` a signal's number to stop as that signal would)."""
        self._stop = signum

    def stop(self) -> None:
        """End the phase after the current hook, writing nothing: called in ``on_train_batch_start`` the
        step is not taken. ``fit()`` returns with ``stopped`` set; no ``final.pt``, no ``on_phase_end``
        (doctor and lr-find stop a trainer ready before its first step this way). Under torchrun the ranks agree on
        it as on a stop request (``_agree_stop``, at the next agreement: a few steps later), then all end: a rank
        whose callback stopped alone (its own shard's loss) left the others waiting in the next all-reduce."""
        if self.info.enabled:
            self._stop = self._stop if self._stop is not None else QUIET
        else:
            self.stopped = True

    @property
    def total(self) -> int:
        """Progress-bar items of the whole phase (optimizer steps; pool batches for the pool)."""
        return self.cfg["iters"] if self.training else self.task.progress_total

    @property
    def progress(self) -> int:
        return self.step if self.training else self.task.progress_done

    def log_step(self) -> bool:
        """Is the step just taken a logging step (``log_every``, and the last one)?"""
        return self.step % self.cfg["log_every"] == 0 or self.step == self.cfg["iters"]

    def fit(self) -> None:
        """Run the task to its final checkpoint (resuming what is on disk); ``Interrupted`` on a stop."""
        try:
            self.task.open(self.run)
            if self.training:
                self._fit_training()
            else:
                self._fit_chunks()
        except BaseException as exc:
            if isinstance(exc, torch.OutOfMemoryError) and not hasattr(exc, "sinkflow_where"):  # the CLI turns it
                # into one line (sinkflow.tools.oom); a task's own work that says where it was (NSGF++'s states)
                # keeps it
                kept = self.ckpts.last_good() if self.ckpts is not None else None
                exc.sinkflow_where = {"phase": self.name, "step": self.step + 1, "training": self.training,
                                      "kept": kept}
            self._call("on_exception", exc)
            raise
        finally:
            self._call("teardown")
            # the phase is over: its graph's memory goes back now. Not after stop() before a step (lr-find,
            # doctor and the memory benchmark take their steps on the ready trainer afterwards)
            if self.step_graph is not None and not self.stopped:
                self.step_graph.release()

    def _fit_training(self) -> None:
        run = self.run
        self.setup()
        self._call("on_setup")
        ckpts = self.ckpts = run.checkpoints(self.name)
        latest = ckpts.latest()  # checked: loads safely, belongs to this run, holds the step its name says
        # the losses since the last log step: on the device until a log step reads them; a checkpoint holds them, so
        # a run resumed inside a logging window logs the mean the uninterrupted run logs
        self.loss_sum, self.loss_count = torch.zeros((), device=self.device), 0
        if latest is not None:
            self.load_state_dict(latest, str(ckpts.steps()[-1][1]))
            dist.on_main(lambda: run.record_hand_edits(self.task.model_key, latest.get("train"), self.name, self.step))
            self._call("on_load_checkpoint", latest)
            if self.info.is_main:  # status may show a later step: what a killed process did past its checkpoint
                log.info("%s: resuming from step %d of %d (%s)", self.name, self.step, self.cfg["iters"],
                         ckpts.steps()[-1][1].name)
                changed = self.resolved_change(latest.get("resolved"), self.step)
                if changed:
                    log.info("%s", changed)
        moved = run.logger.rewind(self.name, self.step)  # what a killed process logged past this step, set aside
        if moved and self.info.is_main:  # no checkpoint at all (deleted?): the phase starts over, and says so
            (log.info if latest is not None else log.warning)(
                "%s: %s from step %d; the %d records logged past it (to step %d) are moved to metrics.rewound.jsonl",
                self.name, "training" if latest is not None else "no step checkpoint found: training again",
                self.step, len(moved), max(r["step"] for r in moved))
        iters, ckpt_every = self.cfg["iters"], self.cfg["ckpt_every"]
        # status before the first log step: the resumed step, not the "step 0" of the phase's start (nor, after a
        # kill in that window, a DEAD run at step 0 beside its step checkpoint)
        run.logger.heartbeat(phase=self.name, step=self.step, total=iters, state="running", world=self.info.world)
        tick, tick_step = time.perf_counter(), self.step
        beat = tick
        self._next_agree, self._agreed = self.step + 1, (tick, self.step)  # the first step's agreement sets the pace
        n_global = self.cfg["batch_size"] * self.info.world
        task, device = self.task, self.device
        self.batches = BatchPrefetcher(lambda: task.draw(self.generator, n_global, device), self.generator, device,
                                       ahead=use_prefetch(self.cfg.get("prefetch", "auto"), device),
                                       prepare=lambda drawn: task.prepare(drawn, device))
        try:
            self._call("on_phase_start")
            while self.step < iters:
                batch = self.batch = self.batches.next(wanted=iters - self.step - 1)
                self._call("on_train_batch_start", batch)
                if self.stopped:
                    return
                if self.rank_dropout:
                    torch.manual_seed(stream_seed(run.cfg["experiment"]["seed"], "dropout", self.name,
                                                  self.info.rank, self.step))
                loss, grad_norm = self.train_step(batch)
                self.step += 1
                self.last_units = 1
                self.loss_sum, self.loss_count = self.loss_sum + loss, self.loss_count + 1
                self._call("on_train_batch_end", batch, (loss, grad_norm))
                checkpoint = self.step % ckpt_every == 0
                if self.log_step() or checkpoint:
                    self.raise_if_non_finite()  # one sync: a bad step stops the run before it is logged or saved
                if self.log_step():
                    rate = (self.step - tick_step) / max(time.perf_counter() - tick, 1e-9)
                    mean = dist.mean_over_ranks(float(self.loss_sum) / self.loss_count)
                    metrics = {"loss": mean, "lr": self.optimizer.param_groups[0]["lr"],
                               "grad_norm": float(grad_norm), "steps_per_s": rate, "samples_per_s": rate * n_global}
                    try:
                        self._call("on_log", metrics)
                    except SinkflowError:  # a stop on this step's metrics (DivergenceGuard) still records them: the
                        # loss its line names was missing from metrics.jsonl and TensorBoard, whose curve ended a log
                        # step before the blow-up (the run's only record where it was the first log step); a disk
                        # too full for the record must not put its OSError in the place of the stop's own line
                        with contextlib.suppress(OSError):
                            run.logger.log(self.name, self.step, metrics)
                        raise
                    run.logger.log(self.name, self.step, metrics)
                    run.logger.heartbeat(phase=self.name, step=self.step, total=iters, rate=rate,
                                         eta_s=(iters - self.step) / max(rate, 1e-9), loss=mean, state="running",
                                         world=self.info.world)
                    self.loss_sum, self.loss_count = torch.zeros((), device=self.device), 0
                    tick, tick_step = time.perf_counter(), self.step
                    beat = tick
                elif time.perf_counter() - beat > HEARTBEAT_EVERY_S:  # no log step for a minute: the step and rate
                    # the host has seen (a loss would cost a sync), so a long log_every is not STALE
                    beat = time.perf_counter()
                    rate = (self.step - tick_step) / max(beat - tick, 1e-9)
                    run.logger.heartbeat(phase=self.name, step=self.step, total=iters, rate=rate,
                                         eta_s=(iters - self.step) / max(rate, 1e-9), state="running",
                                         world=self.info.world)
                # every rank agrees on a stop in the same step; under DDP that costs a sync, so at log and
                # checkpoint steps and every AGREE_EVERY_S seconds of steps between (torchrun kills a worker 30 s
                # after its SIGTERM: a stop agreed only at log steps 100 slow steps apart lost them all);
                # alone, a signal is a Python flag and is read every step
                due = checkpoint or self.log_step() or self.step >= self._next_agree
                signum = self._agree_stop() if (not self.info.enabled or due) else None
                if signum is not None and self.step >= iters:  # the last step: the phase ends (final.pt), and
                    self.stop_at_end, signum = signum, None  # the run stops before the next phase (run_phases)
                if signum is not None:
                    self.raise_if_non_finite()
                if checkpoint or signum is not None:
                    self.save()
                if signum is not None:
                    raise Interrupted(signum, self.name, self.step)
                if self.stopped:
                    return
            self.raise_if_non_finite()
            dist.on_main(lambda: ckpts.save_final({"step": self.step, **self.state_dict()}))
        finally:
            self.batches.close()
        dist.barrier()
        self._call("on_phase_end")

    def _fit_chunks(self) -> None:
        task = self.task
        self.step = task.position  # a resumed build with every unit recorded stands there, not at 0
        t0, done0 = time.perf_counter(), task.progress_done
        self._call("on_phase_start")
        while not task.finished():
            unit = task.next_unit()
            self._call("on_train_batch_start", unit)
            if self.stopped:
                return
            before = task.progress_done
            task.run_unit(unit)  # persists the task's progress before it returns
            self.last_units = task.progress_done - before  # every rank's work (the bar stopped at 1/world)
            self.step = task.position
            self._call("on_train_batch_end", unit, self.last_units)
            # status counts what the bar counts (batches, every rank's), with their rate and ETA
            rate = (task.progress_done - done0) / max(time.perf_counter() - t0, 1e-9)
            self.run.logger.heartbeat(phase=self.name, step=task.position, total=task.total, state="running",
                                      world=self.info.world, done=task.progress_done, of=task.progress_total,
                                      unit="batches", rate=rate,
                                      eta_s=(task.progress_total - task.progress_done) / max(rate, 1e-9))
            signum = self._agree_stop()
            # after the last unit recorded the phase ends as usual (finished() alone is no proof: a unit a signal
            # abandoned is past too, unrecorded)
            if signum is not None and task.position < task.total:
                raise Interrupted(signum, self.name, task.position, task.progress_done, task.progress_total)
            if signum is not None:
                self.stop_at_end = signum
            if self.stopped:
                return
        task.close()
        dist.on_main(lambda: self.run.checkpoints(self.name).save_final(task.final_state()))
        self._call("on_phase_end")

    def _agree_stop(self) -> int | None:
        """A signal or a callback's stop request, agreed by every rank (they stop in the same step). Under DDP in a
        training phase the same collective sets the next agreement: ``AGREE_EVERY_S`` seconds of steps at the rate
        since this one, the slowest rank's (the first steps, slow with compilation, agree often and then less)."""
        signum = self._stop if self._stop is not None else stop_requested()
        if signum == QUIET:  # a signal since the quiet stop was asked wins
            signum = stop_requested() or QUIET
        if not (self.info.enabled and self.training):
            signum = dist.agree_stop(signum)
        else:
            now, (then, step) = time.perf_counter(), self._agreed
            pace = AGREE_EVERY_S * (self.step - step) / max(now - then, 1e-9)
            signum, steps = dist.agree_stop_paced(signum, int(pace))
            self._next_agree, self._agreed = self.step + steps, (now, self.step)
        if signum == QUIET:  # some rank's trainer.stop(): every rank ends the phase here, writing nothing
            self.stopped = True
            return None
        return signum

    def save(self) -> None:
        """A step checkpoint (main process), then every rank waits for it; a failed write (a full disk) is every
        rank's one line (``dist.on_main``: the other ranks printed a gloo traceback wall from the barrier)."""
        window = {"loss_sum": dist.mean_over_ranks(float(self.loss_sum)), "count": self.loss_count}  # every rank's
        dist.on_main(lambda: self.ckpts.save({**self.state_dict(), "log_window": window}, self.step))
        self._call("on_checkpoint")


class NonFiniteStep(SinkflowError):
    """A step stopped before a non-finite loss or gradient was applied (lr-find records it as a gap); ``step``: the
    step that was not (found on the device at a later log step: status said "stopped at step 10: ... at step 2").
    Under torchrun every rank raises it alike (the flag and the values are agreed over ranks), so rank 0 alone
    prints it: each rank printed its own line, 8 GPUs 8 lines."""

    def __init__(self, problem: str, fix: str | None = None, *, step: int | None = None, what: str = ""):
        super().__init__(problem, fix, every_rank=True)
        self.step, self.what = step, what  # what: "non-finite loss (nan)", ... (doctor names it in a finding)


def too_short(train: dict, key: str) -> list[str]:
    """What ``train.<key>`` sets that its own ``iters`` are too few for, one line each with the fix: a warm-up still
    running at the last step (`--train-iters 40` under a preset's warm-up of 50), an EMA keeping more than
    ``START_SHARE`` of the first step's weights in the model the sampler uses. The Trainer warns with them before the
    first step; preflight reports them on the real config (its own cut runs are shortened: tools.phases.quiet_cut)."""
    lines, iters = [], train["iters"]
    if train["warmup"] >= iters:
        lines.append(f"train.{key}.warmup={train['warmup']} >= train.{key}.iters={iters}: the rate is still warming "
                     f"up at the last step ({train.get('schedule', 'constant')} never decays); "
                     f"lower train.{key}.warmup")
    remains = first_step_share(train["ema"], iters, train["ema_warmup"])
    if iters > 1 and remains > START_SHARE:
        fix = "" if train["ema_warmup"] else f"train.{key}.ema_warmup=true or "
        lines.append(f"train.{key}.ema={train['ema']:g} over train.{key}.iters={iters} keeps {100 * remains:.1f} % of "
                     f"the first step's weights in the averaged model the sampler uses; set {fix}train.{key}.ema="
                     f"{largest_decay(iters):g} or lower, or train longer")
    return lines


def check_step_graph(cfg: dict, key: str, compile_mode: str | None, skips_on_device: bool) -> None:
    """Refuse, before the first step, a ``graph: step`` phase whose step a CUDA graph cannot hold. Under torchrun
    every rank refuses alike (one config, checked the same; one torch; one kind of device): rank 0 says it once."""
    if compile_mode not in (None, *fast_path.GRAPHLESS_MODES):
        raise SinkflowError(f"train.{key}.graph=step captures the whole step; compile_mode={compile_mode} would "
                            "capture graphs inside it", f"set train.{key}.compile_mode=default (or "
                            "max-autotune-no-cudagraphs, or compile=false)", every_rank=True)
    if not skips_on_device:
        raise SinkflowError(f"train.{key}.graph=step needs Adam's fused kernel (it skips a non-finite update on the "
                            f"device); this torch has none for this device", f"set train.{key}.graph=none",
                            every_rank=True)


def use_channels_last(cfg: dict, device: torch.device, shape: tuple[int, ...]) -> bool:
    """channels_last pays off for convolutions on CUDA (NHWC tensor-core kernels); only 4-D batches."""
    return bool(cfg.get("channels_last", False)) and device.type == "cuda" and len(shape) == 3


def to_channels_last(batch: Any) -> Any:
    """Every 4-D tensor of a tensor / tuple / dict batch in channels_last memory format (values unchanged)."""
    if isinstance(batch, torch.Tensor):
        return batch.contiguous(memory_format=torch.channels_last) if batch.dim() == 4 else batch
    if isinstance(batch, dict):
        return {k: to_channels_last(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_channels_last(v) for v in batch)
    return batch


def lr_factor(schedule: str, warmup: int, iters: int, phase: str = "velocity") -> Callable[[int], float]:
    """The LR multiplier after ``step`` optimizer steps: linear warm-up, then constant or cosine decay to 0.

    Cosine decay is the default for every regression phase: with a constant LR the final weights keep
    the noise of the last updates (measured on the 2D tasks: W2 differs by ~0.1 between 10k and 20k steps).
    """
    if schedule not in ("constant", "cosine"):
        raise SinkflowError(f"train.{phase}.schedule={schedule!r} is not one of constant, cosine",
                            f"set train.{phase}.schedule=cosine")

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        done = (step - warmup) / max(1, iters - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    return factor


def split_batch(batch: Any, parts: int) -> list:
    """Split a tensor / tuple / dict batch into ``parts`` micro-batches along dim 0."""
    if parts <= 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(parts))
    if isinstance(batch, dict):
        chunks = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: chunks[k][i] for k in batch} for i in range(len(next(iter(chunks.values()))))]
    if isinstance(batch, (tuple, list)):
        chunks = [split_batch(v, parts) for v in batch]
        return [type(batch)(c[i] for c in chunks) for i in range(len(chunks[0]))]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}")
