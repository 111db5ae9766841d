"""Is a checkpoint's content what this run expects? Checked before anything is loaded or written.

``torch.load(weights_only=True)`` guarantees a checkpoint runs no code, not that it holds the right things:
a weight replaced by a list, an int64 or bool weight (``load_state_dict`` would copy it silently), a
missing ``model``, an Adam moment of the wrong shape, a generator or RNG state of another format. Each
would end in a traceback half-way through a resume (after ``status.json`` and the lock were rewritten) or
in garbage samples. These checks compare the content with the model, optimizer and generators the run
builds (a model built on the ``meta`` device is enough: only names, shapes and dtypes are read) and say
in one line which entry is wrong. RNG states are checked by setting them on throwaway generators, so
the checks never touch the process's own random streams.

Runtime layer: torch, numpy, ``sinkflow.errors`` and ``runner.checkpoint`` only.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from sinkflow.errors import SinkflowError
from sinkflow.runtime.checkpoint import non_finite

FIX = "delete it to resume from the checkpoint before it (or start a new run); sinkflow only resumes checkpoints it wrote"


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {_dtype(value)} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


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
        if value.dtype != ref.dtype and value.is_floating_point() and ref.is_floating_point():
            # another float width: the model was built (or the run trained) under another default dtype, a
            # notebook's torch.set_default_dtype(torch.float64); the file is sound, and deleting it lost the model
            raise SinkflowError(f"checkpoint {where} holds {_dtype(value)} weights ({what}.{key}) where the model "
                                f"built here holds {_dtype(ref)}", f"build the model under torch's default dtype "
                                f"{_dtype(value)} (torch.set_default_dtype(torch.{_dtype(value)})); the checkpoint "
                                "is intact")
        if value.dtype != ref.dtype:
            raise _bad(where, f"{what}.{key}", f"is {_kind(value)}; the model holds {_dtype(ref)}")
        if value.shape != ref.shape:
            raise SinkflowError(
                f"checkpoint {where} holds {what}.{key} of shape {tuple(value.shape)} but the configured model "
                f"needs {tuple(ref.shape)}", "resume with the model config the run was trained with")
        if value.is_sparse or value.layout != torch.strided:
            raise _bad(where, f"{what}.{key}", "is not a dense tensor")


def _finite(state: dict, where: str) -> None:
    """sinkflow never writes a non-finite checkpoint (``checkpoint.atomic_save``): one is damaged or crafted."""
    bad = non_finite(state)
    if bad:
        raise _bad(where, bad, "holds NaN or Inf (sinkflow never writes such a checkpoint)")


def expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict()


def check_final(state: Any, model: torch.nn.Module, where: str) -> None:
    """A training phase's ``final.pt``: what later phases and sampling read (``model`` and ``ema`` weights)."""
    if not isinstance(state, dict):
        raise _bad(where, "the checkpoint", f"is {_kind(state)}")
    _finite(state, where)
    expected = expected_weights(model)
    if "model" not in state:
        raise _bad(where, "the entry 'model'", "is missing")
    check_weights(state["model"], expected, where, "model")
    if state.get("ema") is not None:
        check_weights(state["ema"], expected, where, "ema")


def like(value: Any, template: Any, where: str, what: str) -> None:
    """``value`` has ``template``'s structure: the same keys, list lengths, and kinds of leaves (a bool for a
    bool, a whole number for an int, a finite number for a float, a tensor of the same dtype and shape)."""
    if isinstance(template, bool):
        ok = isinstance(value, bool)
    elif isinstance(template, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(template, float):
        ok = _number(value)
    elif template is None:
        ok = value is None
    elif isinstance(template, str):
        ok = isinstance(value, str)
    elif isinstance(template, torch.Tensor):
        ok = isinstance(value, torch.Tensor) and value.dtype == template.dtype and value.shape == template.shape
    elif isinstance(template, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(template):
            raise _bad(where, what, f"is {_kind(value)}; expected a list of {len(template)}")
        for i, (v, t) in enumerate(zip(value, template)):
            like(v, t, where, f"{what}.{i}")
        return
    elif isinstance(template, dict):
        if not isinstance(value, dict):
            raise _bad(where, what, f"is {_kind(value)}, not a dict")
        for key, t in template.items():
            if key not in value:
                raise _bad(where, f"{what}.{key}", "is missing")
            like(value[key], t, where, f"{what}.{key}")
        return
    else:
        ok = type(value) is type(template)
    if not ok:
        raise _bad(where, what, f"is {_kind(value)}; expected {_kind(template)}")


# Adam's flags that pick its code path: they must be what sinkflow builds (amsgrad would need a third moment)
_ADAM_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay")


def _check_adam(opt: Any, params: list[torch.Tensor], where: str) -> None:
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        raise _bad(where, "optimizer", f"is {_kind(opt)} without 'state' and 'param_groups'")
    groups = opt["param_groups"]
    if len(groups) != 1 or not isinstance(groups[0], dict):
        raise _bad(where, "optimizer.param_groups", f"has {len(groups)} groups; this phase's Adam has 1")
    group = groups[0]
    ids = group.get("params")
    if not (isinstance(ids, list) and len(ids) == len(params)
            and all(type(i) is int and i == k for k, i in enumerate(ids))):
        raise _bad(where, "optimizer.param_groups.0.params", f"does not list the model's {len(params)} parameters")
    for key in ("lr", "eps", "weight_decay", "initial_lr"):
        if key in group or key != "initial_lr":
            if not _number(group.get(key)) or group[key] < 0:
                raise _bad(where, f"optimizer.param_groups.0.{key}", f"is {_kind(group.get(key))}, not a number >= 0")
    betas = group.get("betas")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
        raise _bad(where, "optimizer.param_groups.0.betas", "is not two numbers in [0, 1)")
    for key in _ADAM_FLAGS:
        if key in group and group[key] is not False:
            raise _bad(where, f"optimizer.param_groups.0.{key}",
                       f"is {group[key] if group[key] is True else _kind(group[key])}; sinkflow's Adam has False")
    for key in ("foreach", "fused"):
        if key in group and not (group[key] is None or isinstance(group[key], bool)):
            raise _bad(where, f"optimizer.param_groups.0.{key}", f"is {_kind(group[key])}, not a bool or null")
    for index, entry in opt["state"].items():
        name = f"optimizer.state.{index}"
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(params):
            raise _bad(where, name, f"names no parameter (the model has {len(params)})")
        if not isinstance(entry, dict):
            raise _bad(where, name, f"is {_kind(entry)}, not a dict")
        step = entry.get("step")
        if not (isinstance(step, torch.Tensor) and step.shape == () and step.dtype == torch.float32):
            raise _bad(where, f"{name}.step", f"is {_kind(step)}, not a float32 step count")
        for moment in ("exp_avg", "exp_avg_sq"):
            value, ref = entry.get(moment), params[index]
            if not isinstance(value, torch.Tensor):
                raise _bad(where, f"{name}.{moment}", f"is {_kind(value)}, not a tensor")
            if value.shape != ref.shape or value.dtype != ref.dtype:
                raise _bad(where, f"{name}.{moment}", f"is {_kind(value)}; its parameter is {_kind(ref)}")


def _check_scheduler(sched: Any, where: str) -> None:
    """The LambdaLR state sinkflow saves (its lambdas are rebuilt from the config, saved as None)."""
    template = {"base_lrs": [1.0], "last_epoch": 0, "_step_count": 1, "_last_lr": [1.0], "lr_lambdas": [None]}
    like(sched, template, where, "scheduler")
    if sched["last_epoch"] < 0 or sched["_step_count"] < 0 or sched["base_lrs"][0] < 0:
        raise _bad(where, "scheduler", "holds a negative step count or learning rate")
    for key in ("_is_initial", "_get_lr_called_within_step"):
        if key in sched and not isinstance(sched[key], bool):
            raise _bad(where, f"scheduler.{key}", f"is {_kind(sched[key])}, not a bool")


def _check_scaler(scaler: Any, enabled: bool, where: str) -> None:
    """GradScaler's state: empty when it was disabled (a fresh scaler is used if fp16 is on now)."""
    if not isinstance(scaler, dict):
        raise _bad(where, "scaler", f"is {_kind(scaler)}, not a dict")
    if scaler and enabled:
        like(scaler, {"scale": 1.0, "growth_factor": 1.0, "backoff_factor": 1.0, "growth_interval": 1,
                      "_growth_tracker": 0}, where, "scaler")
        if not scaler["scale"] > 0:
            raise _bad(where, "scaler.scale", "is not a positive number")


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
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
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
                     ema: bool, scaler: bool) -> None:
    """A step checkpoint of a training phase: everything ``Trainer.load_state_dict`` restores."""
    if not isinstance(state, dict):
        raise _bad(where, "the checkpoint", f"is {_kind(state)}")
    _finite(state, where)
    for key in ("model", "optimizer", "scheduler", "scaler", "generator", "rng", "step"):
        if key not in state:
            raise _bad(where, f"the entry '{key}'", "is missing")
    expected = expected_weights(model)
    check_weights(state["model"], expected, where, "model")
    _check_adam(state["optimizer"], [p for p in model.parameters()], where)
    _check_scheduler(state["scheduler"], where)
    _check_scaler(state["scaler"], scaler, where)
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
