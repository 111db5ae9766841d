"""Methods: each is a ``Method`` object (``sinkflow.methods.base``) in one registry.

A method knows its phases (tasks the engine runs), how it samples, evaluates and describes itself.
Nothing outside a method tests its name: callers ask ``methods.of(cfg)`` for the object and call it.
Adding a method = its own file with a ``Method`` instance + one line in
``sinkflow.config.schema.METHOD_REGISTRY`` (where it lives, the phases it builds, its own keys and the
shared keys it reads).
"""

from __future__ import annotations

import importlib

from sinkflow.config import schema
from sinkflow.data import _distributions, distributions, sample_shape
from sinkflow.errors import SinkflowError
from sinkflow.methods.base import ChunkedTask, Method, Task, TrainingStep

__all__ = ["REGISTRY", "get", "of", "phases", "Method", "Task", "TrainingStep", "ChunkedTask",
           "distributions", "sample_shape", "_distributions"]

# Declared once, with each method's phases and keys, in sinkflow.config.schema.METHOD_REGISTRY: name ->
# "module:attribute" of its Method instance (imported on first use: POT, flows... load lazily).


def __getattr__(name: str):
    if name == "REGISTRY":
        return {m: spec.where for m, spec in schema.METHOD_REGISTRY.items()}
    if name == "METHOD_PHASES":
        return schema.METHOD_PHASES
    raise AttributeError(f"module 'sinkflow.methods' has no attribute {name!r}")


def get(method: str) -> Method:
    """The registered ``Method`` called ``method``."""
    if method not in schema.METHOD_REGISTRY:
        raise SinkflowError(f"unknown method '{method}'", f"choose one of {', '.join(schema.METHOD_REGISTRY)}")
    where = schema.METHOD_REGISTRY[method].where
    module, _, attr = where.partition(":")
    module = module if "." in module else f"sinkflow.methods.{module}"
    fix = "give MethodSpec the 'module:attribute' of its Method instance"
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:  # the entry's own typo, not an import inside the file (raised as it is)
        if not (exc.name and f"{module}.".startswith(f"{exc.name}.")):
            raise
        raise SinkflowError(f"method '{method}': its METHOD_REGISTRY entry names {where!r}, but there is no module "
                            f"{module}", fix) from None
    # the attribute looked up apart from the import: an AttributeError raised while the module itself ran (a bug in
    # the method's own file) was reported as "there is no METHOD in it", hiding the real error
    if not hasattr(loaded, attr):
        raise SinkflowError(f"method '{method}': its METHOD_REGISTRY entry names {where!r}, but there is no {attr} "
                            f"in {module}", fix)
    instance = getattr(loaded, attr)
    if instance.name != method:  # callers look its keys and phases up by ``name``: a KeyError traceback mid-run
        raise SinkflowError(f"the Method at {where} is named {instance.name!r}, not its registry key {method!r}",
                            f"set name = {method!r} on it (Method.name is its key in config.schema.METHOD_REGISTRY)")
    return instance


def of(cfg: dict) -> Method:
    """The method a config trains (``experiment.method``)."""
    return get(cfg["experiment"]["method"])


def phases(cfg: dict, source, target) -> list[Task]:
    """``of(cfg).phases(cfg, source, target)``, checked against the method's ``MethodSpec.phases``: the config's
    ``model.<phase>`` / ``train.<phase>`` sections, checkpoints, status and the memory plan follow the declared
    names, so a task named otherwise (or a training step whose ``model_key`` has no section) is refused here in one
    line, not as a KeyError traceback inside the Trainer or preflight."""
    method = of(cfg)
    tasks = method.phases(cfg, source, target)
    built, declared = tuple(t.name for t in tasks), schema.METHOD_PHASES[method.name]
    if built != declared:
        raise SinkflowError(f"method '{method.name}' built the phases ({', '.join(built)}), but its METHOD_REGISTRY "
                            f"entry declares ({', '.join(declared)})",
                            "name its tasks as MethodSpec.phases does, in the same order")
    for t in tasks:
        key = getattr(t, "model_key", None)
        if key is not None and key not in cfg["train"]:
            raise SinkflowError(f"method '{method.name}': phase '{t.name}' trains model_key '{key}', which has no "
                                "train / model section", "use a phase name of its MethodSpec (phases or new_phases)")
    return tasks
