"""Is a checkpoint's content what this run expects? Checked before anything is loaded or written.

``torch.load(weights_only=True)`` guarantees a checkpoint runs no code, not that it holds the right things:
a weight replaced by a list, an int64 or bool weight (``load_state_dict`` would copy it silently), a
missing ``model``, an Adam moment of the wrong shape, a generator or RNG state of another format. Each
would end in a traceback half-way through a resume (after ``status.json`` and the lock were rewritten) or
in garbage samples. These checks compare the content with the model, optimizer and generators the run
builds (a model built on the ``meta`` device is enough: only names, shapes and dtypes are read) and say
in one line which entry is wrong. RNG states are checked by setting them on throwaway generators, so
the checks never touch the process's own random streams.

A leaf of the runtime layer: torch, numpy and ``sinkflow.errors`` only.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from sinkflow.errors import SinkflowError

FIX = "delete it to resume from the checkpoint before it (or start a new run); sinkflow only resumes checkpoints it wrote"


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _bad(where: str, what: str, problem: str) -> SinkflowError:
    return SinkflowError(f"checkpoint {where} is not what this run expects: {what} {problem}", FIX)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_weights(weights: Any, expected: dict[str, torch.Tensor], where: str, what: str = "model") -> None:
    """``weights`` is a state dict with exactly ``expected``'s names, each a tensor of its shape and dtype."""
    if not isinstance(weights, dict):
        raise _bad(where, what, f"is {_kind(weights)}, not a dict of tensors")
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected), key=str)
    if missing or extra:
        key = missing[0] if missing else extra[0]
        raise SinkflowError(f"checkpoint {where} does not match the configured model ("
                            f"{'missing' if missing else 'unexpected'} {what}.{key})",
                            "resume with the model config the run was trained with")
    for key, ref in expected.items():
        value = weights[key]
        if not isinstance(value, torch.Tensor):
            raise _bad(where, f"{what}.{key}", f"is {_kind(value)}, not a tensor")
        if value.dtype != ref.dtype:
            raise _bad(where, f"{what}.{key}", f"is {_kind(value)}; the model holds {str(ref.dtype).replace('torch.', '')}")
        if value.shape != ref.shape:
            raise SinkflowError(
                f"checkpoint {where} holds {what}.{key} of shape {tuple(value.shape)} but the configured model "
                f"needs {tuple(ref.shape)}", "resume with the model config the run was trained with")
        if value.is_sparse or value.layout != torch.strided:
            raise _bad(where, f"{what}.{key}", "is not a dense tensor")


def expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict()


def check_final(state: Any, model: torch.nn.Module, where: str) -> None:
    """A training phase's ``final.pt``: what later phases and sampling read (``model`` and ``ema`` weights)."""
    if not isinstance(state, dict):
        raise _bad(where, "the checkpoint", f"is {_kind(state)}")
    expected = expected_weights(model)
    if "model" not in state:
        raise _bad(where, "the entry 'model'", "is missing")
    check_weights(state["model"], expected, where, "model")
    if state.get("ema") is not None:
        check_weights(state["ema"], expected, where, "ema")


def _check_adam(opt: Any, params: list[torch.Tensor], where: str) -> None:
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        raise _bad(where, "optimizer", f"is {_kind(opt)} without 'state' and 'param_groups'")
    groups = opt["param_groups"]
    if len(groups) != 1 or not isinstance(groups[0], dict):
        raise _bad(where, "optimizer.param_groups", f"has {len(groups)} groups; this phase's Adam has 1")
    group = groups[0]
    if group.get("params") != list(range(len(params))):
        raise _bad(where, "optimizer.param_groups.0.params", f"does not list the model's {len(params)} parameters")
    for key in ("lr", "eps", "weight_decay"):
        if not _number(group.get(key)):
            raise _bad(where, f"optimizer.param_groups.0.{key}", f"is {_kind(group.get(key))}, not a finite number")
    betas = group.get("betas")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_number(b) for b in betas)):
        raise _bad(where, "optimizer.param_groups.0.betas", "is not two numbers")
    for index, entry in opt["state"].items():
        name = f"optimizer.state.{index}"
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(params):
            raise _bad(where, name, f"names no parameter (the model has {len(params)})")
        if not isinstance(entry, dict):
            raise _bad(where, name, f"is {_kind(entry)}, not a dict")
        step = entry.get("step")
        if not ((isinstance(step, torch.Tensor) and step.numel() == 1 and step.is_floating_point()) or _number(step)):
            raise _bad(where, f"{name}.step", f"is {_kind(step)}, not a step count")
        for moment in ("exp_avg", "exp_avg_sq"):
            value, ref = entry.get(moment), params[index]
            if not isinstance(value, torch.Tensor):
                raise _bad(where, f"{name}.{moment}", f"is {_kind(value)}, not a tensor")
            if value.shape != ref.shape or not value.is_floating_point():
                raise _bad(where, f"{name}.{moment}", f"is {_kind(value)}; its parameter is {_kind(ref)}")


def _check_scheduler(sched: Any, where: str) -> None:
    if not isinstance(sched, dict):
        raise _bad(where, "scheduler", f"is {_kind(sched)}, not a dict")
    epoch, base = sched.get("last_epoch"), sched.get("base_lrs")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < -1:
        raise _bad(where, "scheduler.last_epoch", f"is {_kind(epoch)}, not a step count")
    if not (isinstance(base, list) and len(base) == 1 and _number(base[0])):
        raise _bad(where, "scheduler.base_lrs", "is not one learning rate")


def check_generator_state(state: Any, template: torch.Generator, where: str, what: str = "generator") -> None:
    """``state`` can be set on a generator like ``template`` (a throwaway one is used)."""
    ref = template.get_state()
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != ref.shape:
        raise _bad(where, what, f"is {_kind(state)}; a {template.device.type} generator state is a uint8 "
                                f"tensor of shape {tuple(ref.shape)}")
    try:
        torch.Generator(device=template.device).set_state(state)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise _bad(where, what, f"is not a valid generator state ({str(exc).splitlines()[0][:80]})") from None


def check_rng_state(rng: Any, where: str) -> None:
    """The global RNG states a step checkpoint restores (``checkpoint.rng_state``), each tried on a throwaway."""
    if not isinstance(rng, dict):
        raise _bad(where, "rng", f"is {_kind(rng)}, not a dict")
    for key in ("torch", "numpy", "python"):
        if key not in rng:
            raise _bad(where, f"rng.{key}", "is missing")
    check_generator_state(rng["torch"], torch.Generator(), where, "rng.torch")
    npy = rng["numpy"]
    try:
        if not (isinstance(npy, dict) and isinstance(npy.get("key"), torch.Tensor) and npy["key"].dtype == torch.int64
                and npy["key"].shape == (624,) and isinstance(npy.get("name"), str)):
            raise ValueError("not a MT19937 state dict")
        key = npy["key"].numpy()
        if key.min() < 0 or key.max() >= 2**32:
            raise ValueError("key outside uint32")
        np.random.RandomState().set_state((npy["name"], key.astype(np.uint32), npy["pos"], npy["has_gauss"],
                                           npy["cached_gaussian"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(where, "rng.numpy", f"is not a numpy RNG state ({exc})") from None
    py = rng["python"]
    try:
        if not (isinstance(py, dict) and isinstance(py.get("state"), list)):
            raise TypeError("not a dict with a state list")
        random.Random().setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise _bad(where, "rng.python", f"is not a Python RNG state ({exc})") from None
    if "cuda" in rng:
        cuda = rng["cuda"]
        if not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)):
            raise _bad(where, "rng.cuda", "is not a list of uint8 generator states")


def check_step_state(state: Any, model: torch.nn.Module, generator: torch.Generator, where: str, *,
                     ema: bool) -> None:
    """A step checkpoint of a training phase: everything ``Trainer.load_state_dict`` restores."""
    if not isinstance(state, dict):
        raise _bad(where, "the checkpoint", f"is {_kind(state)}")
    for key in ("model", "optimizer", "scheduler", "scaler", "generator", "rng", "step"):
        if key not in state:
            raise _bad(where, f"the entry '{key}'", "is missing")
    expected = expected_weights(model)
    check_weights(state["model"], expected, where, "model")
    _check_adam(state["optimizer"], [p for p in model.parameters()], where)
    _check_scheduler(state["scheduler"], where)
    if not isinstance(state["scaler"], dict):
        raise _bad(where, "scaler", f"is {_kind(state['scaler'])}, not a dict")
    if ema and state.get("ema_state") is not None:
        ema_state = state["ema_state"]
        if not isinstance(ema_state, dict):
            raise _bad(where, "ema_state", f"is {_kind(ema_state)}, not a dict")
        own = {f"module.{k}": v for k, v in expected.items()}
        own["n_averaged"] = torch.zeros((), dtype=torch.long)
        check_weights(ema_state, own, where, "ema_state")
    if state.get("ema") is not None:
        check_weights(state["ema"], expected, where, "ema")
    check_generator_state(state["generator"], generator, where)
    check_rng_state(state["rng"], where)
    world = state.get("world_size", 1)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise _bad(where, "world_size", f"is {_kind(world)}, not a process count")
