"""NSGF++ (paper Algorithms 3-4): a <=5-step Sinkhorn flow, a time predictor, then a straight flow.

Phases, each resumable with its own model, optimizer and config section:

1. ``pool``     the NSGF trajectory pool, T = pool.steps <= 5 Euler steps per trajectory (nsgf's phase);
2. ``velocity`` NSGF velocity matching on the pool (nsgf's phase), network ``model.velocity``;
3. ``nsf``      Neural Straight Flow: velocity matching on X_t = t Y + (1 - t) X0 with *independent*
                noise/data pairs (plain FM, sigma = 0), network ``model.nsf``, at t ~ U[nsgf.nsf_t_min, 1)
                (sampling only runs it from t_hat to 1); from a fresh init (the paper's), or with
                ``nsgf.nsf_init: velocity`` from the trained velocity network's weights. With
                ``nsgf.nsf_source: velocity`` X0 is not noise but the trained velocity network's own NSGF states
                (``NSGFStates``, near the authors' dev code), so the straight flow starts where the NSGF part ends;
4. ``time``     the phase-transition predictor: regress t from the same X_t (MSE, sigmoid output),
                network ``model.time``.

Sampling (Algorithm 4): the T NSGF Euler steps on the pool's own grid (``nsgf.network_grid``; or
``sample.nsgf_steps`` uniform steps over the same span when the field was trained on segments), then
t_hat_i = t_phi(x_i) per sample (plus ``sample.t_shift``, 0 in the paper), then NSF Euler from t_hat_i to 1 in
``nsf_steps`` steps of per-sample size (1 - t_hat_i) / nsf_steps. So every sample costs exactly T + 1 + nsf_steps
network evaluations (``nsgf_steps`` + 1 + nsf_steps when ``sample.nsgf_steps`` is set) and a batch needs no masking
(docs/nsgfpp.md, ambiguity 8).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from sinkflow.data.atomic_write import atomic_write_bytes
from sinkflow.errors import SinkflowError
from sinkflow.methods import nsgf
from sinkflow.methods.base import Method, checkpoint_bytes
from sinkflow.methods.flow_matching import InterpolantStep
from sinkflow.methods.ode import count_nfe, euler
from sinkflow.methods.pool import check_free_disk, check_pool_fits
from sinkflow.runtime import dist
from sinkflow.runtime.autocast import autocast, fp16_overflow
from sinkflow.runtime.callbacks import LEARNING_LOG
from sinkflow.runtime.metrics import HEARTBEAT_EVERY_S
from sinkflow.runtime.rng import phase_generator
from sinkflow.runtime.signals import Interrupted, signalled

# arXiv:2401.14069v1 Table 3 (MNIST) and Table 2 (CIFAR-10): NSGF++'s FID (and IS) at NFE, for context.
PAPER_FID = {"mnist": {"fid": 3.8, "nfe": 60}, "cifar10": {"fid": 5.55, "is": 8.86, "nfe": 59}}

MAX_NSGF_STEPS = 5  # paper: "T <= 5"; a longer NSGF phase is plain NSGF, not NSGF++
# The predictor has learned where a state lies once its MSE is below this fraction of a constant guess's
# (Var t = (1 - t_min)^2 / 12). Measured on the CPU MNIST benchmark: 200 steps at lr 1e-4 left 0.87 (seed 0; t_hat
# 0.55 for every state), at lr 1e-3 0.024 (benchmarks/RESULTS.md, "NSGF++'s time predictor on real MNIST").
LEARNED_FRACTION = 0.5
# Below this many dimensions t cannot be read off a point (2-D moons: 55 % of a constant guess's MSE after 15k steps
# at lr 1e-3, the interpolants overlap), so no warning there; 8x8 digits' predictor reaches 4.7 %, MNIST's 2-3 %.
IDENTIFIABLE_DIMS = 64
CHECK_BATCH, CHECK_SEED = 512, 20261128  # the check's own draw: the phase generator's stream is untouched
learning = logging.getLogger(LEARNING_LOG)  # a tool's few-step scratch run never learns: ``quiet()`` silences it
log = logging.getLogger(__name__)
STATES_FILE = "nsf_states.npy"  # nsgf.nsf_source=velocity: the NSGF states the straight flow's paths start from
SCRATCH_STATES = 256  # nsgf.nsf_states of a tool's scratch run: its straight flow needs states to draw, not many


def check(cfg: dict, sample_shape: tuple[int, ...]) -> None:
    """Refuse, before any work, what NSGF++ cannot run."""
    nsgf.check(cfg)
    steps = cfg["pool"]["steps"]
    if steps > MAX_NSGF_STEPS:
        raise SinkflowError(
            f"pool.steps={steps} but NSGF++ uses at most {MAX_NSGF_STEPS} NSGF steps (paper Alg. 3)",
            f"set pool.steps<={MAX_NSGF_STEPS} (and raise pool.eta), or use --method nsgf for a long flow")
    if cfg["sample"]["nsf_steps"] < 1:
        raise SinkflowError(f"sample.nsf_steps={cfg['sample']['nsf_steps']} must be >= 1", "e.g. sample.nsf_steps=50")
    check_nsgf_steps(cfg)
    check_pool_fits(cfg["pool"], sample_shape)
    if cfg["nsgf"]["nsf_init"] == "velocity" and cfg["model"]["nsf"] != cfg["model"]["velocity"]:
        differ = sorted(k for k in {*cfg["model"]["nsf"], *cfg["model"]["velocity"]}
                        if cfg["model"]["nsf"].get(k) != cfg["model"]["velocity"].get(k))
        raise SinkflowError(f"nsgf.nsf_init=velocity starts the straight flow from the velocity network, but "
                            f"model.nsf and model.velocity differ in {', '.join(differ)}",
                            "give both the same model keys, or set nsgf.nsf_init=random")
    t_min = float(cfg["nsgf"]["nsf_t_min"])
    if cfg["nsgf"]["nsf_source"] == "velocity" and t_min > 0:
        raise SinkflowError(f"nsgf.nsf_source=velocity starts the straight flow's paths at the NSGF states (t = 0), "
                            f"but nsgf.nsf_t_min={t_min:g} trains it only from there on",
                            "set nsgf.nsf_t_min=0, or nsgf.nsf_source=noise")


def check_nsgf_steps(cfg: dict) -> None:
    """``sample.nsgf_steps`` other than the pool's T needs a field trained between the grid times."""
    k = cfg["sample"].get("nsgf_steps")
    if k is None or k == cfg["pool"]["steps"]:
        return
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise SinkflowError(f"sample.nsgf_steps={k!r} is not a positive integer", "use null (the pool's steps) or e.g. 2")
    if float(cfg["nsgf"]["segment"]) <= 0:
        raise SinkflowError(f"sample.nsgf_steps={k} differs from pool.steps={cfg['pool']['steps']} but the NSGF network "
                            "was trained only at the pool's grid times (nsgf.segment=0)",
                            "train with nsgf.segment=0.5, or set sample.nsgf_steps=null")


def nsgf_grid(cfg: dict) -> tuple[list[float], list[float]]:
    """(times, steps) of the NSGF part at sampling: the pool's own grid (``sample.nsgf_steps`` null or equal to
    ``pool.steps``: the grid the field was trained on, not uniform steps, where the schedule is not constant), or
    ``sample.nsgf_steps`` uniform Euler steps over the same span of network time (valid once the field is trained on
    the segments)."""
    times, etas = nsgf.network_grid(cfg)
    k = cfg["sample"].get("nsgf_steps")
    if k is None or k == len(etas):
        return times.tolist(), etas.tolist()
    check_nsgf_steps(cfg)
    t_end = float(times[-1])
    return [t_end * i / k for i in range(k + 1)], [t_end / k] * k


def time_loss(model, batch):
    """Paper Alg. 3: |t - t_phi(X_t)|^2. The predictor returns one time per sample, shaped like ``t`` (N,): one of
    your own returning (N, 1), as a Linear(..., 1) head does, broadcast against t to an (N, N) table and trained
    every prediction towards the batch's mean time, in silence."""
    x, t = batch
    pred = model(x)
    if pred.shape != t.shape:
        raise SinkflowError(f"the time predictor returned shape {tuple(pred.shape)} for {len(t)} samples, not "
                            f"{tuple(t.shape)}", "return one time per sample, e.g. model(x).squeeze(-1)")
    return (pred.float() - t).pow(2).mean()


class NSGFStates:
    """Where NSGF++'s straight-flow paths start with ``nsgf.nsf_source: velocity``: the trained velocity network's
    (EMA weights where it kept them) own NSGF states, ``nsgf_part`` over the sampler's grid (``nsgf_grid``) from
    fresh source noise, so the straight flow learns the way from where the sampler's NSGF part really ends. The
    paper's paths start at noise, and from the network's states its straight flow integrates from places off them:
    on real MNIST more straight-flow steps could not repair those states (benchmarks/RESULTS.md, "Where NSGF++'s
    quality stops with NFE"). The authors' dev code trained its straight segment from the simulated Sinkhorn flow's
    end points, OT-matched to the data batch; these are the network's, which the sampler meets.

    ``nsgf.nsf_states`` states are computed once, when the first phase that draws them opens, from their own
    generator stream, and kept in RUN/nsf_states.npy (float32; no pickle), so a resumed straight-flow phase and the
    predictor after it draw from the same set. A sampleable distribution like any source: ``sample`` draws
    states by index from the phase's generator."""

    name = "nsgf-states"

    def __init__(self, source):
        self.source, self.shape, self.states = source, tuple(source.shape), None

    def open(self, run, phase: str = "nsf") -> None:
        """Compute (rank 0) or read the states. A SIGTERM while rank 0 computes them stops every rank before
        ``phase`` takes a step (``Interrupted``; nothing is kept, a resume computes them again): under torchrun the
        other ranks waited for rank 0, which finished first, and 16,384 CIFAR states on a slow card can outlast
        torchrun's 30 s between its SIGTERM and its SIGKILL (no stop line, status DEAD)."""
        if self.states is not None:
            return
        path = run.dir / STATES_FILE
        if run.read_only and not path.is_file():  # lr-find or doctor on a user's run: computed, not kept
            self.states = torch.from_numpy(self._compute(run, stoppable=False))
            return
        stopped = dist.broadcast_object(dist.on_main(lambda: None if path.is_file() else self._write(run, path, phase)))
        if stopped:  # rank 0's signal (on_main returns its result on rank 0 alone): every rank stops alike
            raise Interrupted(stopped, phase, 0)
        states = np.load(path, allow_pickle=False)
        n = int(run.cfg["nsgf"]["nsf_states"])
        if states.shape != (n, *self.shape) or states.dtype != np.float32:
            raise SinkflowError(f"{path} holds {states.dtype} states of shape {states.shape}, not the run's "
                                f"{n} float32 states of shape {self.shape}",
                                f"delete {path}: the resumed phase computes them again")
        self.states = torch.from_numpy(states)

    def _write(self, run, path: Path, phase: str) -> int | None:
        """RUN/nsf_states.npy, or the signal that stopped the computation (nothing written)."""
        states = self._compute(run, stoppable=True, phase=phase)
        if states is None:
            return signalled()
        atomic_write_bytes(path, lambda f: np.save(f, states, allow_pickle=False))
        return None

    def _compute(self, run, stoppable: bool, phase: str = "nsf") -> np.ndarray | None:
        """The states; if ``stoppable``, None once a signal arrived (``signals.signalled``: not the time limit, which
        lets a unit of work finish) between two of the sampler's chunks (a read-only look, lr-find or doctor, whose
        caller needs the states, is not stoppable)."""
        cfg = run.cfg
        n, chunk = int(cfg["nsgf"]["nsf_states"]), max(1, int(cfg["sample"]["batch_size"]))
        times, etas = nsgf_grid(cfg)
        log.info("%d NSGF states (%d velocity steps each) for the straight flow's paths", n, len(etas))
        velocity = run.model("velocity")
        precision = METHOD.sample_precision(cfg, run.device)
        # the noise in one draw on the host, then through the network in the sampler's chunks: drawn chunk by chunk,
        # the states depended on sample.batch_size (a sampling key a resume may change before they are computed: 7 vs
        # 96 rows a draw gave other noise), so the straight flow trained on other states than the run it continued
        noise = self.source.sample(n, phase_generator(cfg["experiment"]["seed"], "nsf_states"))
        states = np.empty((n, *self.shape), np.float32)
        beat = time.perf_counter()
        try:
            with autocast(run.device.type, precision):
                for lo in range(0, n, chunk):  # the sampler's chunks: the memory plan's sample+eval row holds them
                    if stoppable and signalled() is not None:
                        return None
                    if time.perf_counter() - beat > HEARTBEAT_EVERY_S:  # 16,384 CIFAR states on a slow card: minutes
                        beat = time.perf_counter()  # in which status said STALE after 300 s (audit KK)
                        run.logger.heartbeat(phase=phase, step=0, state="running", done=lo, of=n, unit="states")
                    x0 = noise[lo:lo + chunk].to(run.device)
                    states[lo:lo + len(x0)] = nsgf_part(velocity, x0, times, etas).cpu().numpy()
        except torch.OutOfMemoryError as exc:  # sampling's chunks (sample.batch_size), not a training step: the
            # Trainer's line said "at step 1; resume with double train.nsf.accum", which leaves them as they are
            exc.sinkflow_where = {"phase": "the NSGF states", "training": False}
            raise
        check_finite_states(cfg, states, precision)
        return states

    def sample(self, n: int, generator: torch.Generator, device="cpu") -> torch.Tensor:
        if self.states is None:
            raise SinkflowError("the NSGF states were drawn before the phase opened them",
                                "call open(run) first (the Trainer does, when the phase runs)")
        idx = torch.randint(len(self.states), (n,), generator=generator)
        return self.states[idx].to(device, non_blocking=True)


def check_finite_states(cfg: dict, states: np.ndarray, precision: str) -> None:
    """Refuse NSGF states holding NaN / Inf before they are kept: the straight flow's first step stopped on a NaN loss
    with "lower the learning rate", and a resume read the same states from RUN/nsf_states.npy and stopped again. They
    are a sample of the velocity network in ``precision`` (``sample.precision`` made concrete for the run's device;
    the sampler's own check: ``check_finite_samples``), where float16's range (65,504) may not hold a network's
    activations."""
    bad = int((~np.isfinite(states.reshape(len(states), -1))).any(axis=1).sum())
    if not bad:
        return
    where = f"{bad} of {len(states)} NSGF states for the straight flow's paths (nsgf.nsf_source=velocity) are NaN/Inf"
    if precision == "fp16":
        raise fp16_overflow(where, cfg["sample"]["precision"])
    raise SinkflowError(where, "the velocity network diverged: train it again with a lower learning rate")


def states_bytes(cfg: dict, sample_shape: tuple[int, ...]) -> int:
    """Disk that ``NSGFStates`` keeps in RUN/nsf_states.npy: ``nsgf.nsf_states`` float32 samples and the .npy header."""
    return int(cfg["nsgf"]["nsf_states"]) * 4 * int(np.prod(sample_shape)) + 128


def straight_flow_source(cfg: dict, source):
    """Where the straight flow's and the predictor's paths start (``nsgf.nsf_source``): the source itself (the
    paper's noise), or the velocity network's states (``NSGFStates``), one object the two phases share."""
    return NSGFStates(source) if cfg["nsgf"]["nsf_source"] == "velocity" else source


class FromNSGFStates:
    """What a phase whose paths may start at the NSGF states (``straight_flow_source``) does about them: opens
    them when it runs, and holds the velocity network that made them (in its memory plan)."""

    source = None

    def open(self, run) -> None:
        if isinstance(self.source, NSGFStates):
            self.source.open(run, self.name)

    def frozen(self) -> tuple[str, ...]:
        return ("velocity",) if isinstance(self.source, NSGFStates) else ()


class StraightFlowStep(FromNSGFStates, InterpolantStep):
    """The Neural Straight Flow phase: the interpolant's velocity matching, from ``straight_flow_source``."""


class TimeStep(FromNSGFStates, InterpolantStep):
    """The phase-transition predictor: regress t from X_t on the straight path; its batches are the interpolant's
    without the target velocity, at t ~ U(0, 1) whatever ``nsgf.nsf_t_min`` (the paper's; the sampler clamps t_hat into
    the NSF's range). Its pairs are the NSF's (``nsgf.nsf_pairs``: independent in the paper): t_hat
    says where on the NSF's own training paths a sample lies, so an OT-paired NSF wants a predictor calibrated on
    the OT-paired X_t, whose distribution at a given t is another than the independent pairs'."""

    learning_check = False  # its own, sharper: the MSE on fresh interpolants against a constant guess's (on_phase_end)

    def __init__(self, source, target, ot_pairs: bool = False):
        super().__init__("time", source, target, ot_pairs=ot_pairs)

    def prepare(self, drawn, device):
        x, t, _ = super().prepare(drawn, device)
        return x, t

    def loss(self, model, batch):
        return time_loss(model, batch)

    @torch.no_grad()
    def on_phase_end(self, trainer) -> None:
        """A predictor that has not learned returns about the same t_hat for every state, so the NSF starts all
        samples at one time whatever the NSGF part did: silent, and it moves FD by tens (RESULTS.md). Its MSE on
        a fresh draw of the same interpolants is recorded (``t_mse``, ``t_mse_constant``) and, for data of at least
        IDENTIFIABLE_DIMS dimensions, a warning names the fix when it is above LEARNED_FRACTION of a constant
        guess's."""
        model = trainer.ema.module if trainer.ema is not None else trainer.model
        was = model.training
        model.eval()
        batch = self.batch(torch.Generator().manual_seed(CHECK_SEED), CHECK_BATCH, trainer.device)
        mse = dist.mean_over_ranks(float(time_loss(model, batch)))
        model.train(was)
        constant = (1 - self.t_min) ** 2 / 12
        trainer.run.logger.log(self.name, trainer.step, {"t_mse": mse, "t_mse_constant": constant, "final": True})
        identifiable = batch[0][0].numel() >= IDENTIFIABLE_DIMS
        if identifiable and mse > LEARNED_FRACTION * constant and dist.current().is_main:
            learning.warning("time: the phase-transition predictor has not learned (MSE %.4f on fresh interpolants, "
                             "%.0f%% of a constant guess's %.4f): t_hat will be about the same for every state; raise "
                             "train.time.lr or train.time.iters", mse, 100 * mse / constant, constant)


@torch.no_grad()
def nsgf_part(velocity, x0: torch.Tensor, times, etas, path: list | None = None) -> torch.Tensor:
    """NSGF++'s first move: Euler steps ``etas`` of ``velocity`` at network times ``times`` from ``x0`` (float32
    state; each state appended to ``path`` on the CPU when one is given)."""
    x = x0.float()
    for k, eta in enumerate(etas):
        t = torch.full((x.shape[0],), float(times[k]), device=x.device)
        x = x + float(eta) * velocity(x, t).float()
        if path is not None:
            path.append(x.cpu())
    return x


@torch.no_grad()
def sample_nsgfpp(velocity, predictor, nsf, x0: torch.Tensor, times, etas, nsf_steps: int, t_min: float = 0.0,
                  record: bool = False, t_shift: float = 0.0):
    """NSGF++ sampling on networks you hold (Algorithm 4): Euler steps ``etas`` of ``velocity`` at network times
    ``times``, then t_hat = ``predictor``(x) + ``t_shift`` (clamped to the NSF's trained range [t_min, 1]), then
    ``nsf_steps`` Euler steps of ``nsf`` from t_hat to 1 per sample. Returns (x, info) as ``Method.sample_nets``."""
    path = [x0.float().cpu()] if record else None
    # one hook per distinct network, each part's calls read off between the parts: with a counter per part, one
    # network passed as both velocity and nsf (a straight flow that reuses the velocity field) counted every call twice
    distinct = list({id(m): m for m in (velocity, predictor, nsf)}.values())
    with count_nfe(*distinct) as calls:
        x = nsgf_part(velocity, x0, times, etas, path)
        n_v = calls.count
        t_hat = (predictor(x).float() + t_shift).clamp(t_min, 1.0)  # the NSF's trained range
        n_t = calls.count - n_v
        x, nsf_path = euler(nsf, x, t_hat, 1.0, nsf_steps, record)
        n_u = calls.count - n_v - n_t
    path = (path or []) + nsf_path[1:]
    return x, {"nfe": n_v + n_t + n_u, "nfe_velocity": n_v, "nfe_time": n_t, "nfe_nsf": n_u, "t_hat": t_hat.cpu(),
               "nsgf_steps": len(etas), "path": path}


# sample.t_shift values `sinkflow tune` tries beside k: 0 is the paper's t̂; a velocity network trained briefly leaves
# states its predictor places late (RESULTS.md "Where the straight flow starts")
T_SHIFTS = (0.0, -0.1, -0.2, -0.3)


def nsgf_splits(total: int) -> list[int]:
    """NSGF step counts k tried for a total NFE budget: about 1/4 and 1/2 of it, and all but one NSF step (the best
    on the 8x8 digits, docs/nsgfpp.md); each leaves one predictor call and at least one NSF step (k above
    pool.steps integrates the pool's span more finely)."""
    if total < 3:
        raise SinkflowError(f"an NSGF++ budget of {total} network evaluations leaves no straight-flow step",
                            "use --nfe 3 or more (k NSGF steps + 1 time prediction + at least 1 NSF step)")
    return sorted({min(total - 2, max(1, round(total * f))) for f in (0.25, 0.5)} | {total - 2})


class NSGFPlusPlus(Method):
    """NSGF++: a <=5-step NSGF, a time predictor, then a Neural Straight Flow (see the module docstring)."""

    name = "nsgfpp"
    steps_are = "straight-flow steps"  # `sample --steps`: the NSGF part keeps its own grid

    def check(self, cfg: dict, sample_shape: tuple[int, ...]) -> None:
        check(cfg, sample_shape)

    def check_machine(self, cfg: dict, sample_shape: tuple[int, ...]) -> None:
        others = {"checkpoints": checkpoint_bytes(cfg, sample_shape)}
        if cfg["nsgf"]["nsf_source"] == "velocity":  # RUN/nsf_states.npy: 201 MB on CIFAR-10 at the default 16,384
            others["the NSGF states"] = states_bytes(cfg, sample_shape)
        check_free_disk(cfg["pool"], sample_shape, Path(cfg["experiment"]["runs_dir"]).expanduser(), others)

    def phases(self, cfg, source, target):
        check(cfg, tuple(target.shape))
        ot_pairs = cfg["nsgf"]["nsf_pairs"] == "ot"
        start = straight_flow_source(cfg, source)
        return [nsgf.pool_task(cfg, source, target), nsgf.PoolVelocityStep(),
                StraightFlowStep("nsf", start, target, ot_pairs=ot_pairs, t_min=cfg["nsgf"]["nsf_t_min"],
                                 init_from="velocity" if cfg["nsgf"]["nsf_init"] == "velocity" else None),
                TimeStep(start, target, ot_pairs=ot_pairs)]

    def default_steps(self, cfg: dict) -> int:
        return cfg["sample"]["nsf_steps"]

    def eval_steps(self, cfg: dict) -> list[int]:
        return [self.default_steps(cfg)]  # the NSGF part always takes its T trained steps

    def sample_nets(self, nets, cfg, x0, steps=None, record=False):
        """Algorithm 4. ``steps`` = NSF Euler steps (default sample.nsf_steps); the NSGF part uses the T
        steps it was trained on, or ``sample.nsgf_steps``; the NSF starts at t_hat + ``sample.t_shift``. info: nfe
        (total, counted by forward hooks), nfe_velocity, nfe_time, nfe_nsf, t_hat (N,: where the NSF started),
        nsgf_steps, and with ``record`` the path [x0, T NSGF states, NSF states]."""
        times, etas = nsgf_grid(cfg)
        return sample_nsgfpp(nets["velocity"], nets["time"], nets["nsf"], x0, times, etas,
                             int(steps or self.default_steps(cfg)), float(cfg["nsgf"]["nsf_t_min"]), record,
                             float(cfg["sample"].get("t_shift", 0.0)))

    def sampler_settings(self, cfg):
        s = cfg["sample"]
        k = s.get("nsgf_steps") or cfg["pool"]["steps"]
        return k + 1 + s["nsf_steps"], {"nsgf_steps": k, "nsf_steps": s["nsf_steps"], "t_shift": s["t_shift"]}

    def sampler_candidates(self, cfg, total):
        T = cfg["pool"]["steps"]
        if cfg["nsgf"]["segment"] > 0:
            ks = nsgf_splits(total)
        elif total - 1 - T >= 1:
            ks = [T]  # a field trained on the grid points only is sampled on them (check_nsgf_steps)
        else:
            raise SinkflowError(f"--nfe {total}: this run's NSGF part takes its pool's {T} steps (nsgf.segment=0) "
                                "plus 1 time prediction, which leaves no straight-flow step",
                                f"use --nfe {T + 2} or more")
        return [{"nsgf_steps": k, "nsf_steps": total - 1 - k, "t_shift": s} for k in ks for s in T_SHIFTS]

    def sample_draws(self, cfg: dict) -> int:
        """With ``nsgf.nsf_source=velocity``: the ``nsgf.nsf_states`` NSGF states computed when the straight flow
        starts (``NSGFStates``)."""
        return int(cfg["nsgf"]["nsf_states"]) if cfg["nsgf"]["nsf_source"] == "velocity" else 0

    def scratch_overrides(self, cfg: dict) -> list[str]:
        """The NSGF states (``nsgf.nsf_states``, with ``nsgf.nsf_source=velocity``) kept to a few hundred."""
        return [f"nsgf.nsf_states={min(cfg['nsgf']['nsf_states'], SCRATCH_STATES)}"]

    def describe(self, cfg: dict) -> str:
        k, T = cfg["sample"].get("nsgf_steps") or cfg["pool"]["steps"], cfg["pool"]["steps"]
        where = "on the pool's grid" if k == T else f"over the {T}-step pool's span"
        shift = float(cfg["sample"].get("t_shift", 0.0))
        start = f" from t_hat {shift:+g}" if shift else ""
        paths = ", trained from the NSGF states" if cfg["nsgf"]["nsf_source"] == "velocity" else ""
        return (f"nsgfpp: {k} NSGF steps {where}, a time predictor, then "
                f"{cfg['sample']['nsf_steps']} Neural Straight Flow steps{start}{paths}")


METHOD = NSGFPlusPlus()
