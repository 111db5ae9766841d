"""Peak GPU memory of every phase for a config, before any GPU is rented, and the change that makes it fit.

Terms (per process; one GPU per process). ``train.<phase>.batch_size`` is per process, so the number of processes
(``world``) does not shrink a phase: it changes what ``auto`` resolves to under DDP (no step graph, no compile:
``planned_train``) and adds the gradients' all-reduce buffer, and a rank building its pool chunks holds one
in-flight group, as one process does.

* a chunked phase (the pool): the task's own estimate (``ChunkedTask.memory``; for the pool GeomLoss's
  working set for ``in_flight`` pool batches and the trajectory kept on the device, plus the pool in host RAM
  or on disk) and its own fit (``ChunkedTask.fit_memory``): the planner never names a method's task.
* a training phase: parameters + gradients + Adam's two moments (+ an EMA copy)
  (``sinkflow.models.model_memory_bytes``); the activations autograd saves for backward, measured by
  running the real forward on CPU at micro-batch 1 and 2 with ``saved_tensors_hooks`` and
  extrapolating linearly to the real micro-batch (activations are affine in the batch size); a
  backward transient of the largest single saved activation (its gradient is alive next to the
  saved activations at the start of backward); and the batch tensors themselves.
* sampling / evaluation: every trained network (weights only) + the eval batch and its transient.

A card "fits" when the estimate is at most 90% of (its memory minus 1 GiB) (CUDA context, cuDNN/cuBLAS
workspaces and allocator fragmentation take the rest). ``benchmarks/memory_estimate.py`` compares the
estimate with ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from sinkflow import config as config_mod
from sinkflow import data, methods
from sinkflow.engine import learning, prefetch
from sinkflow.errors import SinkflowError
from sinkflow.models.footprint import activation_terms, recompute_terms
from sinkflow.runtime.autocast import HALF, precision_named
from sinkflow.tools.cards import GPUS, GiB, gpu_bytes  # noqa: F401 (the planner's cards, named without torch)

CONTEXT_BYTES = GiB  # CUDA context + library workspaces, never available to tensors
# cuBLAS / cuDNN workspaces that the caching allocator hands out (and max_memory_allocated counts): the gap
# between the estimate and the measured H100 peak of the small phases (benchmarks/memory_estimate_h100.md)
WORKSPACE_BYTES = 64 * 2**20
FRAGMENTATION = 0.90  # fraction of the rest the caching allocator can actually hand out at a peak


def usable_bytes(total_bytes: int) -> int:
    return int((total_bytes - CONTEXT_BYTES) * FRAGMENTATION)


@dataclass
class PhaseMemory:
    """Estimated device bytes of one phase, by term, plus host RAM / disk it needs."""

    phase: str
    kind: str  # chunked (the pool) | train | sample | other | done (finished in the run planned: finished_in)
    terms: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    disk_bytes: int = 0
    note: str = ""
    # for re-planning without re-measuring (train phases)
    model_key: str = ""
    act_fixed: int = 0
    act_per_sample: int = 0
    act_max_per_sample: int = 0
    recompute_fixed: int = 0  # what backward re-runs with grad (a flow's checkpoint segment / invertible layer)
    recompute_per_sample: int = 0
    recompute_max_per_sample: int = 0
    precision: str = "fp32"  # the autocast the activations were measured under (train phases); the sampler's (sample)
    batch_item_bytes: int = 0
    batch_copies: int = 1  # batches on the device at once: the step's, those in the making, a step graph's copy,
    # the learning check's probe batch
    # chunked phases: (cfg, usable device bytes) -> (overrides, reasons), from ChunkedTask.fit_memory
    fit: Callable[[dict, int], tuple[dict, list[str]]] | None = field(default=None, repr=False)

    @property
    def total(self) -> int:
        return sum(self.terms.values())


# ---- measurement --------------------------------------------------------------------------------

def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a network's parameters: what a frozen or sampling network holds on the device."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_activations(model: torch.nn.Module, shape: tuple[int, ...], precision: str = "fp32") -> tuple[int, int, int]:
    """(fixed, per-sample, largest per-sample) saved-activation bytes, from forwards at batch 1 and 2 on CPU."""
    dtype = HALF.get(precision)
    if dtype is torch.float16:  # CPU autocast fp16 has the same byte sizes as bf16 and is better supported
        dtype = torch.bfloat16
    return activation_terms(model.train(), shape, with_time=None, autocast_dtype=dtype, device="cpu")


# Backward through a re-run piece holds what it saved plus gradients: ~3 of its largest tensor (the gradient of a
# conditioner's hidden activation, of its input and the one being formed). Calibrated against the H100's measured
# peaks of docs/flows.md (Glow 3x32x32, batch 256, hidden 512, depth 4/16/64): checkpoint 1.02x at every depth,
# invertible 0.98/0.96/0.88x of the measured peak above the weights (that table predates the direct-gradient backward,
# which holds less: torch's MemTracker on CPU puts today's at 0.82x of this plan); 2x the saved bytes alone was
# off by -28% to +57%. Without this term the plan was 0.37-0.81x of the measured peak.
RECOMPUTE_GRADS = 3


def measure_recompute(model: torch.nn.Module, shape: tuple[int, ...], precision: str = "fp32") -> tuple[int, int, int]:
    """(fixed, per-sample, largest per-sample) bytes saved while backward re-runs its largest piece
    (``recompute_terms``); zeros for a network that recomputes nothing (every network but a flow in checkpoint
    or invertible memory mode)."""
    dtype = HALF.get(precision)
    return recompute_terms(model.train(), shape, torch.bfloat16 if dtype is torch.float16 else dtype, "cpu")


def micro_batch(batch_size: int, accum: int) -> int:
    """Rows in one accumulation micro-batch: ``Trainer._update`` chunks the step's batch (``batch_size`` rows:
    the batch is per process, whatever the number of processes) into ``accum`` parts (``split_batch``)."""
    return max(1, math.ceil(batch_size / max(1, accum)))


def train_terms(pm: PhaseMemory, batch_size: int, accum: int) -> None:
    """The terms of a training phase that grow with its batch, for ``train.<phase>.batch_size`` / ``accum``. Per
    process and independent of the number of processes: under torchrun every rank trains ``batch_size`` rows (it
    keeps its shard of the ``batch_size x world`` rows drawn, ``dist.shard``, before they reach the device)."""
    micro = micro_batch(batch_size, accum)
    pm.terms["activations"] = pm.act_fixed + pm.act_per_sample * micro
    pm.terms["backward transient"] = pm.act_max_per_sample * micro
    if pm.recompute_per_sample or pm.recompute_fixed:
        pm.terms["backward recompute"] = pm.recompute_fixed + (
            pm.recompute_per_sample + RECOMPUTE_GRADS * pm.recompute_max_per_sample) * micro
    pm.terms["batch"] = pm.batch_item_bytes * batch_size * pm.batch_copies


# ---- the estimate -------------------------------------------------------------------------------

NO_BF16 = ("T4",)  # cards of GPUS without bf16 tensor cores (pre-Ampere): `auto` precision trains fp32 there


def card_bf16(label: str | None) -> bool:
    """Does the planned card run ``auto`` precision in half precision (fp16, on cards with bf16 tensor cores: Ampere
    on)? A named card of ``GPUS`` says; a bare memory size
    (``--gpu-mem``) or no card plans for fp32, the larger activations."""
    return label in GPUS and label not in NO_BF16


def planned_for(label: str | None) -> str:
    """What precision the table's rows assume, for its header: each phase and the sampler as ``auto`` resolves on the
    named card; with no card (or a bare ``--gpu-mem``) as on one without bf16 tensor cores (fp32 for a UNet), which
    the columns of the cards that have them (fp16 for a UNet there) over-state."""
    if label in GPUS:
        return f"each phase and the sampler in the precision they take on the {label}"
    if label is None:
        return ("planned for no card: each phase and the sampler in the precision auto takes without bf16 tensor cores "
                "(fp32 for a UNet), an upper bound for the cards with them (fp16 there); --gpu NAME plans a card's own")
    return ("planned for a card without bf16 tensor cores (fp32 for a UNet under auto); --gpu NAME plans a named "
            "card's own")


def planned_train(cfg: dict, key: str, world: int = 1, bf16: bool = False) -> dict:
    """``train.<key>`` as it runs on the card being planned for: ``auto`` speed settings as on a CUDA card, with
    bf16 tensor cores or without (``bf16``: ``card_bf16``)."""
    from sinkflow.engine import fast_path

    return fast_path.resolve(cfg["train"][key], cfg["model"][key]["kind"], "cuda", world, bf16=bf16)


def _train_phase_memory(cfg: dict, phase, shape: tuple[int, ...], world: int, bf16: bool = False) -> PhaseMemory:
    from sinkflow.models import build_model, model_memory_bytes

    key = phase.model_key
    tcfg = planned_train(cfg, key, world, bf16)
    mcfg = dict(cfg["model"][key])
    torch.manual_seed(0)
    model = build_model(mcfg.pop("kind"), mcfg, shape)
    pm = PhaseMemory(phase.name, "train", model_key=key, precision=tcfg["precision"])
    pm.terms["weights+grads+adam" + ("+ema" if tcfg["ema"] > 0 else "")] = model_memory_bytes(
        model, "adam", ema=tcfg["ema"] > 0)
    pm.act_fixed, pm.act_per_sample, pm.act_max_per_sample = measure_activations(model, shape, tcfg["precision"])
    pm.recompute_fixed, pm.recompute_per_sample, pm.recompute_max_per_sample = measure_recompute(
        model, shape, tcfg["precision"])
    dim = math.prod(shape)
    pm.batch_item_bytes = 4 * (3 * dim + 1)  # x_t, target, prediction + t
    ahead = prefetch.DEPTH if prefetch.use_prefetch(tcfg["prefetch"], torch.device("cuda")) else 0
    checked = learning.checks(phase, tcfg["iters"])  # LearningCheck holds its probe batch for the whole phase
    pm.batch_copies = 1 + ahead + (tcfg["graph"] == "step") + checked  # a captured step reads a static copy
    train_terms(pm, tcfg["batch_size"], tcfg["accum"])
    for held in phase.frozen():  # a finished phase's network kept on the device (NSGF++'s NSGF states)
        m = dict(cfg["model"][held])
        pm.terms[f"frozen {held} network"] = weight_bytes(build_model(m.pop("kind"), m, shape))
    if world > 1:  # DDP's buckets (a copy of every gradient: PyTorch's docs on gradient_as_bucket_view), or the
        # flat buffer a captured step all-reduces (grad_sync.py): one more copy of the gradients either way
        pm.terms["all-reduce buffer"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    pm.terms["cuda workspaces"] = WORKSPACE_BYTES
    pm.note = (f"micro-batch {micro_batch(tcfg['batch_size'], tcfg['accum'])}, {tcfg['precision']}, "
               f"{pm.batch_copies} batches held")
    return pm


def _chunked_phase_memory(cfg: dict, task, shape: tuple[int, ...]) -> PhaseMemory:
    """A chunked task's own estimate (``ChunkedTask.memory``) plus the CUDA workspaces every phase has."""
    est = task.memory(cfg, shape)
    if est is None:
        return PhaseMemory(task.name, "other", note="not estimated")
    pm = PhaseMemory(task.name, "chunked", dict(est["terms"]), est["host_bytes"], est["disk_bytes"], est["note"])
    pm.terms["cuda workspaces"] = WORKSPACE_BYTES
    pm.fit = lambda c, limit: task.fit_memory(c, shape, limit - WORKSPACE_BYTES)
    return pm


def sample_chunk(cfg: dict) -> int:
    """Samples the sampler holds at once: ``sample.batch_size`` (``generate`` and NSGF++'s NSGF states work in chunks of
    it), capped by the largest draw the run makes: ``eval.n``, the classifier columns' ``eval.class_n`` (digits'
    3,590 against an eval.n of 359) and what the method draws of its own (``Method.sample_draws``: the
    ``nsgf.nsf_states`` NSGF++ computes with ``nsgf.nsf_source=velocity``)."""
    draws = [cfg["eval"]["n"], cfg["eval"].get("class_n") or 0, methods.of(cfg).sample_draws(cfg)]
    return min(max(draws), max(1, cfg["sample"]["batch_size"]))


def _sample_memory(cfg: dict, train_mems: list[PhaseMemory], shape: tuple[int, ...], models: dict,
                   bf16: bool = False) -> PhaseMemory:
    n = sample_chunk(cfg)
    dim = math.prod(shape)
    pm = PhaseMemory("sample+eval", "sample")
    pm.terms["weights"] = sum(weight_bytes(m) for m in models.values())
    pm.terms["samples"] = 4 * n * dim * 3
    # the training phases' activations were measured under their autocast (fp16 for a UNet on an Ampere-on card):
    # sampled in fp32 (sample.precision's auto without bf16 tensor cores, or set) the same tensors take twice the bytes
    # (an upper bound); a phase trained in fp32 and sampled under a half autocast (sample.precision=fp16 on a T4, or
    # set beside train.<phase>.precision=fp32) is measured again under it, and the smaller of the two kept: autocast
    # does not halve the largest tensor per sample (0.5x fp32's for mnist's UNet, 0.75x for cifar10's: a flat 0.5
    # planned a third too little there), and where the activations are small the half measure exceeds fp32's
    # (2.25-9x for the time predictors, 1.5x for digits' UNet) by the weights' half copies it counts
    # (``activation_terms``' m2 // 2), which are not per sample: a half autocast never makes a sample's activations
    # larger than fp32's
    sampled = methods.of(cfg).sample_precision(cfg, "cuda", bf16=bf16)
    pm.precision = sampled
    largest = []
    for t in train_mems:
        # a flow in checkpoint/invertible mode saves little in training, but sampling runs its conditioners on the batch
        big = max(t.act_max_per_sample, t.recompute_max_per_sample)
        if t.precision in HALF and sampled not in HALF:
            big *= 2
        elif sampled in HALF and t.precision not in HALF and t.model_key in models:
            big = min(big, measure_activations(models[t.model_key], shape, sampled)[2])
        largest.append(big)
    pm.terms["forward transient"] = max((2 * big * n for big in largest), default=0)
    pm.terms["cuda workspaces"] = WORKSPACE_BYTES  # cuDNN / cuBLAS hold them while sampling too
    read = "sample.precision" in config_mod.schema.used(cfg)  # a flow samples in fp32 and has no such key
    named = precision_named(cfg["sample"]["precision"], sampled) if read else sampled
    pm.note = (f"chunks of sample.batch_size={n} samples, {named}; "
               "forward transient = 2 x the largest activation (rough)")
    return pm


def estimate(cfg: dict, world: int = 1, bf16: bool = False) -> list[PhaseMemory]:
    """Per-phase memory of the config (real sizes), measured on CPU, for a CUDA card with bf16 tensor cores or
    without (what ``auto`` precision becomes there; by default without, as ``card_bf16`` plans for no card), per
    process of a run with ``world`` processes. Uses synthetic data of the real shape when the image set is not
    available here."""
    from sinkflow.methods.base import ChunkedTask, TrainingStep
    from sinkflow.models import build_model
    from sinkflow.tools.data import real_or_synthetic

    with real_or_synthetic(cfg):
        source, target = data.distributions(cfg)
        shape = tuple(target.shape)
        phases = methods.phases(cfg, source, target)
        out: list[PhaseMemory] = []
        models = {}
        for ph in phases:
            if isinstance(ph, ChunkedTask):
                out.append(_chunked_phase_memory(cfg, ph, shape))
            elif isinstance(ph, TrainingStep):
                out.append(_train_phase_memory(cfg, ph, shape, world, bf16))
                m = dict(cfg["model"][ph.model_key])
                models[ph.model_key] = build_model(m.pop("kind"), m, shape)
            else:
                out.append(PhaseMemory(ph.name, "other", note="not estimated"))
        out.append(_sample_memory(cfg, [p for p in out if p.kind == "train"], shape, models, bf16))
    return out


def finished_in(mems: list[PhaseMemory], run_dir) -> list[PhaseMemory]:
    """``mems`` with the rows of the phases ``run_dir`` has finished (``checkpoints/<phase>/final.pt``) emptied: a
    resume on the card does not run them again, so they neither fail it (``over_budget``) nor get a fit
    (``propose_fit``). The sample+eval row stays: the evaluation at the end runs on the card; so do a finished pool's
    host RAM and disk bytes, which the later phases read (``over_budget`` checks them against ``pool.ram_gb`` /
    ``pool.disk_gb``)."""
    from pathlib import Path

    ck = Path(run_dir) / "checkpoints"
    return [PhaseMemory(m.phase, "done", host_bytes=m.host_bytes, disk_bytes=m.disk_bytes,
                        note=f"finished in {run_dir}: a resume does not run it again")
            if (ck / m.phase / "final.pt").is_file() else m for m in mems]


# ---- fitting ------------------------------------------------------------------------------------

def fits(pm: PhaseMemory, total_bytes: int) -> bool:
    return pm.total <= usable_bytes(total_bytes)


def over_budget(cfg: dict, mems: list[PhaseMemory], total_bytes: int) -> list[str]:
    """What does not fit: every phase too large for the card, ``pool RAM`` when the pool kept in host RAM exceeds
    ``pool.ram_gb`` and ``pool disk`` when the pool on disk exceeds ``pool.disk_gb`` (``sinkflow train`` refuses
    both: ``pool.check_pool_fits``; the free space of the disk it runs on is ``pool.check_free_disk``'s, at the
    start). Empty when all fits. The one
    verdict preflight gives before and after ``--fit``."""
    over = [m.phase for m in mems if m.terms and not fits(m, total_bytes)]
    pool = cfg.get("pool", {})
    for budget, used, name in (("ram_gb", "host_bytes", "pool RAM"), ("disk_gb", "disk_bytes", "pool disk")):
        if pool.get(budget) is not None and any(getattr(m, used) > pool[budget] * GiB for m in mems):
            over.append(name)
    return over


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, increasing: the values ``train.<phase>.accum`` may take for a batch of ``n``."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def half_precision(cfg: dict, key: str, kind: str, bf16: bool) -> tuple[str | None, str]:
    """(the half precision ``train.<key>`` can take on the planned card, or None; why not). bf16 on a card with bf16
    tensor cores; on one without (a T4, a bare ``--gpu-mem``) fp16, for the networks whose fp16 path (autocast +
    GradScaler) was measured (``fast_path.FAST_KINDS``); never for a flow with ``model.flow.memory=invertible``,
    which trains in fp32 only (``normalizing_flow`` refuses it)."""
    from sinkflow.engine import fast_path

    if kind == "flow" and cfg["model"][key].get("memory") == "invertible":
        return None, "model.flow.memory=invertible trains in fp32 only"
    if bf16:
        return "bf16", ""
    if kind in fast_path.FAST_KINDS:
        return "fp16", ""
    return None, f"no bf16 on this card and fp16 is not measured for a {kind}"


def _trial(pm: PhaseMemory, batch_size: int, accum: int) -> PhaseMemory:
    """A copy of the training phase ``pm`` with its batch terms at ``batch_size`` / ``accum``."""
    trial = copy.copy(pm)
    trial.terms = dict(pm.terms)
    train_terms(trial, batch_size, accum)
    return trial


def _at(pm: PhaseMemory, batch_size: int, accum: int, act_scale: float = 1.0) -> int:
    """The phase's total at ``accum``, with the batch-dependent activation terms scaled by ``act_scale`` (0.5:
    half-precision autocast, roughly)."""
    trial = _trial(pm, batch_size, accum)
    acts = trial.terms["activations"] + trial.terms["backward transient"]
    return int(trial.total - acts + act_scale * acts)


def _fit_train(cfg: dict, pm: PhaseMemory, limit: int, world: int, bf16: bool, card: str
               ) -> tuple[dict, list[str]]:
    """The smallest accum (a divisor of the batch) that fits, in the phase's precision, else in half precision
    where the run can take it and it then fits; else why the phase cannot fit the card."""
    t = planned_train(cfg, pm.model_key, world, bf16)
    b, accum0, key = t["batch_size"], t["accum"], pm.model_key
    tries = [d for d in divisors(b) if d >= accum0]
    fp32_min = _at(pm, b, b)  # micro-batch 1: the least this precision can reach
    options = [(t["precision"], 1.0)]
    half, why_not = (None, "") if t["precision"] != "fp32" else half_precision(
        cfg, key, cfg["model"][key]["kind"], bf16)
    if half:
        options.append((half, 0.5))
    for precision, scale in options:
        accum = next((d for d in tries if _at(pm, b, d, scale) <= limit), None)
        if accum is None:
            continue
        overrides, reasons = {}, []
        if accum != accum0:
            overrides[f"train.{key}.accum"] = accum
            reasons.append(f"{pm.phase}: micro-batch {micro_batch(b, accum0)} -> {micro_batch(b, accum)} with "
                           f"accum={accum} (same effective batch {b}"
                           + (f" per process, {b * world} over {world} processes)" if world > 1 else ")"))
        if precision != t["precision"]:
            overrides[f"train.{key}.precision"] = precision
            reasons.append(f"{pm.phase}: still {fmt_bytes(fp32_min)} at micro-batch 1 in {t['precision']}; {precision} "
                           "autocast roughly halves the activations" + _sampler_follows(cfg, key, precision, bf16))
        return overrides, reasons
    low = _trial(pm, b, b)
    name, big = max(low.terms.items(), key=lambda kv: kv[1])
    note = f" ({why_not})" if why_not and name in ("activations", "backward transient") else ""
    return {}, [f"{pm.phase}: does not fit {card} at any micro-batch: {fmt_bytes(low.total)} at micro-batch 1 in "
                f"{t['precision']}{' (half precision would not fit either)' if half else ''}, the largest term "
                f"{name} {fmt_bytes(big)}{note}; use a smaller model or a larger card"]


def _sampler_follows(cfg: dict, key: str, precision: str, bf16: bool) -> str:
    """What a proposed ``train.<key>.precision`` does to the sampler on the planned card, when it changes it:
    ``sample.precision: auto`` follows a training precision that is set (``Method.sample_precision``), so the
    samples every metric scores would move to another precision with nothing said."""
    method = methods.of(cfg)
    before = method.sample_precision(cfg, "cuda", bf16=bf16)
    after = method.sample_precision(config_mod.apply_overrides(cfg, [f"train.{key}.precision={precision}"]), "cuda",
                                    bf16=bf16)
    if after == before:
        return ""
    return (f", and sample.precision={cfg['sample']['precision']} follows it: the samples would be drawn in {after}, "
            f"not {before} (add sample.precision={before} to keep them)")


def propose_fit(cfg: dict, mems: list[PhaseMemory], total_bytes: int, world: int = 1,
                bf16: bool = False, card: str = "the card") -> tuple[list[str], list[str]]:
    """(overrides, reasons) that make every phase fit ``total_bytes`` and the pool fit its RAM/disk budget; a
    phase that no change fits gets a reason and no override.

    Keeps what the experiment computes: the total pool entries (pool.batches x pool.batch_size) and every
    effective training batch (train.X.batch_size, split into more accumulation micro-batches).
    """
    limit = usable_bytes(total_bytes)
    if limit <= WORKSPACE_BYTES:  # every phase on the device holds the workspaces, whatever its batch
        return [], [f"{card} leaves {fmt_bytes(max(limit, 0))} for tensors (90% of (its memory minus 1 GiB)), less than "
                    f"the {fmt_bytes(WORKSPACE_BYTES)} of CUDA workspaces every phase holds: too small for any batch"]
    overrides: dict[str, object] = {}
    reasons: list[str] = []
    for pm in mems:
        if pm.kind == "chunked" and pm.fit is not None:
            changed, why = pm.fit(cfg, limit)
        elif pm.kind == "train" and pm.total > limit:
            changed, why = _fit_train(cfg, pm, limit, world, bf16, card)
        elif pm.kind == "sample" and pm.total > limit:
            changed, why = _fit_sample(cfg, pm, limit, card)
        else:
            continue
        overrides.update(changed)
        reasons += why
    return [f"{k}={v}" for k, v in overrides.items()], reasons


def _fit_sample(cfg: dict, pm: PhaseMemory, limit: int, card: str) -> tuple[dict, list[str]]:
    """A smaller ``sample.batch_size``: the chunk the estimate used (``sample_chunk``) scaled by
    what is left beside the weights and workspaces; the samples and the forward transient grow with the chunk, the
    weights and workspaces not."""
    chunk = sample_chunk(cfg)
    fixed = pm.terms.get("weights", 0) + pm.terms.get("cuda workspaces", 0)
    per_sample = (pm.total - fixed) / chunk
    new = int((limit - fixed) // per_sample) if per_sample > 0 else 0
    if new < 1:
        return {}, [f"{pm.phase}: does not fit {card} at any sample.batch_size: the trained networks' weights "
                    f"({fmt_bytes(fixed)}) and one sample's terms take {fmt_bytes(fixed + per_sample)}; use a larger card"]
    return {"sample.batch_size": new}, [
        f"{pm.phase}: sampling in chunks of {chunk} needs about {fmt_bytes(pm.total)}; chunks of {new} "
        f"(sample.batch_size) fit without changing the metric protocol"]


# ---- formatting ---------------------------------------------------------------------------------

def fmt_bytes(b: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{int(b)} B"


def format_table(mems: list[PhaseMemory], cards: dict[str, int] | None = None) -> str:
    cards = cards or {k: v * 2**20 for k, v in GPUS.items()}
    head = f"{'phase':<14}{'peak GPU':>12}  " + "".join(f"{c:>10}" for c in cards) + "  terms"
    lines = [head, "-" * len(head)]
    for pm in mems:
        if not pm.terms:
            lines.append(f"{pm.phase:<14}{'-':>12}  {pm.note}")
            continue
        marks = "".join(f"{'ok' if fits(pm, b) else 'NO':>10}" for b in cards.values())
        terms = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in pm.terms.items())
        lines.append(f"{pm.phase:<14}{fmt_bytes(pm.total):>12}  {marks}  {terms}")
        extra = [pm.note] if pm.note else []
        if pm.host_bytes:
            extra.append(f"pool in host RAM: {fmt_bytes(pm.host_bytes)}")
        if pm.disk_bytes:
            extra.append(f"pool on disk: {fmt_bytes(pm.disk_bytes)}")
        if extra:
            lines.append(f"{'':<14}{'':>12}  " + "; ".join(extra))
    return "\n".join(lines)
