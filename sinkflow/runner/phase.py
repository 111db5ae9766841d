"""Phases: the resumable units an experiment is made of, and the one training loop they share.

A ``Phase`` runs to completion and writes ``final.pt``; the runner skips it next time. A
``TrainPhase`` owns one model, its optimizer, LR schedule, optional EMA and autocast, and the
phase's own random generator. Everything it needs to continue bit-for-bit (weights, optimizer,
scheduler, scaler, EMA, step, generator and global RNG states) is in every step checkpoint.
"""

from __future__ import annotations

import math
import os
import random
import time
import zlib
from typing import Any, Callable

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm.auto import tqdm

from sinkflow.errors import SinkflowError
from sinkflow.runner import dist
from sinkflow.runner.checkpoint import rng_state, set_rng_state
from sinkflow.runner.signals import Interrupted, stop_requested
from sinkflow.tools.health import Health


def phase_generator(seed: int, *tags: Any) -> torch.Generator:
    """A CPU generator whose seed depends only on (seed, tags): phases never share a stream."""
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(repr(tags).encode())) % (2**63))
    return gen


def seed_everything(seed: int) -> None:
    """Seed the global torch / numpy / python RNGs (model init, dropout) from one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def progress(total: int, initial: int, desc: str):
    enabled = dist.current().is_main and os.environ.get("SINKFLOW_PROGRESS", "1") != "0"
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True,
                mininterval=1.0, smoothing=0.1)


def build_phase_model(run, phase: str) -> torch.nn.Module:
    """The (untrained) network of a training phase, built from ``model.<phase>`` and the data shape."""
    from sinkflow.methods import sample_shape
    from sinkflow.models import build_model

    cfg = dict(run.cfg["model"][phase])
    return build_model(cfg.pop("kind"), cfg, sample_shape(run.cfg))


class Phase:
    """One resumable step of an experiment. Subclasses implement ``run``."""

    name: str = "phase"

    def run(self, run) -> None:
        raise NotImplementedError


class TrainPhase(Phase):
    """Minimise ``loss_fn(model, batch)`` over batches from ``make_batch(generator, n_global, device)``.

    ``make_batch`` draws the *global* batch's randomness from the phase generator and returns only
    this rank's shard (``dist.shard``), so one process and N processes see the same global batch.
    """

    def __init__(self, name: str, make_batch: Callable, loss_fn: Callable, model_key: str | None = None):
        self.name = name
        self.model_key = model_key or name
        self.make_batch = make_batch
        self.loss_fn = loss_fn

    # ---- construction ---------------------------------------------------------------------------
    def setup(self, run) -> None:
        cfg = run.cfg["train"][self.model_key]
        self.cfg = cfg
        self.info = dist.current()
        seed = run.cfg["experiment"]["seed"]
        seed_everything(int(phase_generator(seed, "init", self.name).initial_seed()))  # same init on every rank
        self.model = build_phase_model(run, self.model_key).to(run.device)
        self.channels_last = use_channels_last(cfg, run.device, _data_shape(run))
        if self.channels_last:  # NHWC convolutions (tensor cores) for 4-D image batches
            self.model = self.model.to(memory_format=torch.channels_last)
        self.model.train()
        lr = cfg["lr"] * lr_scale(cfg["lr_scaling"], self.info.world)
        fused = run.device.type == "cuda"
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0,
                                          **({"fused": True} if fused else {"foreach": True}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(cfg.get("schedule", "constant"), cfg["warmup"], cfg["iters"], self.model_key))
        self.ema = None
        if cfg["ema"] > 0:
            self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(cfg["ema"]), use_buffers=True)
        self.precision = cfg["precision"]
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise SinkflowError(f"train.{self.model_key}.precision={self.precision!r} is not one of fp32, bf16, fp16",
                                f"set train.{self.model_key}.precision=bf16")
        self.scaler = torch.amp.GradScaler(run.device.type, enabled=self.precision == "fp16")
        self.ddp_model = self.model
        if self.info.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp_model = DDP(self.model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
        if cfg.get("compile", False):  # opt-in: minutes of compilation before the first step
            self.ddp_model = torch.compile(self.ddp_model)
        self.generator = phase_generator(run.cfg["experiment"]["seed"], "train", self.name)
        self.step = 0

    def state_dict(self) -> dict:
        return {
            "phase": self.name,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
            "ema_state": self.ema.state_dict() if self.ema is not None else None,
            "generator": self.generator.get_state(),
            "rng": rng_state(),
            "world_size": self.info.world,
        }

    def load_state_dict(self, state: dict, where: str) -> None:
        from sinkflow.runner.run import load_model_state

        load_model_state(self.model, state["model"], where)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
            if self.ema is not None and state.get("ema_state") is not None:
                self.ema.load_state_dict(state["ema_state"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise SinkflowError(f"checkpoint {where} does not match this phase's optimizer ({exc})",
                                "resume with the config the run was trained with") from None
        if state.get("world_size", 1) != self.info.world:  # lr follows the documented scaling rule
            base = self.cfg["lr"] * lr_scale(self.cfg["lr_scaling"], self.info.world)
            for group in self.optimizer.param_groups:
                group["initial_lr"] = base
            self.scheduler.base_lrs = [base for _ in self.scheduler.base_lrs]
            for group, fn in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
                group["lr"] = base * fn(self.scheduler.last_epoch)
            self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.generator.set_state(state["generator"])
        set_rng_state(state["rng"])
        self.step = state["step"]

    # ---- the loop -------------------------------------------------------------------------------
    def train_step(self, batch: Any) -> tuple[float, float]:
        """One optimizer step (with accumulation); returns (loss, grad-norm)."""
        device_type = self.model_device_type
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        micro = split_batch(batch, self.cfg["accum"])
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i, part in enumerate(micro):
            if self.channels_last:
                part = to_channels_last(part)
            sync = i == len(micro) - 1 or not self.info.enabled
            ctx = self.ddp_model.no_sync() if not sync else _nullcontext()
            with ctx, torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = self.loss_fn(self.ddp_model, part) / len(micro)
            value = dist.mean_over_ranks(loss.item())  # every rank sees the same value (and stops together)
            if not math.isfinite(value):
                self.stop_non_finite(f"non-finite loss ({value})")
            self.scaler.scale(loss).backward()
            total += value
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg["grad_clip"]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        if not self.scaler.is_enabled():  # fp16: the scaler skips steps with inf/NaN gradients by design
            norm = dist.mean_over_ranks(float(grad_norm))  # every rank stops together
            if not math.isfinite(norm):  # never apply it: the weights (and the next checkpoint) would be NaN
                self.stop_non_finite(f"non-finite gradient norm ({norm}) with a finite loss ({total:.4g})")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        return total, float(grad_norm)

    def stop_non_finite(self, what: str) -> None:
        """Stop before a non-finite step is applied, saying which checkpoint a resume would use."""
        kept = self.ckpts.last_good() if getattr(self, "ckpts", None) is not None else "no checkpoint was written"
        raise SinkflowError(f"{what} in phase '{self.name}' at step {self.step + 1}; the step was not applied and "
                            f"{kept}", "lower the learning rate (sinkflow lr-find), set a grad_clip, or check the data")

    def run(self, run) -> None:
        self.setup(run)
        self.model_device_type = run.device.type
        ckpts = self.ckpts = run.checkpoints(self.name)
        latest = ckpts.latest()  # checked: loads safely, belongs to this run, holds the step its name says
        if latest is not None:
            self.load_state_dict(latest, str(ckpts.steps()[-1][1]))
        iters, log_every, ckpt_every = self.cfg["iters"], self.cfg["log_every"], self.cfg["ckpt_every"]
        bar = progress(iters, self.step, self.name)
        window: list[float] = []
        tick, tick_step = time.perf_counter(), self.step
        n_global = self.cfg["batch_size"] * self.info.world  # batch_size is per process (dist.py)
        health = Health(self, run.logger)  # dashboard: update ratio, dead activations, loss scale, histograms
        while self.step < iters:
            batch = self.make_batch(self.generator, n_global, run.device)
            health.before_step()
            loss, grad_norm = self.train_step(batch)
            self.step += 1
            window.append(loss)
            bar.update(1)
            health.histograms()
            if self.step % log_every == 0 or self.step == iters:
                elapsed = time.perf_counter() - tick
                rate = (self.step - tick_step) / max(elapsed, 1e-9)
                mean = sum(window) / len(window)
                bar.set_postfix(loss=f"{mean:.4g}")
                run.logger.log(self.name, self.step, {
                    "loss": mean, "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm,
                    "steps_per_s": rate, "samples_per_s": rate * n_global, **health.collect()})
                run.logger.heartbeat(phase=self.name, step=self.step, total=iters, rate=rate,
                                     eta_s=(iters - self.step) / max(rate, 1e-9), loss=mean, state="running")
                window.clear()
                tick, tick_step = time.perf_counter(), self.step
            signum = dist.agree_stop(stop_requested())
            if self.step % ckpt_every == 0 or signum is not None:
                self.save(run)
            if signum is not None:
                bar.close()
                raise Interrupted(signum, self.name, self.step)
        bar.close()
        if self.info.is_main:
            run.checkpoints(self.name).save_final({"step": self.step, **self.state_dict()})
        dist.barrier()

    def save(self, run) -> None:
        if self.info.is_main:
            run.checkpoints(self.name).save(self.state_dict(), self.step)
        dist.barrier()


def _data_shape(run) -> tuple[int, ...]:
    from sinkflow.methods import sample_shape

    return sample_shape(run.cfg)


def use_channels_last(cfg: dict, device: torch.device, shape: tuple[int, ...]) -> bool:
    """channels_last pays off for convolutions on CUDA (NHWC tensor-core kernels); only 4-D batches."""
    return bool(cfg.get("channels_last", True)) and device.type == "cuda" and len(shape) == 3


def to_channels_last(batch: Any) -> Any:
    """Every 4-D tensor of a tensor / tuple / dict batch in channels_last memory format (values unchanged)."""
    if isinstance(batch, torch.Tensor):
        return batch.contiguous(memory_format=torch.channels_last) if batch.dim() == 4 else batch
    if isinstance(batch, dict):
        return {k: to_channels_last(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_channels_last(v) for v in batch)
    return batch


def device_generator(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded by one draw from the phase's CPU generator.

    Noise drawn with it is generated on the GPU (no host randn, no copy), yet the whole stream is still
    fixed by the CPU generator, which is what checkpoints save: a resumed run draws the same noise.
    On the CPU this is the CPU generator itself (results identical to drawing from it directly).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


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


def lr_scale(rule: str, world: int) -> float:
    """Learning-rate factor when the global batch grows with the number of processes."""
    if rule == "none" or world == 1:
        return 1.0
    if rule == "linear":
        return float(world)
    if rule == "sqrt":
        return math.sqrt(world)
    raise SinkflowError(f"unknown lr_scaling rule '{rule}'", "use none, linear or sqrt")


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


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
