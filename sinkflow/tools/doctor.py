"""The doctor: is the loop able to learn at all, is it wired right, is the data what the model expects?

Every check is a plain function of (model, optimizer, loss_fn, batch / step_fn / loader) returning a
``Finding`` (one line: symptom, cause, fix), so tests can plant a bug and watch the check catch it, and
user code outside sinkflow can call them too. ``doctor_run`` applies them to every training phase of
a preset (in a scratch run) or of an existing run.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from sinkflow.flows import FlowModel


@dataclass
class Finding:
    check: str
    ok: bool | None  # None = not applicable
    symptom: str = ""
    cause: str = ""
    fix: str = ""
    phase: str = ""

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "n/a "}[self.ok]
        where = f"[{self.phase}] " if self.phase else ""
        if self.ok is False:
            return f"{mark} {where}{self.check}: {self.symptom} | cause: {self.cause} | fix: {self.fix}"
        return f"{mark} {where}{self.check}: {self.symptom}"


def _ok(check, text="") -> Finding:
    return Finding(check, True, text)


# ---- wiring ------------------------------------------------------------------------------------

def check_optimizer_covers(model: nn.Module, optimizer: torch.optim.Optimizer) -> Finding:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]
    if missing:
        return Finding("params in optimizer", False, f"{len(missing)} trainable parameter(s) not in the optimizer "
                       f"(e.g. {missing[0]})", "the optimizer was built from a different parameter list (before .to(), "
                       "or a submodule added later)", "build the optimizer from model.parameters() after the model is final")
    n = sum(p.requires_grad for p in model.parameters())
    return _ok("params in optimizer", f"all {n} trainable tensors are in the optimizer")


def check_loss_graph(model: nn.Module, loss_fn: Callable, batch) -> Finding:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.grad_fn is None:
        return Finding("loss has a graph", False, "the loss does not require grad (no grad_fn)",
                       "it was computed under no_grad/inference_mode, or detached (.item(), .detach(), numpy)",
                       "return the differentiable loss tensor; log loss.item() separately")
    loss.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    none = [n for n, p in trainable if p.grad is None]
    model.zero_grad(set_to_none=True)
    if len(none) == len(trainable):
        return Finding("loss has a graph", False, "backward reached no parameter", "the loss does not depend on the "
                       "model's output", "compute the loss from model(...)")
    if none:
        return Finding("loss has a graph", False, f"{len(none)} parameter(s) get no gradient (e.g. {none[0]})",
                       "they are unused in the forward pass", "remove them or use them (or freeze them)")
    return _ok("loss has a graph", f"gradients reach all {len(trainable)} trainable tensors")


OVERFIT_STEPS = 300  # the overfit rules' default budget (`sinkflow doctor --steps`)
EXTEND_TO = 4  # ... times which a loss still falling at the default budget goes on, where that takes under
EXTEND_WITHIN_S = 30.0  # seconds more (a small network: NSGF++'s time predictor; not a UNet on a CPU)
ZERO_INIT_DEPTH = 10  # optimizer steps within which every tensor must have moved (most nets: one)


def check_weights_change(model: nn.Module, step_fn: Callable[[], object], steps: int = ZERO_INIT_DEPTH,
                         optimizer: torch.optim.Optimizer | None = None) -> Finding:
    """Every trainable tensor moves within ``steps`` optimizer steps (the check stops at the first step after
    which all have). Not one step: a zero-initialised layer (the UNets' ``zero_module`` output convolutions, as in
    guided diffusion) passes no gradient upstream until its own first update, and then a gradient about as small
    as that update, so the layers behind it move one or more steps later, under an LR warm-up later still. On the
    ``digits`` UNet (warm-up 50) 72 of 110 tensors had not moved after the first step, a false alarm; all had
    within 7.

    With ``optimizer``: where every unmoved tensor is in it and holds a nonzero gradient, the update reached it and
    was below float32's resolution for its values, so the cause named is the learning rate (``--lr 1e-12``: "6 of 8
    tensors unchanged ... they get no gradient or are not in the optimizer", beside two checks that had just found
    every tensor with a gradient and in the optimizer)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for taken in range(1, steps + 1):
        step_fn()
        same = [n for n, p in model.named_parameters() if n in before and torch.equal(before[n], p.detach())]
        if not same:
            return _ok("weights change", f"all {len(before)} trainable tensors moved within {taken} step(s)")
    if optimizer is not None and lr_too_low(model, optimizer, same):
        lrs = ", ".join(sorted({f"{g['lr']:g}" for g in optimizer.param_groups}))
        return Finding("weights change", False, f"{len(same)} of {len(before)} tensors unchanged after {steps} "
                       f"step(s) (e.g. {same[0]}) though each is in the optimizer with a nonzero gradient",
                       f"the learning rate ({lrs}) is so low that each update is below float32's resolution for "
                       "these weights", "raise the learning rate (`sinkflow lr-find` picks one)")
    if len(same) == len(before):
        return Finding("weights change", False, f"no weight changed after {steps} optimizer step(s)",
                       "optimizer.step() is missing, runs before backward, or zero_grad runs after backward; or the "
                       "optimizer holds other tensors", "order: zero_grad -> forward -> backward -> step")
    return Finding("weights change", False, f"{len(same)} of {len(before)} tensors unchanged after {steps} step(s) "
                   f"(e.g. {same[0]})", "they get no gradient or are not in the optimizer",
                   "check requires_grad and the optimizer's param groups")


def lr_too_low(model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]) -> bool:
    """Are all the tensors ``names`` in ``optimizer``, stepped by it (it holds their state: a loop whose step() is
    missing or runs before backward leaves none) and with a nonzero gradient (the last step's): an update that reached
    them and left them as they were?"""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    return bool(names) and all(id(p) in held and optimizer.state.get(p) and p.grad is not None and bool(p.grad.any())
                               for p in (params[n] for n in names))


INPUT_EFFECT_MIN = 1e-4  # the output's relative change below which an input is taken as not reaching it
ZERO_INIT_BELOW = 1e-3  # a weight tensor this small is (still) a zero-initialised layer: default init uses ~0.1


def _effect(model: nn.Module, a: tuple, b: tuple) -> float:
    """max|model(*a) - model(*b)| / max|model(*a)|, in float32 without autocast."""
    with torch.no_grad():
        fa, fb = model(*a).float(), model(*b).float()
    return float((fa - fb).abs().max() / fa.abs().max().clamp_min(1e-30))


def check_inputs_reach_output(model: nn.Module, x: torch.Tensor, t: torch.Tensor, n: int = 8) -> Finding:
    """A velocity field v(x, t) whose output does not change with t (or with x) trains without an error, its loss
    falls (16 noisy points are memorised without t), and it samples a blur: every other check passes. ADM's
    GroupNorm(32) on a layer of <= 32 channels is one channel per group, an instance norm that removes the additive
    time embedding exactly; the digits UNet was t-independent that way (|v(x,.1) - v(x,.9)| 1e-7 of |v|).

    Measured on a copy whose zero-initialised weights (the output layers that make every input's effect exactly 0
    before training, and still ~lr after a few steps: any weight tensor below ``ZERO_INIT_BELOW``) get PyTorch's
    default initialisation: the question is whether the architecture lets each input reach
    the output. Times: the batch's own lowest and highest (the phase's range); x: the batch against itself rolled
    by one sample. Healthy UNets change by 1e-2 or more; a cancelled input by ~1e-7."""
    probe = copy.deepcopy(model).float().eval()
    state = torch.random.get_rng_state()  # the re-initialisation below is seeded; the caller's RNG is restored after
    torch.manual_seed(0)
    with torch.no_grad():
        for p in probe.parameters():
            if p.dim() >= 2 and not p.abs().max() >= ZERO_INIT_BELOW:  # PyTorch's default init (biases block
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))  # nothing at 0)
    torch.random.set_rng_state(state)
    x = x[:n].float()
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device).flatten()
    if x.shape[0] < 2 or t.numel() == 0 or not t.max() > t.min():
        return Finding("inputs reach the output", None, "needs a batch of >= 2 samples at >= 2 times")
    lo, hi = (torch.full((x.shape[0],), float(v), device=x.device) for v in (t.min(), t.max()))
    by_t = _effect(probe, (x, lo), (x, hi))
    by_x = _effect(probe, (x, lo), (x.roll(1, 0), lo))
    said = f"output changes by {by_t:.2g} between t={float(t.min()):.2f} and {float(t.max()):.2f}, by {by_x:.2g} " \
           "between samples (relative)"
    if by_t < INPUT_EFFECT_MIN:
        return Finding("inputs reach the output", False, f"the network ignores t: {said}",
                       "the time embedding is removed before it reaches the output (a GroupNorm of one channel per "
                       "group cancels an additive embedding) or forward never uses t",
                       "set model.<phase>.use_scale_shift_norm=auto (t by FiLM after such a norm) or "
                       "norm_min_channels=2 (channels per norm group), or pass t through")
    if by_x < INPUT_EFFECT_MIN:
        return Finding("inputs reach the output", False, f"the network ignores x: {said}",
                       "the input is overwritten or detached in forward", "make forward use x")
    return _ok("inputs reach the output", said)


def _mode_probe(model: nn.Module, fn: Callable[[], object]) -> list[tuple[str, bool]]:
    """(name, training) of every module of ``model`` whose forward ran during ``fn()``, seen by forward pre-hooks:
    only a Python call of a module runs them, so a step that makes none (a CUDA-graph replay, a compiled module)
    leaves this empty or holding the root alone (see ``_blind``)."""
    seen: dict[str, bool] = {}
    def hook(mod, inp, name):
        seen.setdefault(name, mod.training)  # returns None: the input is left alone

    handles = [m.register_forward_pre_hook(lambda mod, inp, name=name: hook(mod, inp, name))
               for name, m in model.named_modules()]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return list(seen.items())


def _blind(model: nn.Module, modes: list[tuple[str, bool]], check: str, during: str) -> Finding | None:
    """The n/a finding when the probe saw no module below the root run (or nothing at all) though the model has
    some: the modules ran where no Python hook does, so their modes were not seen, and "0 modules in train mode" was
    an ok for a check that could not look (`sinkflow doctor mnist` on an H200, the nsf phase: "ok ... 1 modules in
    train mode" of a 190-module UNet). A CUDA-graph replay runs no Python; a module compiled before the hooks were
    added runs its cached graph without them (dynamo does not guard on hooks: ``skip_nnmodule_hook_guards``), the
    root's own hook alone firing where the compiled call is the root's."""
    below = sum(1 for n, _ in model.named_modules() if n)
    if modes and (not below or any(n for n, _ in modes)):
        return None
    return Finding(check, None, f"not seen: {len(modes)} of the model's {below + 1} modules ran as Python calls "
                   f"{during} (a CUDA-graph replay or a compiled forward runs no hook); give the check an eager "
                   "forward of the same model")


def check_train_mode(model: nn.Module, step_fn: Callable[[], object]) -> Finding:
    """The modes of ``model``'s modules while ``step_fn()`` runs: pass a step, or (as ``check_phase`` does) an eager
    forward of the model in the modes the step runs with; a ``step_fn`` whose modules ran unseen is said, not
    passed."""
    modes = _mode_probe(model, step_fn)
    blind = _blind(model, modes, "train mode while training", "during the step")
    if blind is not None:
        return blind
    evals = [n or "<root>" for n, t in modes if not t]
    if evals:
        return Finding("train mode while training", False, f"{len(evals)} module(s) ran in eval mode during a training "
                       f"step (e.g. {evals[0]})", "model.eval() was left on (after sampling/validation or loading)",
                       "call model.train() before the training loop and after every evaluation")
    return _ok("train mode while training", f"{len(modes)} modules in train mode")


def check_eval_mode(model: nn.Module, sample_fn: Callable[[], object]) -> Finding:
    modes = _mode_probe(model, sample_fn)
    blind = _blind(model, modes, "eval mode while sampling", "while sampling")
    if blind is not None:
        return blind
    trains = [n or "<root>" for n, t in modes if t]
    if trains:
        return Finding("eval mode while sampling", False, f"{len(trains)} module(s) ran in train mode while sampling "
                       f"(e.g. {trains[0]})", "model.eval() was not called before sampling",
                       "wrap sampling in model.eval() and torch.no_grad()")
    return _ok("eval mode while sampling", f"{len(modes)} modules in eval mode")


def step_modes_forward(trainer, batch) -> tuple[nn.Module, Callable[[], object]]:
    """(a copy of the phase's model, a forward of the phase's loss on ``batch`` through it): what ``check_phase``'s
    train-mode check watches instead of ``trainer.train_step``. The step's own forward is, on CUDA's default path,
    a CUDA-graph replay (``graph: step``) of a compiled model, where no forward hook runs (a compiled model whose
    graph was cached before the hooks existed runs without them too), so the probe saw the root alone and passed; a
    graph replays the modes its modules had when it was captured, and eager and compiled steps run
    the modes the model has, so the question is the modes ``trainer.model`` is in now, before the phase's first
    step (the capture follows a few steps later). This forward runs them eagerly, on every path: a deep copy (the
    same modes; a train-mode forward updates BatchNorm statistics and other state of its own), without gradient or
    optimizer step, under the phase's autocast, the random state restored after (dropout and the loss's draws leave
    the steps that follow as they were)."""
    from sinkflow.runtime.autocast import autocast

    probe = copy.deepcopy(trainer.model)
    device = trainer.device

    def forward():
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), \
                autocast(device.type, trainer.precision):
            trainer.task.loss(probe, batch)

    return probe, forward


def check_frozen(frozen: dict[str, nn.Module], optimizer: torch.optim.Optimizer, step_fn: Callable[[], object]) -> Finding:
    if not frozen:
        return Finding("frozen phases stay frozen", None, "no earlier phase's model is used here")
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    before = {k: copy.deepcopy(m.state_dict()) for k, m in frozen.items()}
    step_fn()
    for k, m in frozen.items():
        if any(p.requires_grad for p in m.parameters()) or any(id(p) in ids for p in m.parameters()):
            return Finding("frozen phases stay frozen", False, f"the frozen model of phase {k} has trainable parameters",
                           "it was not frozen with requires_grad_(False) or is in this phase's optimizer",
                           "load earlier phases with run.model(phase) (eval, requires_grad False)")
        after = m.state_dict()
        if any(not torch.equal(before[k][n], after[n]) for n in after):
            return Finding("frozen phases stay frozen", False, f"the frozen model of phase {k} changed during a step",
                           "its weights or buffers (BatchNorm stats in train mode) are updated", "keep it in eval mode")
    return _ok("frozen phases stay frozen", f"{', '.join(frozen)} unchanged")


def _short_budget(steps: int, losses: list[float]) -> tuple[str, str] | None:
    """(cause, fix) when a failed overfit rule's loss was still falling at the end (the last quarter of the run
    still gave over a tenth of the drop so far): the budget, not the wiring, is then the first suspect, at the
    default budget too (flow-mnist's 2.8M-parameter Glow went 8.1 -> 5.0 bits/dim in 300 steps, 2.5 in 600: it was
    called miswired). A loss that has levelled off (a flow whose couplings are all frozen still fits its linear parts
    for a while, then stops) keeps the wiring diagnosis."""
    if len(losses) < 2:
        return None
    q = max(1, len(losses) // 4)
    first, last = sum(losses[:3]) / len(losses[:3]), sum(losses[-q:]) / q
    before = sum(losses[-2 * q:-q]) / len(losses[-2 * q:-q]) if len(losses) >= 2 * q else first
    # below the first loss too: a 3-step mean takes in a rise (1, 3, 1.5 read as "still falling"); and the last ten
    # steps' mean, the one the finding shows, below the first three's ("went 1.25 -> 1.88 ... still falling")
    shown = sum(losses[-10:]) / len(losses[-10:])
    if last < first and last < losses[0] and shown < first and before - last > 0.1 * (first - last):
        more = OVERFIT_STEPS if steps < OVERFIT_STEPS else 2 * steps
        why = f"the check's default is {OVERFIT_STEPS}" if steps < OVERFIT_STEPS else "a large model fits slowly"
        return (f"{steps} steps may be too few: the loss was still falling ({why})",
                f"rerun with --steps {more} before suspecting the wiring")
    return None


def _levelled_short(steps: int, first: float, last: float, factor: float) -> tuple[str, str] | None:
    """(cause, fix) when a failed overfit rule's loss fell over half the way to ``factor`` on a log scale (above
    sqrt(factor): 3.2x of 10x) and then levelled (``_short_budget`` did not fire): a loop that learns, held short by
    its budget or its LR, not a broken one (a missing step, a detached loss, a loss that reaches no weight barely
    moves it). mnist's velocity UNet on an H200, `sinkflow doctor mnist --steps 100`: 0.727 -> 0.0773 (9.4x), flat
    with noise over its last quarter, was "the loop is broken (wiring above)", a false alarm on a healthy preset
    that sent the user hunting a wiring bug. Such a plateau on one fixed batch is the noise of Adam's steps at this
    LR (a lower LR, or more steps, fits further)."""
    if not (first > 0 and last > 0 and first / last >= math.sqrt(factor)):
        return None
    more = OVERFIT_STEPS if steps < OVERFIT_STEPS else 2 * steps
    return (f"the loss fell {first / last:.1f}x, then levelled short of {factor:g}x: the loop learns (a broken one "
            "barely moves the loss); the step budget or the LR held it short",
            f"rerun with --steps {more}; if it levels again short of {factor:g}x, lower the LR "
            "(sinkflow lr-find)")


def overfit_one_batch(step_fn: Callable[[], float], steps: int = OVERFIT_STEPS, factor: float = 10.0,
                      extend_within_s: float = EXTEND_WITHIN_S) -> Finding:
    """``step_fn()`` takes one optimizer step on the same fixed batch and returns its loss.

    At the default budget a loss still falling at its end goes on to ``EXTEND_TO`` times the steps where they take
    under ``extend_within_s`` seconds: NSGF++'s 2-D time predictor (the paper's lr 1e-4) fitted one batch 4-6.5x in
    300 steps on 2 of 4 seeds of `sinkflow doctor moons --method nsgfpp`, a FAIL whose fix was to rerun with more
    steps. A budget the user gave (``--steps``) is kept."""
    losses: list[float] = []
    unapplied: list[int] = []
    budget, t0 = steps, time.perf_counter()
    while len(losses) < budget:
        taken = len(losses)
        skipped = _skipped(step_fn, losses, unapplied)
        if skipped:
            return Finding("overfit one batch", False, skipped[0], skipped[1] or "the LR is too high for this model",
                           skipped[2] or "lower it (sinkflow lr-find)")
        if len(losses) == taken:
            continue  # float16's GradScaler skipped it: taken again (the rule reads applied steps)
        if not math.isfinite(losses[-1]):
            return Finding("overfit one batch", False, f"the loss became {losses[-1]} at step {len(losses)}",
                           "the LR is too high for this model", "lower it (sinkflow lr-find)")
        if len(losses) == budget == steps == OVERFIT_STEPS and not _fitted(losses, factor) \
                and _short_budget(steps, losses) and (time.perf_counter() - t0) * (EXTEND_TO - 1) < extend_within_s:
            budget = EXTEND_TO * steps
    asked, steps = steps, len(losses)
    more = f"; still falling at {asked}, so it went on" if steps > asked else ""
    more += _skips(unapplied)
    first = sum(losses[:3]) / 3
    last = sum(losses[-10:]) / len(losses[-10:])
    if not _fitted(losses, factor):
        cause, fix = _short_budget(steps, losses) or _levelled_short(steps, first, last, factor) or (
            "the loop is broken (wiring above) or the LR is far off", "fix the wiring findings first, then try "
            "sinkflow lr-find")
        return Finding("overfit one batch", False, f"the loss on one fixed batch went {first:.3g} -> {last:.3g} in "
                       f"{steps} steps (< {factor:g}x{more})", cause, fix)
    return _ok("overfit one batch", f"loss {first:.3g} -> {last:.3g} in {steps} steps "
               f"({first / max(last, 1e-30):.0f}x{more})")


def _skipped(step_fn: Callable[[], float], losses: list[float], unapplied: list[int]) -> tuple:
    """Take a step, appending its loss to ``losses``; a step not applied because it was non-finite (``NonFiniteStep``:
    ``Trainer.checked_step``, or foreach Adam's host check, or float16's scale below 1) is the (symptom, cause, fix)
    it returns instead (cause and fix None: the rule's own; () otherwise). A finite step float16's GradScaler skipped
    (``UnappliedStep``: lr-find's ``checked_update``) appends its number to ``unapplied`` instead of its loss, which
    is the weights' as they were: counted as a step, skips ate the budget and a run of them read as a loss that did
    not fall, "the loop is broken"."""
    from sinkflow.engine.trainer import NonFiniteStep
    from sinkflow.tools.lr_find import UnappliedStep

    try:
        losses.append(float(step_fn()))
    except NonFiniteStep as exc:
        symptom = f"step {len(losses) + 1} was not applied: {exc.what or exc}"
        if exc.what.startswith("float16 loss scale"):  # its own cause and fix: the precision key
            return symptom, "the gradients overflow float16 even unscaled (float16's range, or the LR)", exc.fix
        return symptom, None, None
    except UnappliedStep:
        unapplied.append(len(losses) + 1)
    return ()


def _skips(unapplied: list[int]) -> str:
    """The finding's note of the steps float16's GradScaler skipped (and the rule took again)."""
    return f"; {len(unapplied)} more skipped by float16's GradScaler" if unapplied else ""


def _fitted(losses: list[float], factor: float) -> bool:
    """The overfit rule: the last ten steps' mean loss below the first three's by ``factor``."""
    return sum(losses[-10:]) / len(losses[-10:]) < sum(losses[:3]) / 3 / factor


# ---- likelihood models (normalizing flows) ------------------------------------------------------

def overfit_one_batch_bpd(step_fn: Callable[[], float], dataset_bpd: float, steps: int = OVERFIT_STEPS,
                          ratio: float = 0.75, floor: float = -0.05) -> Finding:
    """The overfit rule for a likelihood model. ``step_fn()`` takes one optimizer step on the same fixed
    images, *freshly dequantised every step*, and returns their bits/dim.

    A regression loss can be driven to ~0, so the general rule asks for a 10x drop; bits/dim cannot: on
    discrete data it is bounded below by the code length of the batch, which is >= 0, and the dequantised
    bound keeps that floor in expectation over the noise. So: pass when the bits/dim of the batch falls
    well below the data set's value, under ``ratio * dataset_bpd`` (``dataset_bpd``: what a model that
    ignores every pixel correlation scores, see ``flow_dataset_bpd``) within ``steps``; fail when it stalls
    above it (a frozen layer, a broken conditioner, an LR far off); and fail when it goes *below zero* by
    more than ``floor``: a proper density cannot do that on fresh noise, so the log-density is not
    normalised (a log-det sign error, a prior missing its normaliser).
    """
    check = "overfit one batch (bits/dim)"
    target = ratio * dataset_bpd
    losses: list[float] = []
    unapplied: list[int] = []
    while len(losses) < steps:
        taken = len(losses)
        skipped = _skipped(step_fn, losses, unapplied)
        if skipped:
            return Finding(check, False, skipped[0], skipped[1] or "the LR is too high for this flow, or an inverse "
                           "overflowed", skipped[2] or "lower it (sinkflow lr-find)")
        if len(losses) == taken:
            continue  # float16's GradScaler skipped it: taken again (the rule reads applied steps)
        if not math.isfinite(losses[-1]):
            return Finding(check, False, f"bits/dim became {losses[-1]} at step {len(losses)}",
                           "the LR is too high for this flow, or an inverse overflowed", "lower it (sinkflow lr-find)")
        recent = losses[-10:]
        if len(losses) >= 10 and sum(recent) / len(recent) < floor:
            return Finding(check, False, f"bits/dim on one batch went {losses[0]:.3g} -> {sum(recent) / len(recent):.3g} "
                           f"(< 0) in {len(losses)} steps", "the log-density is not normalised: a log-det with the "
                           "wrong sign, or a prior without its normalising constant (bits/dim of discrete data under "
                           "fresh dequantisation noise cannot go below 0)", "check each layer's log-det against "
                           "slogdet of its Jacobian (the 'log-det matches Jacobian' check)")
        if len(losses) >= 10 and sum(recent) / len(recent) < target:
            break  # reached: no need to spend the remaining steps
    first = sum(losses[:3]) / 3
    last = sum(losses[-10:]) / len(losses[-10:])
    ref = f" = {ratio:g} x the data set's independent-pixel {dataset_bpd:.3f}"
    if not last < target:
        cause, fix = _short_budget(steps, losses) or (
            "the flow cannot fit even one batch: a frozen or disconnected layer, a conditioner that never sees its "
            "input, or an LR far off", "fix the wiring findings first, then try sinkflow lr-find")
        return Finding(check, False, f"bits/dim on one fixed batch went {first:.3f} -> {last:.3f} in {steps} steps "
                       f"(target < {target:.3f}{ref}{_skips(unapplied)})", cause, fix)
    return _ok(check, f"bits/dim {first:.3f} -> {last:.3f} in {len(losses)} steps (target < {target:.3f}{ref}"
               f"{_skips(unapplied)})")


def flow_dataset_bpd(target, n_bins: int, n: int = 2048) -> float:
    """The data set's value for the overfit rule: bits/dim of an independent-pixel categorical fitted to (and
    scored on) ``n`` training images. Any flow that fits one batch must get well below it."""
    from sinkflow.flows import to_levels
    from sinkflow.flows.baselines import independent_pixel_bpd
    from sinkflow.methods.normalizing_flow import pixel_levels

    x = target.sample(n, torch.Generator().manual_seed(0), "cpu")
    k = to_levels(pixel_levels(x, n_bins), n_bins).reshape(n, -1).numpy()
    return independent_pixel_bpd(k, k, n_bins)


def check_flow_trainable(model: nn.Module) -> Finding:
    """Every layer of a flow should train: a flow has no reason to freeze one, and a frozen coupling is a
    silent fault (the wiring checks only look at trainable tensors)."""
    check = "flow layers all trainable"
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        layers = sorted({n.rsplit(".", 1)[0].split(".net")[0] for n in frozen})
        return Finding(check, False, f"{len(frozen)} parameter tensor(s) of the flow are frozen (e.g. {frozen[0]}; "
                       f"layers: {', '.join(layers[:3])}{' ...' if len(layers) > 3 else ''})",
                       "requires_grad_(False) was left on (after loading, sampling or a partial freeze)",
                       "call model.requires_grad_(True) before training the flow")
    return _ok(check, f"all {sum(1 for _ in model.parameters())} tensors trainable")


@torch.no_grad()
def check_flow_logdet(model: "FlowModel", x: torch.Tensor, max_dims: int = 1024, tol: float = 1e-3) -> Finding:
    """The flow's log-det (``encode``) equals slogdet of the brute-force Jacobian of ``x -> latents`` on one
    sample, in float64 on a copy of the model (skipped above ``max_dims`` dimensions)."""
    check = "log-det matches Jacobian"
    dims = x[0].numel()
    if dims > max_dims:
        return Finding(check, None, f"{dims} dimensions per sample (brute-force Jacobian only up to {max_dims})")
    m = copy.deepcopy(model).double().eval()
    m.set_memory("standard")
    x0 = x[:1].double()

    def f(v):
        zs, _, _ = m.encode(v.view_as(x0))
        return torch.cat([z.flatten() for z in zs])

    with torch.enable_grad():
        jac = torch.autograd.functional.jacobian(f, x0.flatten(), vectorize=True)
        _, logdet, _ = m.encode(x0)
    sign, ref = torch.linalg.slogdet(jac)
    got = float(logdet.reshape(-1)[0])
    err = abs(got - float(ref)) / max(1.0, abs(float(ref)))
    if not float(sign) != 0 or not err < tol:
        return Finding(check, False, f"the flow's log-det is {got:.6g} but slogdet of its Jacobian is {float(ref):.6g}",
                       "a layer's log-det has the wrong sign or scale, or its forward is not what its log-det "
                       "describes", "test each layer: torch.autograd.functional.jacobian vs the returned log-det")
    return _ok(check, f"{got:.6g} vs slogdet {float(ref):.6g} ({dims} dims, float64)")


# ---- data --------------------------------------------------------------------------------------

def _tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def check_batch_values(batch, images: bool = False) -> Finding:
    ts = _tensors(batch)
    for i, t in enumerate(ts):
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            return Finding("batch values", False, f"batch tensor {i} holds {bad} NaN/Inf values",
                           "bad input files or a division by zero in preprocessing", "check the data pipeline")
        if t.is_floating_point() and t.dtype != torch.float32:
            return Finding("batch values", False, f"batch tensor {i} is {t.dtype}", "preprocessing changed the dtype",
                           "convert to float32 (autocast handles lower precision)")
    x = ts[0]
    lo, hi = float(x.min()), float(x.max())
    if images and (lo < -1.001 or hi > 1.001):
        cause = "uint8 pixels were not scaled" if hi > 2 else "normalised with the wrong mean/std"
        return Finding("batch values", False, f"images span [{lo:.3g}, {hi:.3g}], expected [-1, 1]", cause,
                       "scale to [-1, 1]: x / 127.5 - 1")
    if images and hi - lo < 0.5:
        return Finding("batch values", False, f"images span only [{lo:.3g}, {hi:.3g}]",
                       "scaled twice (e.g. ToTensor then / 255)", "scale once to [-1, 1]")
    if images and lo >= -0.01 and hi > 0.5:  # the source is N(0, I) around 0: data in [0, 1] sits off its centre
        return Finding("batch values", False, f"images span [{lo:.3g}, {hi:.3g}], expected [-1, 1]",
                       "scaled to [0, 1] (ToTensor) and not shifted", "scale to [-1, 1]: x * 2 - 1")
    return _ok("batch values", f"{len(ts)} tensors, float32, finite, x in [{lo:.3g}, {hi:.3g}]")


def check_batches_differ(batch_fn: Callable[[], object]) -> Finding:
    a, b = _tensors(batch_fn()), _tensors(batch_fn())
    if all(torch.equal(x, y) for x, y in zip(a, b)):
        return Finding("batches differ", False, "two consecutive batches are identical",
                       "the sampler is re-seeded every step or the iterator is recreated each time",
                       "draw from one generator that advances (and is checkpointed)")
    return _ok("batches differ", "consecutive batches differ")


class _Tap(torch.utils.data.Dataset):
    """Serves dataset[fixed] (or the index itself) with the worker id, to see the loader's randomness."""

    def __init__(self, dataset, fixed: int | None):
        self.dataset, self.fixed = dataset, fixed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info is not None else -1
        if self.fixed is None:
            return torch.tensor(i), torch.tensor(wid)
        item = self.dataset[self.fixed]
        first = _tensors(item)[0] if _tensors(item) else torch.as_tensor(item)
        return torch.as_tensor(first).float(), torch.tensor(wid)


def _rebuild(loader, dataset, **kw):
    args = dict(batch_size=loader.batch_size, num_workers=loader.num_workers, worker_init_fn=loader.worker_init_fn,
                generator=loader.generator, persistent_workers=loader.persistent_workers if loader.num_workers else False,
                multiprocessing_context=loader.multiprocessing_context, drop_last=loader.drop_last)
    args.update(kw)
    if "batch_sampler" in args:
        for k in ("batch_size", "drop_last"):
            args.pop(k)
    return torch.utils.data.DataLoader(dataset, **args)


def check_loader_order(loader, epochs: int = 2, epoch_hook: Callable[[int], None] | None = None) -> Finding:
    """The loader's sampler must give a different order every epoch (``epoch_hook(e)`` = your set_epoch call)."""
    probe = _rebuild(loader, _Tap(loader.dataset, None), batch_sampler=loader.batch_sampler, num_workers=0,
                     persistent_workers=False)
    orders = []
    for e in range(epochs):
        if epoch_hook is not None:
            epoch_hook(e)
        orders.append(torch.cat([idx for idx, _ in probe]).tolist())
    if all(o == orders[0] for o in orders[1:]):
        return Finding("new order every epoch", False, f"the loader yields the same order in {epochs} epochs",
                       "shuffle=False, or a DistributedSampler without set_epoch(epoch)",
                       "shuffle=True, or call sampler.set_epoch(epoch) at the start of every epoch")
    return _ok("new order every epoch", f"{epochs} epochs, different orders")


def check_loader_augmentation(loader, epochs: int = 2, items: int = 8, index: int = 0) -> Finding:
    """Random augmentation must differ across workers and epochs.

    Every item served is ``dataset[index]`` (one fixed sample): a deterministic dataset then gives identical
    items (no finding), a random augmentation different ones; duplicated streams across workers (numpy or a
    ``default_rng`` forked with the same state) or across epochs show up as identical per-worker sequences.
    """
    if loader.num_workers == 0 and epochs < 2:
        return Finding("augmentation differs across workers/epochs", None, "no workers and one epoch")
    n = items * max(1, loader.num_workers)
    tap = _Tap(loader.dataset, index)
    probe = _rebuild(loader, torch.utils.data.Subset(tap, list(range(n)) if len(tap) >= n else [i % len(tap) for i in range(n)]),
                     shuffle=False, batch_size=1, drop_last=False)
    per_epoch = []
    for _ in range(epochs):
        seqs: dict[int, list[torch.Tensor]] = {}
        for x, wid in probe:
            seqs.setdefault(int(wid[0]), []).append(x[0])
        per_epoch.append(seqs)
    every = [x for seqs in per_epoch for s in seqs.values() for x in s]
    if all(torch.equal(every[0], x) for x in every[1:]):
        return Finding("augmentation differs across workers/epochs", None, "the dataset is deterministic (no random "
                       "augmentation)")
    workers = sorted(per_epoch[0])
    for e, seqs in enumerate(per_epoch):
        for i, a in enumerate(workers):
            for b in workers[i + 1:]:
                sa, sb = seqs.get(a, []), seqs.get(b, [])
                k = min(len(sa), len(sb))
                if k >= 2 and all(torch.equal(sa[j], sb[j]) for j in range(k)):
                    return Finding("augmentation differs across workers/epochs", False, f"workers {a} and {b} produce "
                                   f"the same random augmentations (epoch {e})", "every worker starts from the same "
                                   "RNG state (numpy seeded before the fork, or a np.random.default_rng made in "
                                   "__init__)", "seed per worker: worker_init_fn=lambda w: np.random.seed("
                                   "torch.initial_seed() % 2**32), or draw augmentations with torch")
    for a in workers:
        s0 = per_epoch[0].get(a, [])
        for e in range(1, epochs):
            s1 = per_epoch[e].get(a, [])
            k = min(len(s0), len(s1))
            if k >= 2 and all(torch.equal(s0[j], s1[j]) for j in range(k)):
                return Finding("augmentation differs across workers/epochs", False, f"worker {a} repeats epoch 0's "
                               f"augmentations in epoch {e}", "the worker's RNG is reset to the same state every epoch",
                               "seed from torch.initial_seed() in worker_init_fn (it changes every epoch)")
    return _ok("augmentation differs across workers/epochs", f"{len(workers)} worker(s) x {epochs} epochs all differ")


def check_batchnorm_batch1(model: nn.Module, micro_batches: Iterable[int]) -> Finding:
    bns = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return Finding("no batch of 1 at BatchNorm", None, "the model has no BatchNorm")
    sizes = sorted(set(int(s) for s in micro_batches))
    if 1 in sizes:
        return Finding("no batch of 1 at BatchNorm", False, f"a micro-batch of size 1 reaches BatchNorm ({bns[0]})",
                       "batch_size / accum / processes leaves 1 sample (or a last partial batch of 1)",
                       "use drop_last=True, a batch divisible by accum x processes, or GroupNorm")
    return _ok("no batch of 1 at BatchNorm", f"micro-batches {sizes}")


def micro_batch_sizes(batch_size: int, accum: int, world: int = 1) -> list[int]:
    per_rank = torch.arange(batch_size).chunk(world)[0].numel()
    return [c.numel() for c in torch.arange(per_rank).chunk(max(1, accum))]


# ---- a sinkflow phase ---------------------------------------------------------------------------

def _rows(batch, pick: Callable[[torch.Tensor], torch.Tensor]):
    """``pick`` applied to every tensor of ``batch`` (a tensor, or dicts / lists / tuples of them) that has rows."""
    if isinstance(batch, torch.Tensor):
        return pick(batch) if batch.dim() else batch
    if isinstance(batch, dict):
        return {k: _rows(v, pick) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_rows(v, pick) for v in batch)
    return batch


def _subset(batch, n: int):
    """``batch``'s first ``n`` rows."""
    return _rows(batch, lambda t: t[:n])


def _tiled(batch, n: int):
    """``batch``'s first ``n`` rows repeated to its own length: a subset of the shape a captured step takes."""
    return _rows(batch, lambda t: t[torch.arange(len(t), device=t.device) % max(1, min(n, len(t)))])


FP16_SKIPS = 24  # GradScaler's scale starts at 2**16 and halves on each skipped step: 2**-8 after this many


def applied_step(trainer, batch) -> None:
    """One optimizer step that is applied: under float16 GradScaler skips the steps whose scaled gradients overflow
    (the first few of a run, while the scale comes down from 2**16), which is not a wiring fault, so a step it
    skipped (its scale halved) is taken again; a step not applied for any other reason is the finding's, and any
    other precision takes exactly one step."""
    from sinkflow.engine.finite import optimizer_steps

    scaler = trainer.scaler
    before = optimizer_steps(trainer.optimizer)
    for _ in range(FP16_SKIPS if scaler.is_enabled() else 1):
        scale = scaler.get_scale() if scaler.is_enabled() else 0.0
        trainer.train_step(batch)
        if optimizer_steps(trainer.optimizer) > before or not scaler.is_enabled() or scaler.get_scale() >= scale:
            return


def at_base_lr(trainer, step_fn: Callable[[], object]) -> None:
    """``step_fn()`` (one training step) with every parameter group at its base rate, the schedule then going on as
    before (its ``step`` sets the next rate). The wiring check asks whether a tensor moves at all: under cifar10's
    5,000-step warm-up the first updates are lr x 1/5000, below float32's resolution for weights near 1
    (GroupNorm's), and 104 of 304 tensors read "unchanged", a false alarm (``train.velocity.warmup=0``: all moved)."""
    for group in trainer.optimizer.param_groups:
        base = group.get("initial_lr", group["lr"])
        if torch.is_tensor(group["lr"]):  # a captured step reads the rate from its tensor
            group["lr"].fill_(base)
        else:
            group["lr"] = base
    step_fn()


def check_phase(run, trainer, overfit_steps: int = OVERFIT_STEPS, overfit_batch: int = 16,
                factor: float = 10.0) -> list[Finding]:
    """Every check on a ready Trainer (``sinkflow.tools.phases.ready_trainer``), using its real train_step."""
    from sinkflow.tools.data import NATIVE_CHW
    from sinkflow.tools.lr_find import checked_update

    images = run.cfg["data"]["target"] in NATIVE_CHW
    model, opt = trainer.model, trainer.optimizer
    batch = trainer.batch
    device = next(model.parameters()).device
    out = [check_batch_values(batch, images=False)]
    from sinkflow import data

    target = data.distributions(run.cfg)[1]
    out.append(check_batch_values(target.sample(64, torch.Generator().manual_seed(0), device), images=images))
    out[-1].check = "data values"
    out.append(check_batches_differ(lambda: trainer.draw_batch(trainer.cfg["batch_size"])))
    out.append(check_optimizer_covers(model, opt))
    if _takes_time(model, batch):
        out.append(check_inputs_reach_output(model, batch[0], batch[1]))
    # the eager model: whether backward reaches every weight is the loss's and the model's question, not the
    # compiler's; a compiled model's first call here compiled outside train_step, whose `compile: auto` falls back to
    # eager where compiling fails (doctor crashed with dynamo's error instead), and without autocast (a second compile)
    out.append(check_loss_graph(trainer.eager_model, trainer.task.loss, batch))
    out.append(check_train_mode(*step_modes_forward(trainer, batch)))
    out.append(check_weights_change(model, lambda: at_base_lr(trainer, lambda: applied_step(trainer, batch)),
                                    optimizer=opt))
    frozen = run.loaded_models
    out.append(check_frozen(frozen, opt, lambda: trainer.train_step(batch)))
    out.append(check_batchnorm_batch1(model, micro_batch_sizes(trainer.cfg["batch_size"], trainer.cfg["accum"],
                                                                 trainer.info.world)))
    # a captured step (graph: step, the CUDA default for UNet phases) takes batches of its own shape only: the
    # subset is tiled to that shape (the same samples, the same mean loss); the whole first batch, 128 samples on the
    # mnist preset against 16 eager, fitted 9.4x in 100 steps on an H200 where 16 fit easily
    fixed = _tiled(batch, overfit_batch) if trainer.step_graph is not None else _subset(batch, overfit_batch)
    if _is_flow(model):
        out += _flow_checks(run, trainer, fixed, overfit_steps)
    else:
        out.append(overfit_one_batch(lambda: checked_update(trainer, fixed), steps=overfit_steps, factor=factor))
    for f in out:
        f.phase = trainer.name
    return out


def _takes_time(model, batch) -> bool:
    """A velocity-field phase: its batches are (x, t, target) and its network is called as model(x, t)."""
    import inspect

    if not (isinstance(batch, (tuple, list)) and len(batch) == 3 and isinstance(batch[0], torch.Tensor)):
        return False
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 2


def _is_flow(model) -> bool:
    from sinkflow.flows import FlowModel

    return isinstance(model, FlowModel)


def _flow_checks(run, trainer, fixed, overfit_steps: int) -> list[Finding]:
    """Flow phases: trainable layers, log-det vs Jacobian, and the likelihood overfit rule.

    The phase's batches are dequantised levels ``k + u`` in [0, n_bins); the overfit steps keep the images
    (``floor``) fixed and draw fresh noise every step, as training does, so bits/dim keeps its floor of 0.
    """
    from sinkflow import data
    from sinkflow.flows import preprocess
    from sinkflow.tools.lr_find import checked_update

    model = trainer.model
    n_bins = run.cfg["model"]["flow"]["n_bins"]
    out = [check_flow_trainable(model), check_flow_logdet(model, preprocess(fixed, n_bins))]
    levels = torch.floor(fixed)
    gen = torch.Generator().manual_seed(0)

    def step():
        u = torch.rand(levels.shape, generator=gen).to(levels.device)
        # the device's skip record read at once (the rules read each loss), float16's skipped updates told apart
        return checked_update(trainer, levels + u)

    dataset_bpd = flow_dataset_bpd(data.distributions(run.cfg)[1], n_bins)
    out.append(overfit_one_batch_bpd(step, dataset_bpd, steps=overfit_steps))
    return out


def drop_checked(trainer) -> None:
    """Free what a checked phase's trainer holds before the next phase is built: its step graph at once (a ready
    trainer keeps it for the checks' steps; on CUDA the graph's memory pool and static batch), the rest (model,
    Adam's moments, gradients) when the caller drops its last reference and ``run.release()`` collects. Held across
    the loop, the next phase's scratch run built and trained every earlier phase on top of it (on a card: its
    memory too)."""
    if trainer.step_graph is not None:
        trainer.step_graph.release()


def doctor_run(cfg: dict | None, workdir, run_dir=None, overfit_steps: int = OVERFIT_STEPS, overfit_batch: int = 16,
               factor: float = 10.0, phases: list[str] | None = None, device: str | None = None) -> list[Finding]:
    """All checks on every training phase (a scratch run of ``cfg``, or the existing ``run_dir``, on ``device`` for this
    call where given), then sampling."""
    from pathlib import Path

    from sinkflow import data, methods
    from sinkflow.tools.phases import (open_run_phase, quiet_cut, read_device, scratch_overrides, train_phase_names,
                                       workspace)

    findings: list[Finding] = []
    if run_dir is not None:
        from sinkflow.runtime.run_folder import RunFolder

        cfg = read_device(run_dir, device)
        names = phases or train_phase_names(cfg)
        for name in names:
            run, ph = open_run_phase(Path(run_dir), name, device)
            findings += check_phase(run, ph, overfit_steps, overfit_batch, factor)
            drop_checked(ph)
            del ph
            run.release()  # collects the trainer's reference cycles (the cyclic collector may not run for long)
        final_run = RunFolder(Path(run_dir), cfg, log=False)
    else:
        names = phases or train_phase_names(cfg)
        run = None
        for i, name in enumerate(names):
            sub = Path(workdir) / f"phase{i}"
            run, ph = workspace(cfg, name, sub)
            findings += check_phase(run, ph, overfit_steps, overfit_batch, factor)
            run.logger.close()
            drop_checked(ph)
            del ph
            run.release()  # collects the trainer's reference cycles (the cyclic collector may not run for long)
        final_run = None
        if names == train_phase_names(cfg):  # a full tiny run for the sampling check
            from sinkflow.engine.experiment import run_phases

            tiny = [f"experiment.runs_dir={Path(workdir) / 'full'}", "experiment.name=tiny", "pool.batches=1",
                    f"pool.steps={min(cfg['pool']['steps'], 3)}", "pool.in_flight=0", *scratch_overrides(cfg)]
            tiny += [o for k in cfg["train"] for o in (f"train.{k}.iters=2", *quiet_cut(cfg, k, 2))]
            from sinkflow import config as config_mod
            from sinkflow.runtime.run_folder import RunFolder

            final_run = RunFolder.create(config_mod.apply_overrides(cfg, tiny))
            source, target = data.distributions(final_run.cfg)
            run_phases(final_run, methods.phases(final_run.cfg, source, target))
    unfinished = [] if final_run is None else [n for n in train_phase_names(final_run.cfg)
                                               if not final_run.phase_done(n)]
    if final_run is not None and not unfinished:
        from sinkflow.eval.points import generate

        models = [final_run.model(n) for n in train_phase_names(final_run.cfg)]
        wrapper = nn.ModuleList(models)
        f = check_eval_mode(wrapper, lambda: generate(final_run, 8, 2, seed=0))
        f.phase = "sample"
        findings.append(f)
        final_run.logger.close()
    else:  # said, not left out: a report without the line reads as if sampling had been checked
        why = (f"phase(s) {', '.join(unfinished)} not finished: the run has no sampler yet" if unfinished else
               f"only phase(s) {', '.join(names)} checked (--phase): sampling needs every phase")
        findings.append(Finding("eval mode while sampling", None, why, phase="sample"))
    return findings
